"""The learned performance model (``model.json``) as a kind of evidence: its declaration for the
claims engine.

Always checked:

- each sweep bundle the model names lies beside this bundle (same parent folder, a real folder
  and file, no links), its ``sweep.json`` hashes to the recorded SHA-256, is a performance
  sweep and names the model's environment (``perfmodel.sweep_missing``,
  ``perfmodel.sweep_mismatch``); nothing else is checked when one does not;
- the model is a well-formed forest: every tree's arrays of one length, children after their
  node, features among those of the document's feature set
  (:data:`~mxdb.costmodel.features.FEATURE_SETS`: set 1 for schema 1.0, set 2 for 1.1)
  (``perfmodel.model_invalid``);
- a 1.2 model calibrated on a check (``calibrated_on``): the check bundle lies beside it and
  hashes to the recorded SHA-256, is a ``mxdb.perf-check`` of the model's host and of one of
  its sweeps (``perfmodel.check_missing``, ``perfmodel.check_mismatch``); training again then
  takes the check's timed choices, and fails (``perfmodel.check_mismatch``) unless the check
  timed exactly the choices this training's leave-one-family-out models make;
- ``feature_names`` are that set's, ``shape_families`` those of the keys trained on (the sweeps'
  keys less the excluded families), the gate mxdb's: the default
  (:class:`~mxdb.costmodel.train.Gate`) for 1.0, the one :func:`~mxdb.costmodel.train.select_gate`
  chooses for 1.1.

With scikit-learn importable, the model is trained again on the same keys
(:func:`mxdb.costmodel.train.train` is deterministic: fixed seeds, one thread) and ``model``,
``calibration`` and ``training`` must equal the new ones exactly, field for field (a bundle
trained with other library versions than the audit's may differ: the finding names both).
Without it, what needs no training is recomputed from the sweeps: the rows, keys and families;
each leave-one-family-out outcome's key, family, measured speedup, verdict and best measured
speedup (from the recorded choice); the chosen class's score from those outcomes and the
recorded per-family calibrations (:func:`mxdb.costmodel.train.score`) and the choice of class
from the scores; the number of outcomes each calibration was fitted on (and the calibration
itself when its outcomes hold one verdict only; for a check's maps, the check's outcomes);
for 1.1 and 1.2 the gate and the chosen class's gate
steps from those outcomes.  The forest's trees, the other class's score and steps and the
calibrations' coefficients are then not checked.

Numbers of the retrained comparison agree to :data:`REL_TOL`: the calibration's solver runs on
the machine's BLAS, whose kernels differ in the last bits between processors.

A sweep's own figures are the sweep bundle's audit: audit both.  Retraining takes tens of
seconds; within one process it is done once per set of sweeps and excluded families.
"""

from __future__ import annotations

import copy
import importlib.util
import json
from collections.abc import Mapping, Sequence
from typing import Any

from mxdb.audit.claims import ClaimKind, Context, Path_, dotted
from mxdb.audit.compare import same
from mxdb.audit.findings import FindingSink
from mxdb.audit.siblings import sibling_bytes
from mxdb.costmodel.features import FEATURE_SETS
from mxdb.costmodel.train import CheckPoint
from mxdb.evidence.perfmodel import (
    CHECK_FILE,
    CHECK_SCHEMA,
    MODEL_FILE,
    REPORT_FILE,
    check_mismatch,
    check_points,
    feature_version,
    render,
    shape_families,
    split_training,
    trained_with,
    training_keys,
)
from mxdb.evidence.sweep import SCHEMA as SWEEP_SCHEMA
from mxdb.evidence.sweep import SWEEP_FILE

#: findings of one field of the retrained comparison before the rest are counted in one
MAX_DIFFS = 10
#: relative tolerance of a number in the retrained comparison (module docstring); an edit
#: that matters is many orders of magnitude larger
REL_TOL = 1e-9

#: a sweep.json's schema, fingerprint and keys by the SHA-256 of its bytes (content-addressed:
#: the preflight reads them after checking the hash, the figures then find them here)
_KEYS: dict[str, dict[str, Any]] = {}
#: a check's timed choices by the SHA-256 of its check.json
_CHECKS: dict[str, list[CheckPoint]] = {}
#: train()'s result by (the sweeps' SHA-256s, excluded families, feature set, the check's)
_TRAINED: dict[tuple[tuple[str, ...], tuple[str, ...], int, str], dict[str, Any]] = {}


def has_sklearn() -> bool:
    """Whether scikit-learn can be imported (the audit then trains again)."""
    return importlib.util.find_spec("sklearn") is not None


def _code(path: Path_) -> str:
    head = path[:1]
    if head == ("feature_names",):
        return "feature_mismatch"
    if head == ("shape_families",):
        return "family_mismatch"
    if head == ("gate",) or path[:2] == ("training", "gate"):
        return "gate_mismatch"
    if head == ("model",):
        return "model_mismatch"
    if head == ("calibration",) or path[:2] in (
        ("training", "lofo_calibrations"),
        ("training", "check_calibrations"),
    ):
        return "calibration_mismatch"
    if head == ("calibrated_on",):
        return "check_mismatch"
    if path[:2] == ("training", "classes") or path[:2] == ("training", "chosen"):
        return "score_mismatch"
    if path[:2] == ("training", "gate_steps"):
        return "gate_mismatch"
    if path[:2] == ("training", "outcomes"):
        return "outcome_mismatch"
    return "training_mismatch" if head == ("training",) else "field_mismatch"


def _sweeps_ok(sink: FindingSink, rel: str, doc: Mapping[str, Any]) -> bool:
    while len(_KEYS) >= 8:  # a bound on what stays parsed between audits: the oldest goes
        _KEYS.pop(next(iter(_KEYS)))
    ok = True
    names = [str(s["bundle"]) for s in doc["sweeps"]]
    for i, ref in enumerate(doc["sweeps"]):
        where = f"sweeps[{i}]"
        name = str(ref["bundle"])
        if names.index(name) != i:
            sink.add("perfmodel.sweep_mismatch", rel, f"{where}.bundle", "each sweep once",
                     name, "a sweep bundle is named twice")  # fmt: skip
            ok = False
            continue
        data = sibling_bytes(sink, rel, where, ref, SWEEP_FILE, code="perfmodel.sweep")
        if data is None:
            ok = False
            continue
        h = str(ref["sha256"])  # what its bytes hash to
        sweep = _parsed(h, data, f"{name}/{SWEEP_FILE}")
        if sweep.get("schema") != SWEEP_SCHEMA:
            sink.add("perfmodel.sweep_mismatch", rel, f"{where}.bundle", SWEEP_SCHEMA,
                     str(sweep.get("schema"))[:80],
                     f"{name}/{SWEEP_FILE} is not a performance sweep")  # fmt: skip
            ok = False
        elif sweep.get("fingerprint_hash") != doc["fingerprint_hash"]:
            sink.add("perfmodel.sweep_mismatch", rel, f"{where}.bundle",
                     doc["fingerprint_hash"], sweep.get("fingerprint_hash"),
                     f"{name} was measured in another environment than the model names")  # fmt: skip
            ok = False
    return ok


def _check_ok(sink: FindingSink, rel: str, doc: Mapping[str, Any]) -> bool:
    """The check a 1.2 model was calibrated on: beside it, unchanged, a check of the model's
    sweeps and host; its timed choices are parsed into :data:`_CHECKS`."""
    from mxdb.errors import MxdbError
    from mxdb.fileio import parse_json

    ref = doc.get("calibrated_on")
    if ref is None:
        return True
    data = sibling_bytes(sink, rel, "calibrated_on", ref, CHECK_FILE, code="perfmodel.check")
    if data is None:
        return False
    h = str(ref["sha256"])  # what its bytes hash to
    try:
        chk = parse_json(data, what=f"{ref['bundle']}/{CHECK_FILE}")
        if not isinstance(chk, dict) or chk.get("schema") != CHECK_SCHEMA:
            raise ValueError(f"schema {chk.get('schema') if isinstance(chk, dict) else chk!r}")
        why = check_mismatch(chk, doc["sweeps"], doc["fingerprint_hash"])
        if why is not None:
            raise ValueError(why)
        points = check_points(chk)
    except (MxdbError, KeyError, TypeError, ValueError) as exc:
        sink.add("perfmodel.check_mismatch", rel, "calibrated_on.bundle",
                 f"a {CHECK_SCHEMA} document of the model's sweeps and host", str(exc)[:160],
                 "the model cannot have been calibrated on it")  # fmt: skip
        return False
    while len(_CHECKS) >= 4:  # the oldest goes
        _CHECKS.pop(next(iter(_CHECKS)))
    _CHECKS[h] = points
    return True


def _check_of(doc: Mapping[str, Any]) -> list[CheckPoint] | None:
    ref = doc.get("calibrated_on")
    return None if ref is None else _CHECKS[str(ref["sha256"])]


def _parsed(h: str, data: bytes, what: str) -> Mapping[str, Any]:
    """A sweep's schema, fingerprint and keys, parsed once per content (``h``: its SHA-256)."""
    from mxdb.fileio import parse_json

    if h not in _KEYS:
        try:
            sweep = parse_json(data, what=what)
        except Exception as exc:  # not JSON: the sweep bundle's own audit says more
            sweep = {"schema": str(exc)}
        if not isinstance(sweep, dict):
            sweep = {"schema": type(sweep).__name__}
        _KEYS[h] = {
            "schema": sweep.get("schema"),
            "fingerprint_hash": sweep.get("fingerprint_hash"),
            "keys": list(sweep.get("keys") or []),
        }
    return _KEYS[h]


def _model_ok(sink: FindingSink, rel: str, model: Mapping[str, Any], version: int) -> bool:
    n_features = len(FEATURE_SETS[version])
    if model["n_features"] != n_features:
        sink.add("perfmodel.model_invalid", rel, "model.n_features", n_features,
                 model["n_features"], "the model takes one input per feature name")  # fmt: skip
        return False
    for t, tree in enumerate(model["trees"]):
        n = len(tree["left"])
        lens = {len(tree[k]) for k in ("left", "right", "feature", "threshold", "value")}
        bad = lens != {n} or n == 0
        for j in range(n if not bad else 0):
            lo, hi, feat = tree["left"][j], tree["right"][j], tree["feature"][j]
            leaf = lo == -1
            if (
                not (0 <= feat < n_features)
                or (not leaf and not (j < lo < n and j < hi < n))
                or (leaf and hi != -1)
            ):
                bad = True
                break
        if bad:
            sink.add("perfmodel.model_invalid", rel, f"model.trees[{t}]", "a well-formed tree",
                     f"{n} nodes", "arrays of different lengths, a child before its node "
                     "or out of the tree, or a feature out of range")  # fmt: skip
            return False
    return True


def _diffs(claimed: Any, fresh: Any, path: Path_, out: list[tuple[Path_, Any, Any]]) -> int:
    """The leaves where ``claimed`` differs from ``fresh`` (exactly: no tolerance), the first
    :data:`MAX_DIFFS` of them appended to ``out``; returns their number."""
    if type(claimed) is type(fresh) and claimed == fresh:  # JSON values: no NaN, bools apart
        return 0
    if isinstance(claimed, dict) and isinstance(fresh, dict):
        n = 0
        for k in sorted(set(claimed) | set(fresh)):
            if k not in claimed or k not in fresh:
                n += 1
                if len(out) < MAX_DIFFS:
                    out.append(((*path, k), fresh.get(k, "no field"), claimed.get(k, "no field")))
            else:
                n += _diffs(claimed[k], fresh[k], (*path, k), out)
        return n
    if isinstance(claimed, list) and isinstance(fresh, list) and len(claimed) == len(fresh):
        pairs = enumerate(zip(claimed, fresh, strict=True))
        return sum(_diffs(c, f, (*path, i), out) for i, (c, f) in pairs)
    if same(claimed, fresh, REL_TOL, 0.0):
        return 0
    if len(out) < MAX_DIFFS:
        out.append((path, _shown(fresh), _shown(claimed)))
    return 1


def _shown(v: Any) -> Any:
    """A value as a finding shows it (a long list by its length)."""
    return f"a list of {len(v)}" if isinstance(v, list) and len(v) > 8 else v


def _keys_of(doc: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    sweeps = [_KEYS[str(s["sha256"])] for s in doc["sweeps"]]
    return training_keys(sweeps, doc["excluded"])


def _trained(doc: Mapping[str, Any]) -> dict[str, Any]:
    from mxdb.costmodel.train import train

    version = feature_version(doc)
    tag = (
        tuple(str(s["sha256"]) for s in doc["sweeps"]),
        tuple(str(f) for f in doc["excluded"]),
        version,
        str((doc.get("calibrated_on") or {}).get("sha256", "")),
    )
    hit = _TRAINED.pop(tag, None)
    if hit is None:
        while len(_TRAINED) >= 4:  # the least recently used goes
            _TRAINED.pop(next(iter(_TRAINED)))
        # as written to JSON and read back (tuples as lists)
        result = train(_keys_of(doc), version=version, check=_check_of(doc))
        hit = json.loads(json.dumps(split_training(result)))
    _TRAINED[tag] = hit
    return hit


def _retrained_ok(sink: FindingSink, rel: str, doc: Mapping[str, Any]) -> None:
    from mxdb.errors import MxdbError

    try:
        fresh = _trained(doc)
    except MxdbError as exc:  # the check did not time this training's choices
        sink.add("perfmodel.check_mismatch", rel, "calibrated_on", "a check of this model's "
                 "leave-one-family-out choices", str(exc)[:240],
                 "training again with the check fails")  # fmt: skip
        return
    ours = trained_with()
    theirs = doc.get("trained_with") or {}
    note = "" if theirs == ours else (
        f" (trained with {', '.join(f'{k} {v}' for k, v in sorted(theirs.items()))}; this audit "
        f"has {', '.join(f'{k} {v}' for k, v in sorted(ours.items()))})"
    )  # fmt: skip
    for field in ("model", "calibration", "training"):
        out: list[tuple[Path_, Any, Any]] = []
        n = _diffs(doc[field], fresh[field], (field,), out)
        for path, want, got in out:
            sink.add(f"perfmodel.{_code(path)}", rel, dotted(path), want, got,
                     "differs from the model trained again on the same sweeps" + note)  # fmt: skip
        if n > len(out):
            sink.add(f"perfmodel.{_code((field,))}", rel, field,
                     f"the {field} trained again", f"{n - len(out)} more differences",
                     f"{n} leaves of {field} differ from training again" + note)  # fmt: skip


def _preflight(sink: FindingSink, rel: str, doc: Mapping[str, Any], _: Context) -> bool:
    if not _sweeps_ok(sink, rel, doc) or not _check_ok(sink, rel, doc):
        return False
    ok = _model_ok(sink, rel, doc["model"], feature_version(doc))
    if ok and has_sklearn():
        _retrained_ok(sink, rel, doc)
    return True


def _without_training(doc: Mapping[str, Any]) -> dict[str, Any]:
    """``calibration`` and ``training`` with every leaf that needs no scikit-learn recomputed
    from the sweeps (the others as claimed: module docstring)."""
    from mxdb.costmodel.train import (
        Gate,
        Outcome,
        calibration_points,
        key_data,
        score,
        select_gate,
    )

    t = copy.deepcopy(dict(doc["training"]))
    cal = copy.deepcopy(dict(doc["calibration"]))
    version = feature_version(doc)
    kd, rows = key_data(_keys_of(doc), version)
    fams = sorted({k.family for k in kd})
    t.update(rows=len(rows), keys=len(kd), families=fams)
    if version < 2:
        t["gate"] = dict(Gate().__dict__)
    order = [k for f in fams for k in kd if k.family == f]  # lofo's order: family, then key
    claimed = list(t["outcomes"])
    if len(claimed) != len(order):
        t["outcomes"] = [f"{len(order)} outcomes, one per key"]
        return {"calibration": cal, "training": t}
    outs: list[Outcome] = []
    for o, k in zip(claimed, order, strict=True):
        best = max([s for s, _ in k.outcomes.values()], default=1.0)
        h = o["config_hash"]
        if h is None:
            s, v = 1.0, "fallback"
        else:
            s, v = k.outcomes.get(h, (1.0, "untimed"))
        outs.append(Outcome(k.index, k.family, h, float(o["predicted"]),
                            float(o["agreement"]), s, v, best))  # fmt: skip
    t["outcomes"] = [o.__dict__ for o in outs]
    recorded = dict(t["lofo_calibrations"])
    if set(recorded) == set(fams):
        if version >= 2:
            gate, steps = select_gate(outs, recorded)
            t["gate"] = dict(gate.__dict__)
            t["gate_steps"] = {**(t.get("gate_steps") or {}), t["chosen"]: steps}
        t["classes"][t["chosen"]] = score(outs, recorded, Gate(**t["gate"]))
    t["chosen"] = max(t["classes"], key=lambda n: (t["classes"][n]["dispatch"],
                                                   -t["classes"][n]["slower"], n))  # fmt: skip
    t["lofo_calibrations"] = {
        f: _fit_free(calibration_points(o for o in outs if o.family != f),
                     recorded.get(f, {"a": None, "b": None}))
        for f in fams
    }  # fmt: skip
    check = _check_of(doc)
    if check is None:
        cal = _fit_free(calibration_points(outs), cal)
        return {"calibration": cal, "training": t}
    step = float(t["gate"]["min_speedup"])
    stated = dict(t.get("check_calibrations") or {})
    t["check_calibrations"] = {
        f: _fit_free([(p.predicted, p.faster) for p in check if p.family != f],
                     stated.get(f, {"a": None, "b": None}), step)
        for f in fams
    }  # fmt: skip
    cal = _fit_free([(p.predicted, p.faster) for p in check], cal, step)
    return {"calibration": cal, "training": t}


def _fit_free(
    points: Sequence[tuple[float, bool]], claimed: Mapping[str, Any], step: float | None = None
) -> dict[str, Any]:
    """A calibration's outcome count, and the whole calibration where fitting it needs no
    scikit-learn (no outcomes, or one verdict only); ``step``: a check's map (the gate's)."""
    from mxdb.costmodel import calibration

    if len({w for _, w in points}) < 2:
        return calibration.fit(points) if step is None else calibration.fit_gated(points, step)
    return {**claimed, "n": len(points)}


def _figures(doc: Mapping[str, Any], _: Context) -> Mapping[str, Any]:
    from mxdb.costmodel.train import Gate

    version = feature_version(doc)
    out: dict[str, Any] = {
        "feature_names": list(FEATURE_SETS[version]),
        "shape_families": shape_families(_keys_of(doc)),
    }
    if not has_sklearn():
        out.update(_without_training(doc))
        out["gate"] = dict(out["training"]["gate"])
    elif version >= 2:
        from mxdb.errors import MxdbError

        try:
            out["gate"] = dict(_trained(doc)["gate"])
        except MxdbError:  # training again failed: the preflight's finding says why
            out["gate"] = dict(doc["gate"])
    else:
        out["gate"] = dict(Gate().__dict__)
    return out


KIND = ClaimKind(
    name="perfmodel",
    document=MODEL_FILE,
    schema="mxdb.perf-model",
    codes=_code,
    figures=_figures,
    preflight=_preflight,
    report=(REPORT_FILE, render),
)
