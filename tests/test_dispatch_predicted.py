"""Dispatch level ``predicted``: a performance model answers shape families the store has not
measured here, against real SQLite stores and a model trained on synthetic sweep keys."""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import mxdb
from mxdb import Dispatcher, DispatchOptions, MoEShape
from mxdb.costmodel.model import MODEL_SCHEMA, PerfModel
from mxdb.costmodel.train import Choice, Gate
from mxdb.errors import UsageError
from mxdb.fingerprint import fingerprint_document
from mxdb.models import Fingerprint
from mxdb.shapes import preset_shape
from mxdb.store import Store
from tests.test_dispatcher import H200, entry

#: the same device with another driver: equal under the ``device`` policy, not ``strict``
OTHER = H200.model_copy(update={"driver": "999.0"})
#: the families the synthetic sweep measures (presets, as perf_sweep.py names them)
SWEPT = ("mixtral-8x7b", "qwen3-30b-a3b", "olmoe-1b-7b")
#: a family no sweep measured, and one of the swept families
NEW = preset_shape("gpt-oss-20b", 4, "bf16")
SWEPT_SHAPE = preset_shape("qwen3-30b-a3b", 16, "bf16")
SOURCES = {"uniform": ("uniform", {}), "zipf1.2": ("zipf", {"s": 1.2})}


def _samples(time_us: float, arm: int) -> list[float]:
    """7 rounds around ``time_us``, a little spread (deterministic)."""
    return [time_us * (1 + 0.001 * ((r * 7 + arm) % 5)) for r in range(7)]


def sweep_keys() -> list[dict[str, Any]]:
    """Sweep keys in the raw format of ``benchmarks/perf_sweep.py``: at every key FlagGems'
    choice three times (baseline and two controls) and six menu configs, of which the first
    is 25% faster and the rest 10% slower."""
    from mxdb.configs import KernelConfig
    from mxdb.costmodel.train import candidates
    from mxdb.resources import flaggems_default_config
    from mxdb.routing import expert_counts, trace_hash
    from mxdb.routing_gen import generate
    from mxdb.tune.traces import classify

    keys: list[dict[str, Any]] = []
    for fam in SWEPT:
        for m in (4, 64):
            shape = preset_shape(fam, m, "bf16")
            base = KernelConfig.uniform(flaggems_default_config(shape))
            cands = candidates(shape)[:6]
            for n, (source, (kind, params)) in enumerate(SOURCES.items()):
                seed = 1000 * m + n
                ids = generate(kind, m, shape.experts, shape.topk, seed, **params)
                arms = [
                    {"config": base.model_dump(), "role": role, "status": "ok",
                     "samples": _samples(100.0, j), "error": None}
                    for j, role in enumerate(("baseline", "control", "control"))
                ] + [
                    {"config": c.model_dump(), "role": "candidate", "status": "ok",
                     "samples": _samples(80.0 if j == 0 else 110.0, j + 3), "error": None}
                    for j, c in enumerate(cands)
                ]  # fmt: skip
                keys.append({
                    "family": fam, "shape": shape.to_dict(), "tokens": m, "source": source,
                    "routing": {"kind": kind, "params": params, "seed": seed},
                    "trace_hash": trace_hash(ids, shape.experts),
                    "counts": [int(x) for x in expert_counts(ids, shape.experts)],
                    "routing_class": classify(ids, shape.experts),
                    "baseline": base.model_dump(),
                    "baseline_restated": base.model_dump(),
                    "rounds": 7, "calls_per_sample": 8, "arms": arms,
                })  # fmt: skip
    return keys


@functools.lru_cache(maxsize=1)
def _trained() -> str:
    from mxdb.costmodel.train import train

    return json.dumps(train(sweep_keys()))


def model_doc(
    fingerprint: Fingerprint = H200, gate: dict[str, float] | None = None
) -> dict[str, Any]:
    """A ``mxdb.perf-model`` document of the model trained on :func:`sweep_keys`."""
    doc = json.loads(_trained())
    return {
        "schema": MODEL_SCHEMA,
        "model": doc["model"],
        "calibration": doc["calibration"],
        "gate": gate or doc["gate"],
        "fingerprint_hash": fingerprint.hash,
        "shape_families": sorted({preset_shape(f, 1).family for f in SWEPT}),
        "chosen": doc["chosen"],
        "classes": doc["classes"],
    }


def write_model(
    folder: Path,
    fingerprint: Fingerprint = H200,
    *,
    gate: dict[str, float] | None = None,
    with_fingerprint: bool = True,
    doc: dict[str, Any] | None = None,
) -> Path:
    """A model bundle's files: model.json, and the fingerprint of the host it was trained on."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "model.json"
    path.write_text(json.dumps(doc or model_doc(fingerprint, gate)))
    if with_fingerprint:
        (folder / "fingerprint.json").write_text(json.dumps(fingerprint_document(fingerprint)))
    return path


@pytest.fixture()
def store(tmp_path: Path) -> Iterator[Store]:
    s = Store.open(f"sqlite:///{tmp_path / 'mxdb.sqlite'}")
    s.put_fingerprint(H200)
    yield s
    s.close()


@pytest.fixture()
def model_path(tmp_path: Path) -> Path:
    return write_model(tmp_path / "model")


def dispatcher(store: Store | None, model: Any, **kw: Any) -> Dispatcher:
    return Dispatcher(store, H200, DispatchOptions(model=model, refresh_interval=0, **kw))


class CountingModel(PerfModel):
    """A loaded model that counts the keys it is asked (the dispatcher asks ``answer``)."""

    asked: list[tuple[MoEShape, str]]

    def answer(self, shape: MoEShape, routing_class: str) -> Choice | None:
        self.asked.append((shape, routing_class))
        return super().answer(shape, routing_class)


def counting(path: Path) -> CountingModel:
    m = PerfModel.load(path)
    model = CountingModel(m.forest, m.calibration, m.gate, m.fingerprint_hash, m.families, m.path)
    object.__setattr__(model, "asked", [])
    return model


# -- answers -------------------------------------------------------------------------------


def test_an_unmeasured_family_is_answered_by_the_model(store: Store, model_path: Path) -> None:
    store.add_entries([entry()])  # the store knows Mixtral-8x7B, not gpt-oss-20b
    expected = PerfModel.load(model_path).answer(NEW, "uniform")
    assert expected is not None and expected.confidence is not None
    d = dispatcher(store, model_path).dispatch(NEW, "uniform")
    assert (d.level, d.reason, d.entry_id) == ("predicted", "predicted", None)
    assert d.config == expected.config and not d.is_fallback
    assert d.confidence == round(expected.confidence, 4) and 0.0 < d.confidence <= 1.0
    doc = d.to_dict()
    assert doc["level"] == "predicted" and doc["triton_config"]["gemm1"]["BLOCK_SIZE_M"] > 0
    assert doc["reason_text"] == mxdb.decision.REASONS["predicted"]
    assert "predicted" in mxdb.decision.LEVELS


def test_a_family_the_sweeps_measured_but_the_store_did_not_is_answered(
    store: Store, model_path: Path
) -> None:
    assert SWEPT_SHAPE.family in PerfModel.load(model_path).families
    d = dispatcher(store, model_path).dispatch(SWEPT_SHAPE, "uniform")
    assert (d.level, d.reason) == ("predicted", "predicted")


def test_without_a_store_the_model_answers(model_path: Path) -> None:
    d = dispatcher(None, model_path).dispatch(NEW, "uniform")
    assert d.level == "predicted"


def test_a_loaded_model_and_a_bundle_folder_are_accepted(model_path: Path) -> None:
    loaded = PerfModel.load(model_path)
    assert DispatchOptions(model=loaded).perf_model is loaded
    assert DispatchOptions(model=model_path.parent).perf_model == loaded
    assert DispatchOptions().perf_model is None


# -- where the store's decision stands -------------------------------------------------------


def test_a_family_the_store_measured_here_is_not_answered_by_the_model(
    store: Store, model_path: Path
) -> None:
    store.add_entries([entry(NEW)])
    disp = dispatcher(store, model_path)
    assert disp.dispatch(NEW, "uniform").reason == "exact_match"
    # the store's own fallbacks for the family stand: it measured the family here
    assert disp.dispatch(NEW.with_tokens(1024), "uniform").reason == "tokens_out_of_range"
    assert disp.dispatch(NEW, "sparse").reason == "routing_class_far"


@pytest.mark.parametrize("status, reason", [("rejected", "no_verified_entry"), ("stale", "stale")])
def test_rows_of_any_status_measured_here_keep_the_stores_fallback(
    store: Store, model_path: Path, status: str, reason: str
) -> None:
    store.add_entries([entry(NEW, status=status)])
    d = dispatcher(store, model_path).dispatch(NEW, "uniform")
    assert (d.level, d.reason) == ("fallback", reason)


def test_rows_of_other_environments_only_leave_the_family_to_the_model(
    store: Store, model_path: Path
) -> None:
    far = H200.model_copy(update={"device_name": "NVIDIA A100", "arch": "sm_80"})
    store.put_fingerprint(far)
    store.add_entries([entry(NEW, fingerprint=far), entry(NEW.with_tokens(64), fingerprint=None,
                                                         source="vllm", status="imported")])  # fmt: skip
    assert dispatcher(store, None).dispatch(NEW, "uniform").reason == "fingerprint_mismatch"
    d = dispatcher(store, model_path).dispatch(NEW, "uniform")
    assert (d.level, d.reason) == ("predicted", "predicted")


def test_non_bf16_calls_fall_back(store: Store, model_path: Path) -> None:
    d = dispatcher(store, model_path).dispatch(MoEShape(32, 2880, 2880, 4, 4, "fp16"), "uniform")
    assert (d.level, d.reason) == ("fallback", "no_entry")


def test_an_unknown_routing_class_is_not_asked(store: Store, model_path: Path) -> None:
    model = counting(model_path)
    assert dispatcher(store, model).dispatch(NEW, "bursty").reason == "unknown_routing_class"
    assert model.asked == []


# -- fingerprints --------------------------------------------------------------------------


def test_a_model_of_another_environment_is_not_asked(store: Store, tmp_path: Path) -> None:
    path = write_model(tmp_path / "other", OTHER)
    model = counting(path)
    d = dispatcher(store, model).dispatch(NEW, "uniform")
    assert (d.level, d.reason) == ("fallback", "no_entry")
    assert model.asked == []


def test_the_match_policy_applies_to_the_models_fingerprint(store: Store, tmp_path: Path) -> None:
    # the bundle's fingerprint.json gives the components of the model's fingerprint
    path = write_model(tmp_path / "other", OTHER)
    assert dispatcher(store, path, policy="device").dispatch(NEW, "uniform").level == "predicted"
    assert dispatcher(store, path, policy="strict").dispatch(NEW, "uniform").level == "fallback"
    # without it, only the store's fingerprints can tell what the hash stands for
    bare = write_model(tmp_path / "bare", OTHER, with_fingerprint=False)
    assert dispatcher(store, bare, policy="device").dispatch(NEW, "uniform").level == "fallback"
    store.put_fingerprint(OTHER)
    assert dispatcher(store, bare, policy="device").dispatch(NEW, "uniform").level == "predicted"


def test_a_bundle_fingerprint_of_another_hash_is_not_used(store: Store, tmp_path: Path) -> None:
    path = write_model(tmp_path / "m", OTHER)
    (path.parent / "fingerprint.json").write_text(json.dumps(fingerprint_document(H200)))
    assert dispatcher(store, path, policy="device").dispatch(NEW, "uniform").level == "fallback"


# -- refusals and failures -------------------------------------------------------------------


def test_a_choice_the_gate_refuses_is_prediction_not_confident(
    store: Store, tmp_path: Path
) -> None:
    path = write_model(tmp_path / "strict", gate={"min_confidence": 1.01, "min_speedup": 1.03})
    ch = PerfModel.load(path).choice(NEW, "uniform")
    assert ch.config is not None and not Gate(1.01, 1.03).admits(ch)
    d = dispatcher(store, path).dispatch(NEW, "uniform")
    assert (d.level, d.reason, d.config, d.confidence) == (
        "fallback", "prediction_not_confident", None, 0.0
    )  # fmt: skip


def test_a_model_that_fails_is_model_error_and_never_raises(store: Store, model_path: Path) -> None:
    class Failing(PerfModel):
        """A model that passes the checks of loading and fails when answering."""

        def answer(self, shape: MoEShape, routing_class: str) -> Choice | None:
            raise FloatingPointError("the forest cannot be evaluated")

    m = PerfModel.load(model_path)
    failing = Failing(m.forest, m.calibration, m.gate, m.fingerprint_hash, m.families, m.path)
    disp = dispatcher(store, failing)
    for _ in range(2):
        d = disp.dispatch(NEW, "uniform")
        assert (d.level, d.reason, d.config) == ("fallback", "model_error", None)
    assert disp.resolve(NEW, "hot").reason == "model_error"
    assert disp.alternatives(NEW, "uniform") == []


# -- caching -------------------------------------------------------------------------------


def test_the_model_is_asked_once_per_key(store: Store, model_path: Path) -> None:
    model = counting(model_path)
    disp = dispatcher(store, model)
    first = disp.dispatch(NEW, "uniform")
    assert first.level == "predicted"
    assert all(disp.dispatch(NEW, "uniform") is first for _ in range(5))
    disp.dispatch(NEW, "hot")
    disp.dispatch(NEW.with_tokens(8), "uniform")
    assert model.asked == [(NEW, "uniform"), (NEW, "hot"), (NEW.with_tokens(8), "uniform")]
    # another family's write drops the caches (synchronous mode); the model's answers stay
    store.add_entries([entry()])
    assert disp.dispatch(NEW, "uniform") == first
    disp.refresh()
    assert disp.dispatch(NEW, "uniform") == first and len(model.asked) == 3
    # uncached paths (resolve, alternatives) reuse the model's answer too
    assert disp.resolve(NEW, "uniform") == first
    assert disp.alternatives(NEW, "uniform") == [first]
    assert len(model.asked) == 3


def test_a_background_refresh_keeps_the_answer_until_the_store_measures_the_family(
    store: Store, model_path: Path
) -> None:
    model = counting(model_path)
    disp = Dispatcher(store, H200, DispatchOptions(model=model, refresh_interval=3600))
    try:
        assert disp.dispatch(NEW, "uniform").level == "predicted"
        store.add_entries([entry()])
        assert disp.refresh_now() is True
        assert disp.dispatch(NEW, "uniform").level == "predicted" and len(model.asked) == 1
        store.add_entries([entry(NEW)])  # now measured here: the store's entry answers
        assert disp.refresh_now() is True
        assert disp.dispatch(NEW, "uniform").reason == "exact_match"
        assert len(model.asked) == 1
    finally:
        disp.close()


# -- loading -------------------------------------------------------------------------------


def test_a_model_that_cannot_be_loaded_is_a_usage_error_naming_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere" / "model.json"
    with pytest.raises(UsageError, match="does not exist") as exc:
        DispatchOptions(model=missing)
    assert str(missing) in str(exc.value)
    not_a_model = tmp_path / "other.json"
    not_a_model.write_text(json.dumps({"schema": "mxdb.store-export"}))
    with pytest.raises(UsageError, match="not a performance model") as exc:
        DispatchOptions(model=not_a_model)
    assert str(not_a_model) in str(exc.value)
    doc = model_doc()
    doc["model"] = {**doc["model"], "n_features": 3}
    old = write_model(tmp_path / "old", doc=doc)
    with pytest.raises(UsageError, match="features") as exc:
        DispatchOptions(model=old)
    assert str(old) in str(exc.value)
    del doc["gate"]
    with pytest.raises(UsageError, match="malformed"):
        DispatchOptions(model=write_model(tmp_path / "nogate", doc=doc))
    with pytest.raises(UsageError, match="PerfModel"):
        DispatchOptions(model=42)  # type: ignore[arg-type]


def test_configure_reads_mxdb_model(
    store: Store, model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import mxdb.dispatcher as dispatcher_module

    monkeypatch.setattr(dispatcher_module, "_default", dispatcher_module._default)  # restored after
    monkeypatch.setenv("MXDB_MODEL", str(model_path))
    d = mxdb.configure(store, fingerprint=H200)
    try:
        assert d.options.perf_model is not None
        assert mxdb.dispatch(NEW, "uniform").level == "predicted"
        # explicit options are taken as given
        plain = mxdb.configure(store, fingerprint=H200, options=DispatchOptions())
        plain.close()
        assert mxdb.dispatch(NEW, "uniform").reason == "no_entry"
    finally:
        d.close()
    monkeypatch.setenv("MXDB_MODEL", str(model_path.parent / "missing.json"))
    with pytest.raises(UsageError, match=r"\$MXDB_MODEL: .*missing\.json"):
        mxdb.configure(store, fingerprint=H200)
    monkeypatch.setenv("MXDB_MODEL", "")
    mxdb.configure(store, fingerprint=H200).close()


def test_a_dispatcher_without_a_model_does_not_load_the_model_code() -> None:
    code = (
        "import sys, mxdb\n"
        "d = mxdb.Dispatcher(None, None, mxdb.DispatchOptions(refresh_interval=0))\n"
        "d.dispatch(mxdb.MoEShape(8, 4096, 14336, 2, 4, 'bf16'), 'uniform')\n"
        "print(sorted(m for m in sys.modules if m.startswith('mxdb.costmodel')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
