"""The confidence dispatcher against real SQLite stores: levels, reasons, caching, other writers."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import mxdb
from mxdb import Dispatcher, DispatchOptions, KernelConfig, MoEShape
from mxdb.configs import GemmConfig
from mxdb.models import Entry, Fingerprint
from mxdb.store import Store

H200 = Fingerprint(
    vendor="nvidia",
    device_name="NVIDIA H200",
    arch="sm_90",
    sm_count=132,
    smem_per_block=232448,
    warp_size=32,
    driver="580.159.04",
    toolkit="13.0",
    torch="2.11.0+cu130",
    triton="3.6.0",
    flag_gems="5.0.2",
    kernel_source_hash="abc123",
    mxdb="0.1.0",
)
SHAPE = MoEShape(experts=8, hidden=4096, intermediate=14336, topk=2, tokens=4, dtype="bf16")
CFG_A = KernelConfig.uniform(
    GemmConfig(block_m=16, block_n=128, block_k=64, num_warps=4, num_stages=3)
)
CFG_B = KernelConfig(
    gemm1=GemmConfig(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=4),
    gemm2=GemmConfig(block_m=32, block_n=64, block_k=64, num_warps=4, num_stages=2),
    align_block=32,
)


def incumbent_row(shape: MoEShape) -> KernelConfig:
    """The row of vLLM's shipped H200 table the incumbent level answers for ``shape``."""
    from mxdb.incumbent import incumbent

    inc = incumbent(shape, "NVIDIA H200")
    assert inc.source == "vllm", inc
    return inc.config


def entry(
    shape: MoEShape = SHAPE,
    config: KernelConfig = CFG_A,
    *,
    routing_class: str = "uniform",
    status: str = "verified",
    fingerprint: Fingerprint | None = H200,
    speedup: float = 1.08,
    source: str = "tune",
    validation: list[dict[str, object]] | None = None,
    confidence: float | None = None,
) -> Entry:
    return Entry(
        op=shape.op,
        dtype=shape.dtype,
        family=shape.family,
        dims=shape.dims(),
        tokens=shape.tokens,
        routing_class=routing_class,
        config=config.model_dump(),
        config_hash=config.hash,
        fingerprint_hash=fingerprint.hash if fingerprint else None,
        device_name=fingerprint.device_name if fingerprint else None,
        status=status,
        source=source,
        speedup=speedup,
        noise_band=0.01,  # type: ignore[arg-type]
        validation=validation,
        confidence=confidence,
    )


def won(tokens: int, routing_class: str = "uniform", ok: bool = True) -> dict[str, object]:
    """One held-out comparison of an entry's validation record."""
    return {"comparison": f"tokens-{tokens}", "tokens": tokens, "routing_class": routing_class,
            "outcome": "faster" if ok else "same", "won": ok}  # fmt: skip


@pytest.fixture()
def db_path(tmp_path: Path) -> Path:
    return tmp_path / "mxdb.sqlite"


@pytest.fixture()
def store(db_path: Path) -> Store:
    s = Store.open(f"sqlite:///{db_path}")
    s.put_fingerprint(H200)
    yield s  # type: ignore[misc]
    s.close()


def test_exact_match(store: Store) -> None:
    [eid] = store.add_entries([entry()])
    d = Dispatcher(store, H200).dispatch(SHAPE, "uniform")
    assert (d.level, d.reason, d.confidence, d.entry_id) == ("exact", "exact_match", 1.0, eid)
    assert d.config == CFG_A
    assert d.to_dict()["triton_config"]["gemm1"]["BLOCK_SIZE_N"] == 128


def test_routing_none_means_uniform_and_features_objects_work(store: Store) -> None:
    store.add_entries([entry()])
    disp = Dispatcher(store, H200)
    assert disp.dispatch(SHAPE).reason == "exact_match"

    class Features:  # what mxdb.routing.RoutingFeatures offers the dispatcher
        routing_class = "uniform"

    assert disp.dispatch(SHAPE, Features()).reason == "exact_match"


def test_different_gemm_configs_survive_the_store(store: Store) -> None:
    store.add_entries([entry(config=CFG_B)])
    d = Dispatcher(store, H200).dispatch(SHAPE, "uniform")
    assert d.config == CFG_B and d.config.gemm1 != d.config.gemm2 and d.config.align_block == 32


def test_neighbour_tokens_need_held_out_support(store: Store) -> None:
    """A neighbouring token count is answered only between the entry's key and a won
    held-out instance at that side; elsewhere the fallback says why."""
    held = [won(4), won(4), won(4)]
    store.add_entries([entry(validation=[*held, won(6), won(3, ok=False)], confidence=1.0)])
    disp = Dispatcher(store, H200)
    near = disp.dispatch(SHAPE.with_tokens(6), "uniform")
    assert (near.level, near.reason, near.config) == ("neighbour", "neighbour_tokens", CFG_A)
    assert near.confidence == 1.0  # 4 of 4 instances won on that side (M=4 and M=6)
    assert disp.dispatch(SHAPE.with_tokens(5), "uniform").reason == "neighbour_tokens"
    # beyond the validated instance, or on the side where the instance was lost: FlagGems
    assert disp.dispatch(SHAPE.with_tokens(8), "uniform").reason == "neighbour_not_validated"
    assert disp.dispatch(SHAPE.with_tokens(3), "uniform").reason == "neighbour_not_validated"
    far = disp.dispatch(SHAPE.with_tokens(9), "uniform")
    far_row = incumbent_row(SHAPE.with_tokens(9))
    assert (far.level, far.reason, far.config) == ("incumbent", "tokens_out_of_range", far_row)


def test_entries_without_held_out_validation_answer_their_own_key_only(store: Store) -> None:
    store.add_entries([entry()])
    disp = Dispatcher(store, H200)
    assert disp.dispatch(SHAPE, "uniform").reason == "exact_match"
    assert disp.dispatch(SHAPE.with_tokens(6), "uniform").reason == "neighbour_not_validated"
    assert disp.dispatch(SHAPE, "skewed").reason == "neighbour_not_validated"


def test_confidence_is_the_fraction_of_held_out_instances_won(store: Store) -> None:
    store.add_entries([entry(validation=[won(4), won(4), won(4)], confidence=0.75)])
    d = Dispatcher(store, H200).dispatch(SHAPE, "uniform")
    assert (d.reason, d.confidence) == ("exact_match", 0.75)


def test_invalid_stored_rows_fall_back_instead_of_raising(store: Store, db_path: Path) -> None:
    import sqlite3

    [eid] = store.add_entries([entry()])
    with sqlite3.connect(db_path) as conn:  # a row edited behind mxdb's back
        conn.execute("UPDATE entries SET config = ? WHERE id = ?", ('{"gemm1": 3}', eid))
    d = Dispatcher(store, H200).dispatch(SHAPE, "uniform")
    assert (d.level, d.reason, d.config) == ("incumbent", "invalid_entry", incumbent_row(SHAPE))


def test_nearest_and_best_entry_wins(store: Store) -> None:
    store.add_entries(
        [
            entry(SHAPE.with_tokens(16), CFG_A),
            entry(SHAPE.with_tokens(4), CFG_B, speedup=1.02, validation=[won(6)]),
            entry(SHAPE.with_tokens(4), CFG_A, speedup=1.09, source="tune2", validation=[won(6)]),
        ]
    )
    disp = Dispatcher(store, H200)
    assert disp.dispatch(SHAPE.with_tokens(4), "uniform").config == CFG_A  # higher speedup
    assert disp.dispatch(SHAPE.with_tokens(5), "uniform").tokens == 4


def test_routing_classes_same_adjacent_far(store: Store) -> None:
    # an adjacent class is answered where held-out instances of that class were won
    store.add_entries([entry(routing_class="uniform", validation=[won(4), won(4, "skewed")])])
    disp = Dispatcher(store, H200)
    adj = disp.dispatch(SHAPE, "skewed")
    assert (adj.level, adj.reason) == ("neighbour", "adjacent_routing") and adj.confidence == 1.0
    assert disp.dispatch(SHAPE, "hot").reason == "routing_class_far"
    assert disp.dispatch(SHAPE, "zipfy").reason == "unknown_routing_class"
    store.add_entries([entry(routing_class="hot", config=CFG_B)])
    disp.refresh()
    hot = disp.dispatch(SHAPE, "hot")
    assert (hot.level, hot.config) == ("exact", CFG_B)


def test_the_calls_own_class_outranks_an_adjacent_one_at_the_same_tokens(store: Store) -> None:
    # an adjacent class's entry with the larger speedup, validated on this class too, and the
    # call's own class's entry at the same token count: the own class answers (an adjacent
    # class's entry was chosen on other routings)
    store.add_entries([
        entry(routing_class="hot", speedup=1.2, validation=[won(4, "skewed")]),
        entry(routing_class="skewed", config=CFG_B, speedup=1.05),
    ])  # fmt: skip
    d = Dispatcher(store, H200).dispatch(SHAPE, "skewed")
    assert (d.config, d.reason, d.routing_class) == (CFG_B, "exact_match", "skewed")
    # without the own class's entry the adjacent one answers, with its reason
    other = SHAPE.with_tokens(64)
    store.add_entries([entry(other, routing_class="hot", validation=[won(64, "skewed")])])
    d2 = Dispatcher(store, H200).dispatch(other, "skewed")
    assert (d2.config, d2.reason) == (CFG_A, "adjacent_routing")


def test_every_answer_with_an_entry_has_a_reason_the_peers_audit_knows(store: Store) -> None:
    from mxdb.evidence.peers import ENTRY_REASONS

    store.add_entries([
        entry(),
        entry(SHAPE.with_tokens(64), routing_class="hot", validation=[won(64, "skewed")]),
        entry(SHAPE.with_tokens(512), status="parity", config=CFG_B),
        entry(SHAPE.with_tokens(2048), validation=[won(2900)]),
        entry(SHAPE.with_tokens(256), routing_class="hot", validation=[won(300, "skewed")]),
    ])  # fmt: skip
    disp = Dispatcher(store, H200)
    calls = [(4, "uniform"), (64, "skewed"), (512, "uniform"), (2600, "uniform"), (280, "skewed")]
    reasons = {disp.dispatch(SHAPE.with_tokens(m), c).reason for m, c in calls}
    assert reasons == {
        "exact_match", "adjacent_routing", "parity", "neighbour_tokens",
        "neighbour_tokens_adjacent_routing",
    }  # fmt: skip
    assert reasons <= set(ENTRY_REASONS)


def test_fallback_reasons(store: Store) -> None:
    disp = Dispatcher(store, H200)
    assert disp.dispatch(SHAPE).reason == "no_entry"
    store.add_entries([entry(status="imported", fingerprint=None, source="vllm")])
    disp.refresh()
    assert disp.dispatch(SHAPE).reason == "no_verified_entry"

    other = H200.model_copy(update={"triton": "3.7.0"})
    assert Dispatcher(store, other).dispatch(SHAPE).reason == "no_verified_entry"
    [eid] = store.add_entries([entry()])
    assert Dispatcher(store, other).dispatch(SHAPE).reason == "fingerprint_mismatch"
    assert Dispatcher(store, None).dispatch(SHAPE).reason == "fingerprint_mismatch"
    store.set_status([eid], "stale", "triton 3.6.0 -> 3.7.0")
    assert Dispatcher(store, H200).dispatch(SHAPE).reason == "stale"
    assert Dispatcher(None, H200).dispatch(SHAPE).reason == "no_entry"


def test_device_policy_tolerates_a_driver_upgrade(store: Store) -> None:
    store.add_entries([entry()])
    upgraded = H200.model_copy(update={"driver": "590.0", "torch": "2.12.0"})
    strict = Dispatcher(store, upgraded, DispatchOptions(policy="strict")).dispatch(SHAPE)
    device = Dispatcher(store, upgraded, DispatchOptions(policy="device")).dispatch(SHAPE)
    assert strict.reason == "fingerprint_mismatch"
    assert device.reason == "exact_match"
    new_gpu = H200.model_copy(update={"device_name": "NVIDIA H100", "smem_per_block": 232448})
    assert Dispatcher(store, new_gpu, DispatchOptions(policy="device")).dispatch(SHAPE).is_fallback


def test_other_dtypes_and_families_do_not_match(store: Store) -> None:
    store.add_entries([entry()])
    disp = Dispatcher(store, H200)
    assert disp.dispatch(MoEShape(8, 4096, 14336, 2, 4, "fp16")).reason == "no_entry"
    assert disp.dispatch(MoEShape(8, 4096, 14336, 1, 4, "bf16")).reason == "no_entry"


def test_bad_arguments_are_usage_errors(store: Store) -> None:
    disp = Dispatcher(store, H200)
    with pytest.raises(mxdb.errors.UsageError, match="dispatch needs a shape"):
        disp.dispatch((8, 4096), "uniform")
    with pytest.raises(mxdb.errors.UsageError, match="routing must be"):
        disp.dispatch(SHAPE, 3.5)
    with pytest.raises(mxdb.errors.UsageError, match="policy"):
        DispatchOptions(policy="loose")


def test_hot_path_does_not_query_the_store(store: Store) -> None:
    store.add_entries([entry()])
    disp = Dispatcher(store, H200, DispatchOptions(refresh_interval=3600))
    calls = {"family_rows": 0, "generation": 0}
    real_rows, real_gen = store.family_rows, store.generation

    def rows(*a: object) -> object:
        calls["family_rows"] += 1
        return real_rows(*a)  # type: ignore[arg-type]

    def gen() -> int:
        calls["generation"] += 1
        return real_gen()

    store.family_rows, store.generation = rows, gen  # type: ignore[method-assign]
    for m in (4, 5, 6, 7, 8):
        for _ in range(2000):
            disp.dispatch(SHAPE.with_tokens(m), "uniform")
    assert calls == {"family_rows": 1, "generation": 0}


WRITER = """
import sys
from mxdb.store import Store
from tests.test_dispatcher import entry, SHAPE, CFG_B
s = Store.open(sys.argv[1])
s.add_entries([entry(SHAPE.with_tokens(64), CFG_B)])
s.close()
"""


def test_sees_entries_written_by_another_process(store: Store, db_path: Path) -> None:
    disp = Dispatcher(store, H200, DispatchOptions(refresh_interval=0.05))
    lazy = Dispatcher(store, H200, DispatchOptions(refresh_interval=3600))
    shape64 = SHAPE.with_tokens(64)
    assert disp.dispatch(shape64).reason == "no_entry"
    assert lazy.dispatch(shape64).reason == "no_entry"
    root = Path(__file__).resolve().parents[1]
    subprocess.run([sys.executable, "-c", WRITER, f"sqlite:///{db_path}"], check=True, cwd=root)
    assert lazy.dispatch(shape64).reason == "no_entry"  # cached until its next poll
    time.sleep(0.1)
    d = disp.dispatch(shape64)
    assert (d.reason, d.config) == ("exact_match", CFG_B)


def test_threads_dispatch_while_the_store_changes(store: Store) -> None:
    store.add_entries([entry(validation=[won(6)])])
    disp = Dispatcher(store, H200, DispatchOptions(refresh_interval=0.001))
    errors: list[BaseException] = []
    seen: set[str] = set()

    def reader() -> None:
        try:
            for i in range(3000):
                d = disp.dispatch(SHAPE.with_tokens(4 + i % 3), "uniform")
                assert d.config is not None
                seen.add(d.reason)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=reader) for _ in range(4)]
    for t in threads:
        t.start()
    for m in (5, 6):
        store.add_entries([entry(SHAPE.with_tokens(m), CFG_B, validation=[won(m + 2)])])
    for t in threads:
        t.join()
    assert not errors
    assert "exact_match" in seen


def test_module_level_dispatch_uses_configured_store(store: Store) -> None:
    store.add_entries([entry()])
    disp = mxdb.configure(store, fingerprint=H200)
    try:
        assert mxdb.dispatch(SHAPE, "uniform").reason == "exact_match"
        assert mxdb.dispatch(SHAPE.with_tokens(4096)).level == "incumbent"
    finally:
        mxdb.dispatcher._default = None
    assert disp.store is store


def test_the_dispatcher_is_generic_over_the_op(store: Store) -> None:
    from mxdb.shapes import OpShape

    shape = OpShape("rms_norm", {"hidden": 4096}, tokens=8, dtype="bf16")
    choice = {"impl": "fused_triton"}
    store.add_entries(
        [
            Entry(
                op="rms_norm", dtype="bf16", family=shape.family, dims={"hidden": 4096, "tokens": 8},
                tokens=8, config=choice, config_hash="impl-fused", fingerprint_hash=H200.hash,
                status="verified", source="tune", speedup=1.4,
            )
        ]
    )  # fmt: skip
    disp = Dispatcher(store, H200)
    d = disp.dispatch(shape, "uniform")
    assert (d.level, d.config["impl"]) == ("exact", "fused_triton")
    assert d.to_dict()["config"] == choice and d.to_dict()["triton_config"] is None
    # the MoE family with the same dtype is not confused with it
    assert disp.dispatch(SHAPE).reason == "no_entry"
    assert OpShape("rms_norm", {"hidden": 4096}, 8) == shape
    import pickle

    assert pickle.loads(pickle.dumps(shape)) == shape


def test_baseline_records_answer_with_flaggems_choice(store: Store) -> None:
    """A key the tuner measured without beating FlagGems' choice answers the fallback there,
    and keeps a farther verified neighbour from answering for it."""
    base_cfg = KernelConfig.uniform(
        GemmConfig(block_m=16, block_n=64, block_k=64, num_warps=4, num_stages=2)
    )
    store.add_entries(
        [
            entry(SHAPE.with_tokens(16), CFG_A, validation=[won(12)]),  # verified at M=16
            entry(SHAPE.with_tokens(8), base_cfg, status="baseline", speedup=1.0),
            # both at M=32 (two traces of one class disagree): the baseline record wins
            entry(SHAPE.with_tokens(32), base_cfg, status="baseline", speedup=1.0),
            entry(SHAPE.with_tokens(32), CFG_B, speedup=1.03),
        ]
    )
    disp = Dispatcher(store, H200)
    exact = disp.dispatch(SHAPE.with_tokens(8), "uniform")
    # FlagGems' choice was measured there against every candidate (the incumbent's row among
    # them): that answer stands, the incumbent does not replace it
    assert (exact.level, exact.reason, exact.config) == ("fallback", "baseline_measured", None)
    # M=9 is nearer the measured M=8 than the verified M=16
    assert disp.dispatch(SHAPE.with_tokens(9), "uniform").reason == "baseline_measured"
    assert disp.dispatch(SHAPE.with_tokens(15), "uniform").config == CFG_A
    assert disp.dispatch(SHAPE.with_tokens(32), "uniform").reason == "baseline_measured"
    # adjacent routing class: the baseline record is as good a witness as a verified entry
    assert disp.dispatch(SHAPE.with_tokens(8), "skewed").reason == "baseline_measured"


def test_every_reason_the_dispatcher_gives_is_described() -> None:
    import re

    from mxdb import dispatcher
    from mxdb.decision import REASONS

    source = Path(dispatcher.__file__).read_text()
    given = set(re.findall(r'fallback\(\s*"([a-z_]+)"', source))
    given |= set(re.findall(r'reason = "([a-z_]+)"', source))
    given |= set(re.findall(r'empty_reason = "([a-z_]+)"', source))
    assert {"baseline_measured", "exact_match", "no_entry"} <= given
    assert given <= set(REASONS), given - set(REASONS)
