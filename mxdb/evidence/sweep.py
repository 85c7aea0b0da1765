"""The performance sweep (``sweep.json``, ``mxdb.perf-sweep`` 1.0): the training data of the
learned performance model (:mod:`mxdb.costmodel`).

A *key* is one model family (an ``mxdb.shapes`` preset, bf16), token count M and routing
source (``benchmarks/perf_sweep.py``).  At each key the configs of the model's menu and a few
of vLLM's grid (the *candidates*) were timed by CUDA-graph replay beside FlagGems' own choice
timed three times (the *baseline* and two *controls*), in :data:`ROUNDS` rounds, every arm once
per round in an order drawn at random for that round.  Configs the resource proxy rejects
(``oor``), that fail to compile (``compile_error``), compute a wrong result (``wrong``) or time
out stay in the record with their status and no samples.

The document keeps every key as recorded: its shape, the routing generator (``mxdb.routing_gen``
kind, seed, parameters), the trace hash and tokens per expert (``counts``) of the ids it
generated, their routing class, FlagGems' choice (as timed, and as mxdb restates it on the CPU)
and every arm with its raw samples (us per call, one per round).  Derived, by the functions of
this module (the writer calls them, ``mxdb audit`` recomputes every one):

- per arm (:func:`arm_figures`): its config hash and median; per candidate with samples, the
  verdict of ``mxdb.verdict.compare`` against FlagGems' copies (the baseline and the controls)
  at margin :data:`MARGIN`: the paired speedup and the outcome (faster, slower, same);
- per key (:func:`key_figures`): the baseline's median, the noise band of FlagGems' copies
  (``mxdb.verdict.noise_band``) and the best candidate (the largest verdict speedup): its
  config hash, implementation, speedup and outcome;
- over keys (:func:`build_figures`): keys, families, arms by status, the geomean of the best
  candidate's speedup and the number of keys where it is faster by the verdict, overall, per
  family and per implementation of the best config.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from pydantic import Field

from mxdb import verdict
from mxdb.configs import IMPLS, KernelConfig
from mxdb.evidence import stats
from mxdb.evidence.cells import cell
from mxdb.evidence.models import KNOWN_VERSIONS, ShapeDoc, _Doc

SWEEP_FILE = "sweep.json"
REPORT_FILE = "report/sweep.md"
SCHEMA = "mxdb.perf-sweep"
SCHEMA_VERSION = "1.0"
#: rounds per key (every arm timed once per round)
ROUNDS = 7
#: times FlagGems' choice is timed per key: the baseline and its controls
COPIES = 3
#: the margin of "faster" and "slower" (the tuner's default verify margin)
MARGIN = 0.005
#: how the arms were timed: CUDA-graph replay
METHOD = "graph"
STATUSES: tuple[str, ...] = ("ok", "oor", "compile_error", "wrong", "timeout")
#: the roles of FlagGems' copies at a key
COPY_ROLES: tuple[str, ...] = ("baseline", "control")

# the versions of this document the audit understands
KNOWN_VERSIONS.setdefault(SCHEMA, (SCHEMA_VERSION,))

_HEX16 = r"^[0-9a-f]{16}$"


class SweepRouting(_Doc):
    """How a key's top-k ids were generated (``mxdb.routing_gen.generate``)."""

    kind: Literal["uniform", "zipf", "hot", "sparse", "logits"]
    params: dict[str, float | int]
    seed: int = Field(ge=0)


class SweepArm(_Doc):
    """One config timed (or not) at a key: as recorded, with its derived figures."""

    config: dict[str, Any]
    role: Literal["baseline", "control", "candidate"]
    status: Literal["ok", "oor", "compile_error", "wrong", "timeout"]
    samples: list[float] = Field(description="us per call, one per round (none unless ok)")
    error: str | None
    config_hash: str = Field(pattern=_HEX16)
    median_us: float | None = Field(description="median of the samples; None without samples")
    speedup: float | None = Field(
        description="a candidate's paired speedup over FlagGems' copies (mxdb.verdict)"
    )
    outcome: Literal["faster", "slower", "same"] | None = Field(
        description="a candidate's verdict against FlagGems' copies"
    )


class SweepBest(_Doc):
    """The candidate with the largest verdict speedup at a key."""

    config_hash: str = Field(pattern=_HEX16)
    impl: str
    speedup: float
    outcome: Literal["faster", "slower", "same"]


class SweepKey(_Doc):
    """One key: its inputs, every arm's raw samples, and its derived figures."""

    family: str
    shape: ShapeDoc
    tokens: int = Field(ge=1)
    source: str
    routing: SweepRouting
    trace_hash: str = Field(pattern=_HEX16)
    counts: list[int] = Field(description="tokens routed to each expert, one count per expert")
    routing_class: Literal["uniform", "skewed", "hot", "sparse"]
    baseline: dict[str, Any] = Field(description="FlagGems' choice as timed")
    baseline_restated: dict[str, Any] = Field(
        description="FlagGems' choice as mxdb restates it on the CPU"
    )
    rounds: int = Field(ge=1)
    calls_per_sample: int = Field(ge=1)
    arms: list[SweepArm] = Field(min_length=1)
    baseline_median_us: float
    noise_band: float | None
    best: SweepBest | None


class SweepGroup(_Doc):
    """Figures over a group of keys."""

    keys: int
    geomean_best_speedup: float | None
    best_faster: int


class SweepFigures(_Doc):
    """Figures over every key."""

    keys: int
    families: int
    arms: dict[str, int] = Field(description="arms by status")
    keys_with_candidate: int
    geomean_best_speedup: float | None
    best_faster: int
    by_family: dict[str, SweepGroup]
    by_impl: dict[str, SweepGroup] = Field(description="keys by the best config's implementation")


class SweepDoc(_Doc):
    """``sweep.json``: the performance sweep of one host."""

    schema_name: Literal["mxdb.perf-sweep"] = Field(default="mxdb.perf-sweep", alias="schema")
    schema_version: Literal["1.0"] = "1.0"
    milestone: str
    fingerprint_hash: str
    rounds: int
    copies: int
    margin: float
    method: Literal["graph"]
    keys: list[SweepKey]
    figures: SweepFigures
    errors: list[str]


@functools.lru_cache(maxsize=4096)
def _config_hash(canonical: str) -> str:
    return KernelConfig.model_validate(json.loads(canonical)).hash


def config_hash_of(config: Mapping[str, Any]) -> str:
    """A recorded config's hash (``KernelConfig.hash``; raises on an invalid config)."""
    return _config_hash(json.dumps(config, sort_keys=True))


def impl_of(config: Mapping[str, Any]) -> str:
    """A recorded config's layer implementation."""
    return _config_impl(json.dumps(config, sort_keys=True))


@functools.lru_cache(maxsize=4096)
def _config_impl(canonical: str) -> str:
    return KernelConfig.model_validate(json.loads(canonical)).impl


def copies_of(key: Mapping[str, Any]) -> list[list[float]]:
    """The samples of FlagGems' copies at a key (its baseline and controls), in arm order."""
    return [list(a["samples"]) for a in key["arms"] if a["role"] in COPY_ROLES]


def arm_figures(
    arm: Mapping[str, Any], copies: Sequence[Sequence[float]], band: float | None
) -> dict[str, Any]:
    """An arm's derived fields: config hash and median; for a candidate with samples, the
    verdict against ``copies`` (whose noise band is ``band``) at :data:`MARGIN`."""
    samples = arm["samples"]
    out: dict[str, Any] = {
        "config_hash": config_hash_of(arm["config"]),
        "median_us": stats.median(samples) if samples else None,
        "speedup": None,
        "outcome": None,
    }
    if arm["role"] == "candidate" and samples:
        v = verdict.compare(copies, samples, margin=MARGIN, band=band)
        out["speedup"] = v.speedup
        out["outcome"] = v.outcome if v.speedup is not None else None
    return out


def key_figures(key: Mapping[str, Any]) -> dict[str, Any]:
    """A key's derived fields: its arms with theirs, the baseline's median, the noise band of
    FlagGems' copies and the best candidate (None when no candidate has a speedup)."""
    copies = copies_of(key)
    band = verdict.noise_band(copies)
    arms = [{**a, **arm_figures(a, copies, band)} for a in key["arms"]]
    base = next(a for a in key["arms"] if a["role"] == "baseline")
    best: dict[str, Any] | None = None
    for a in arms:
        if a["role"] != "candidate" or a["speedup"] is None:
            continue
        if best is None or a["speedup"] > best["speedup"]:
            best = {
                "config_hash": a["config_hash"],
                "impl": impl_of(a["config"]),
                "speedup": a["speedup"],
                "outcome": a["outcome"],
            }
    return {
        "arms": arms,
        "baseline_median_us": stats.median(base["samples"]),
        "noise_band": band,
        "best": best,
    }


def _group(keys: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    bests = [k["best"] for k in keys if k["best"] is not None]
    return {
        "keys": len(keys),
        "geomean_best_speedup": stats.geomean(b["speedup"] for b in bests),
        "best_faster": sum(1 for b in bests if b["outcome"] == "faster"),
    }


def build_figures(keys: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Figures over keys that carry their derived fields (module docstring)."""
    families = sorted({str(k["family"]) for k in keys})
    with_best = [k for k in keys if k["best"] is not None]
    return {
        "keys": len(keys),
        "families": len(families),
        "arms": {s: sum(1 for k in keys for a in k["arms"] if a["status"] == s) for s in STATUSES},
        "keys_with_candidate": len(with_best),
        "geomean_best_speedup": stats.geomean(k["best"]["speedup"] for k in with_best),
        "best_faster": sum(1 for k in with_best if k["best"]["outcome"] == "faster"),
        "by_family": {f: _group([k for k in keys if k["family"] == f]) for f in families},
        "by_impl": {i: _group([k for k in with_best if k["best"]["impl"] == i]) for i in IMPLS},
    }


def build_sweep(
    keys: Sequence[Mapping[str, Any]],
    *,
    milestone: str,
    fingerprint_hash: str,
    errors: Sequence[str] = (),
) -> dict[str, Any]:
    """The whole document from the keys as recorded (every figure derived)."""
    full = [{**k, **key_figures(k)} for k in keys]
    return {
        "schema": SCHEMA,
        "schema_version": SCHEMA_VERSION,
        "milestone": milestone,
        "fingerprint_hash": fingerprint_hash,
        "rounds": ROUNDS,
        "copies": COPIES,
        "margin": MARGIN,
        "method": METHOD,
        "keys": full,
        "figures": build_figures(full),
        "errors": list(errors),
    }


def _ordered(d: Mapping[str, Any], first: Sequence[str]) -> list[str]:
    """``d``'s keys: those of ``first`` in its order, then the others sorted (a document read
    back from disk has its keys sorted)."""
    return [k for k in first if k in d] + sorted(k for k in d if k not in first)


def render(doc: Mapping[str, Any]) -> str:
    """``report/sweep.md``: a view of ``sweep.json`` (the audit checks the JSON)."""
    f = doc["figures"]
    arms = ", ".join(f"{s} {f['arms'][s]}" for s in _ordered(f["arms"], STATUSES))
    lines = [
        "# Performance sweep: the model's menu timed against FlagGems' choice",
        "",
        f"{f['keys']} keys ({f['families']} families x token counts x routing sources). At each "
        f"key every config was timed by CUDA-graph replay beside {doc['copies']} copies of "
        f"FlagGems' own choice, {doc['rounds']} rounds in a random order per round, and judged "
        f"by the verdict rule (paired speedup over the copies, sign-test interval, noise band of "
        f"the copies, margin {doc['margin']:g}).",
        "",
        f"Arms: {arms}.",
        "",
        f"Best candidate per key: geomean speedup {cell(f['geomean_best_speedup'])}x over "
        f"FlagGems' choice; faster by the verdict at {f['best_faster']} of "
        f"{f['keys_with_candidate']} keys.",
        "",
        "| family | keys | best: geomean speedup | best faster |",
        "|---|---|---|---|",
    ]
    for fam in sorted(f["by_family"]):
        g = f["by_family"][fam]
        lines.append(
            f"| {fam} | {g['keys']} | {cell(g['geomean_best_speedup'])} | {g['best_faster']} |"
        )
    lines += [
        "",
        "| best config's implementation | keys | geomean speedup | faster |",
        "|---|---|---|---|",
    ]
    for impl in _ordered(f["by_impl"], IMPLS):
        g = f["by_impl"][impl]
        lines.append(
            f"| {impl} | {g['keys']} | {cell(g['geomean_best_speedup'])} | {g['best_faster']} |"
        )
    lines += [
        "",
        "| family | M | source | class | FlagGems us | noise band | timed | best config | "
        "best speedup | verdict |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for k in doc["keys"]:
        b = k["best"]
        timed = sum(1 for a in k["arms"] if a["role"] == "candidate" and a["status"] == "ok")
        best = "-" if b is None else f"{b['impl']} {b['config_hash']}"
        row = [
            k["family"], str(k["tokens"]), k["source"], k["routing_class"],
            cell(k["baseline_median_us"], ".1f"), cell(k["noise_band"], ".4f"), str(timed), best,
            cell(None if b is None else b["speedup"]), "-" if b is None else str(b["outcome"]),
        ]  # fmt: skip
        lines.append("| " + " | ".join(row) + " |")
    if doc["errors"]:
        lines += ["", "Errors:", *(f"- {e}" for e in doc["errors"])]
    return "\n".join(lines) + "\n"
