"""Every declared figure of every committed kind of evidence is checked by the audit.

For each kind, one committed bundle is copied once; then each numeric leaf of its claims
document that is a derived figure (not a raw sample, setting or identity) is edited in turn,
the bundle re-manifested (so that only the semantic checks can catch the edit), and the audit
must name the document in a finding.  Kinds with many figures are sampled deterministically:
every distinct figure (its path with list indices dropped) once, evenly spread up to a bound.
A kind whose bundle is not committed yet, or takes seconds to audit, is given a synthetic one,
built in the test (``BUILT``).
"""

from __future__ import annotations

import fnmatch
import json
import re
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from mxdb.audit import AuditOptions, audit_paths
from mxdb.evidence.writer import write_manifest

EVIDENCE = Path(__file__).resolve().parents[1] / "evidence"
#: At most this many edits per kind (each one a full audit of the bundle).
MAX_EDITS = 24

#: kind -> (committed bundle, claims document, patterns of its derived figures; a pattern
#: matches a leaf's path with list indices written ``[*]``)
KINDS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "tune-summary": (
        "h200-milestone-uniform-20261130T022124Z-6ea9",
        "summary.json",
        (
            "counts.*",
            "geomean_speedup",
            "geomean_verified_speedup",
            "groups[*].baseline_median_us",
            "groups[*].best_median_us",
            "groups[*].noise_band",
            "groups[*].speedup",
        ),
    ),
    "store-export": (
        "h200-milestone-uniform-20261130T022124Z-6ea9",
        "store_export.json",
        (
            "entries[*].baseline_us",
            "entries[*].median_us",
            "entries[*].noise_band",
            "entries[*].speedup",
        ),
    ),
    "compile-survey": ("h200-compile-survey", "survey.json", ("claims.*",)),
    "tuning-cost": (
        "h200-tuning-cost",
        "tuning_cost.json",
        (
            "points[*].baseline_median_us",
            "points[*].dispatched_quality_ratio",
            "points[*].exhaustive_best_median_us",
            "points[*].exhaustive_configs_timed",
            "points[*].exhaustive_gpu_seconds",
            "points[*].gpu_time_fraction",
            "points[*].mxdb_gpu_seconds",
            "points[*].mxdb_median_us",
            "points[*].quality_ratio",
            "summary.*",
        ),
    ),
    "peers": (
        "h200-peers",
        "peers.json",
        (
            "figures.*",
            "explanations.*",
            "points[*].eager_median_us.*",
            "points[*].median_us.*",
            "points[*].eager_over_graph_layer",
            "points[*].eager_speedup_layer_over_fused_experts_impl",
            "points[*].floor_*",
            "points[*].noise_band",
            "points[*].skew_cost",
            "points[*].speedup_*",
            "points[*].uniform_floor_fraction_best",
            "targets[*].measured",
        ),
    ),
    "lean-layer": (
        "h200-lean-layer",
        "lean_layer.json",
        (
            "figures.*",
            "points[*].eager_*",
            "points[*].host_speedup_*",
            "points[*].synced_*",
            "points[*].median_us.*",
            "points[*].p90_us.*",
            "targets[*].measured",
        ),
    ),
    "self-healing": (
        "h200-self-healing",
        "self_healing.json",
        ("claims.*", "calibration[*].median_us"),
    ),
    "decode-ops": ("h200-decode-ops", "decode.json", ("cases[*].claims.*", "models[*].claims.*")),
    "serving": (
        "h200-serving",
        "serving.json",
        (
            "hooked.figures.*",
            "healing.figures.*",
            "hooked.points[*].control_pair_band",
            "hooked.points[*].mean_us.*",
            "hooked.points[*].median_ratio",
            "hooked.points[*].median_us.*",
            "hooked.points[*].noise_band",
            "hooked.points[*].rounds_hooked_slower",
            "hooked.points[*].speedup*",
            "hooked.points[*].stock_median_us_*",
            "targets[*].measured",
        ),
    ),
    "stages": (
        "h200-stages",
        "stages.json",
        (
            "bandwidth.copy_bytes_per_s",
            "bandwidth.matmul_flops_per_s",
            "bandwidth.read_bytes_per_s",
            "figures.*",
            "points[*].active_experts",
            "points[*].bound_fraction",
            "points[*].compute_floor_us",
            "points[*].floor_*",
            "points[*].gemm_*",
            "points[*].median_us.*",
            "points[*].share.*",
            "points[*].stages_over_layer",
        ),
    ),
    "perf-check": (
        "h200-perf-check",
        "check.json",
        (
            "figures.answered*",
            "figures.by_family.*.answered_slower",
            "figures.by_family.*.geomean_dispatch_speedup",
            "figures.calibration_error",
            "figures.candidates_timed",
            "figures.confidence_bins[*].count",
            "figures.confidence_bins[*].mean_confidence",
            "figures.confidence_bins[*].win_rate",
            "figures.geomean_*",
            "figures.mean_confidence",
            "figures.points",
            "figures.win_rate",
            "points[*].arms[*].median_us",
            "points[*].candidate_speedup",
            "points[*].confidence",
            "points[*].dispatch_speedup",
            "points[*].noise_band",
            "points[*].plan_entry.agreement",
            "points[*].plan_entry.confidence",
            "points[*].plan_entry.predicted",
            "targets[*].measured",
        ),
    ),
    "perf-sweep": (
        "h200-perf-sweep",
        "sweep.json",
        (
            "figures.*",
            "keys[*].arms[*].median_us",
            "keys[*].arms[*].speedup",
            "keys[*].baseline_median_us",
            "keys[*].best.speedup",
            "keys[*].noise_band",
        ),
    ),
    "perf-model": (
        "h200-perf-model",
        "model.json",
        (
            "calibration.*",
            "gate.*",
            "model.trees[*].threshold[*]",
            "model.trees[*].value[*]",
            "training.classes.*",
            "training.keys",
            "training.lofo_calibrations.*",
            "training.outcomes[*].agreement",
            "training.outcomes[*].best",
            "training.outcomes[*].measured",
            "training.outcomes[*].predicted",
            "training.rows",
        ),
    ),
}


def _perfcheck_bundle(parent: Path) -> Path:
    from test_perfcheck_evidence import synthetic_check_bundle

    return synthetic_check_bundle(parent)


#: kinds whose bundle is not committed yet: a builder writes a synthetic one (with the sibling
#: bundles it names) into the test's folder and returns its path (its folder is the kind's
#: bundle name in KINDS)
BUILT: dict[str, Callable[[Path], Path]] = {"perf-check": _perfcheck_bundle}


def _perfsweep_bundle(parent: Path) -> Path:
    from test_sweep_evidence import synthetic_sweep_bundle

    return synthetic_sweep_bundle(parent, "h200-perf-sweep")


def _perfmodel_bundle(parent: Path) -> Path:
    from test_sweep_evidence import synthetic_sweep_bundle

    from mxdb.evidence.perfmodel import write_model_bundle

    sweep = synthetic_sweep_bundle(parent, "h200-perf-sweep")
    return write_model_bundle([sweep], parent / "h200-perf-model")


#: kinds whose committed bundle takes seconds to audit (a 6 MB document), once per edit: a
#: small synthetic one of the same kind stands in (test_sweep_evidence and
#: test_perfmodel_evidence audit the committed ones)
BUILT.update({"perf-sweep": _perfsweep_bundle, "perf-model": _perfmodel_bundle})

Path_ = tuple[str | int, ...]


def _leaves(x: Any, path: Path_ = ()) -> Iterator[tuple[Path_, int | float]]:
    if isinstance(x, dict):
        for k, v in x.items():
            yield from _leaves(v, (*path, k))
    elif isinstance(x, list):
        for i, v in enumerate(x):
            yield from _leaves(v, (*path, i))
    elif isinstance(x, (int, float)) and not isinstance(x, bool):
        yield path, x


def _pattern_of(path: Path_) -> str:
    out = ""
    for p in path:
        out += "[*]" if isinstance(p, int) else (f".{p}" if out else p)
    return out


def _dotted(path: Path_) -> str:
    return re.sub(r"\.\[", "[", ".".join(f"[{p}]" if isinstance(p, int) else p for p in path))


def figures(doc: Any, patterns: tuple[str, ...]) -> list[Path_]:
    """The paths to edit: each distinct figure's first leaf, then every other leaf, bounded."""
    globs = [g.replace("[*]", "[[]*[]]") for g in patterns]  # "[*]" is literal here
    hits = [
        p for p, _ in _leaves(doc) if any(fnmatch.fnmatchcase(_pattern_of(p), g) for g in globs)
    ]
    first: dict[str, Path_] = {}
    for p in hits:
        first.setdefault(_pattern_of(p), p)
    chosen = list(first.values())
    rest = [p for p in hits if p not in chosen]
    if len(chosen) > MAX_EDITS:
        step = len(chosen) / MAX_EDITS
        return [chosen[int(i * step)] for i in range(MAX_EDITS)]
    room = MAX_EDITS - len(chosen)
    if rest and room:
        step = max(1, len(rest) // room)
        chosen += rest[::step][:room]
    return chosen


def _perturbed(x: int | float) -> int | float:
    if isinstance(x, int):
        return x + 1
    return x + max(abs(x) * 0.01, 0.01)


def _set(doc: Any, path: Path_, value: Any) -> None:
    for p in path[:-1]:
        doc = doc[p]
    doc[path[-1]] = value


def _get(doc: Any, path: Path_) -> Any:
    for p in path:
        doc = doc[p]
    return doc


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_every_declared_figure_is_checked(kind: str, tmp_path: Path) -> None:
    bundle, name, patterns = KINDS[kind]
    if kind in BUILT:
        root = BUILT[kind](tmp_path)
        assert root.name == bundle
    else:
        root = tmp_path / bundle
        shutil.copytree(EVIDENCE / bundle, root)
    assert not audit_paths([root], AuditOptions()).findings, "the committed bundle audits clean"
    original = (root / name).read_bytes()
    manifest = (root / "manifest.json").read_bytes()
    meta = json.loads(manifest)
    paths = figures(json.loads(original), patterns)
    assert paths, f"no declared figures found in {name}"
    missed = []
    for path in paths:
        doc = json.loads(original)
        _set(doc, path, _perturbed(_get(doc, path)))
        (root / name).write_text(json.dumps(doc, indent=1))
        write_manifest(root, bundle_id=meta["bundle_id"], milestone=meta["milestone"])
        found = audit_paths([root], AuditOptions()).findings
        if not any(f.file.endswith(name) for f in found):
            missed.append(_dotted(path))
        (root / name).write_bytes(original)
        (root / "manifest.json").write_bytes(manifest)
    assert not missed, f"{kind}: edits the audit did not report in {name}: {missed}"


@pytest.mark.parametrize(
    "kind", ["compile-survey", "decode-ops", "self-healing", "tuning-cost", "store-export"]
)
def test_audit_tolerance_options_apply(kind: str, tmp_path: Path) -> None:
    """A figure off by one part in a million is a finding at the default tolerance and none
    at ``rel_tol=1e-3``: every kind compares with the audit options' tolerances."""
    bundle, name, patterns = KINDS[kind]
    root = tmp_path / bundle
    shutil.copytree(EVIDENCE / bundle, root)
    doc = json.loads((root / name).read_text())
    path = next(p for p in figures(doc, patterns) if isinstance(_get(doc, p), float))
    _set(doc, path, _get(doc, path) * (1 + 1e-6))
    (root / name).write_text(json.dumps(doc, indent=1))
    meta = json.loads((root / "manifest.json").read_text())
    write_manifest(root, bundle_id=meta["bundle_id"], milestone=meta["milestone"])
    strict = audit_paths([root], AuditOptions()).findings
    assert any(f.file.endswith(name) and _dotted(path) in f.field for f in strict), strict
    assert not audit_paths([root], AuditOptions(rel_tol=1e-3)).findings
