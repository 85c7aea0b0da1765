"""The store export of a bundle, rebuilt from its runs: no entry without runs behind it.

A tuning bundle's ``store_export.json`` is what ``mxdb import mxdb`` loads and the dispatcher
answers from, so the audit does not take it on trust.  Every decision is made again from the
runs: for run schema 1.1 on, each point's with the tuner's own rule
(:func:`mxdb.pointverdict.decide`) from the raw samples; for run schema 1.0, each comparison
group's of the earlier rule (a verified group's best run, a baseline nothing beat).  Each
decision gives the entry it backs (:func:`expected_entry`), and each exported entry is bound to
the one of the run it names as evidence and its config: its whole key (op, dtype, family,
dims, tokens, routing class, config, fingerprint, device), its figures, every field of every
held-out validation record, and its status must be those recomputed; each field that differs
is a finding naming it.  An entry whose evidence run is in another audited bundle (one tune
writes a bundle per routing source) is bound there (:func:`resolve_deferred`); an entry with
nothing behind it, two entries on one decision, and a decision missing from the export are
findings.  A shipped export (``evidence/store-export.json``) is bound the same way to the
bundle entries and decode-op decisions of the audit (:func:`check_shipped_export`).
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from mxdb import pointverdict
from mxdb.audit.compare import TOL, Tol, same
from mxdb.audit.findings import BundleResult, Finding, FindingSink
from mxdb.configs import KernelConfig, config_hash
from mxdb.errors import ConfigError
from mxdb.evidence.summary import family_of, run_passes
from mxdb.models import DECIDED_STATUSES, SINGLE_SOURCE
from mxdb.shapes import MoEShape


class ExportSink(FindingSink, Protocol):
    """A bundle audit that also keeps what its store export rests on (cross-bundle checks)."""

    backed: list[dict[str, Any]]
    deferred: list[tuple[str, str, dict[str, Any]]]
    backing: list[dict[str, Any]]
    fp_components: dict[str, Any] | None


F = "store_export.json"
#: Entry figures compared with their recomputation.
FIGURES = ("speedup", "noise_band", "median_us", "baseline_us", "confidence")
#: Statuses an exported tune entry may carry; ``rejected`` is a verified entry that a later
#: trace of its key contradicted (never dispatched, so it needs no more than its decision);
#: ``imported`` only for the tuner's single-config record (source ``tune-single``).
STATUSES = (*DECIDED_STATUSES, "rejected", "imported")


#: Fields of an entry's key, each recomputed from the runs behind it (exact equality).
KEY_FIELDS = (
    "op", "dtype", "family", "dims", "tokens", "routing_class", "config_hash",
    "fingerprint_hash", "device_name", "evidence",
)  # fmt: skip


def expected_entry(
    base: Mapping[str, Any],
    sink: ExportSink,
    *,
    status: str,
    config_hash: str | None,
    evidence: str | None,
    figures: Mapping[str, Any],
    validation: list[dict[str, Any]] | None,
) -> dict[str, Any]:
    """The entry a decision backs, its key taken from the run ``base`` of its point and the
    bundle's fingerprint: what an exported entry naming ``evidence`` must equal."""
    s = base["shape"]
    return {
        "op": base["op"],
        "dtype": s["dtype"],
        "family": family_of(s),
        "dims": {k: s[k] for k in MoEShape.FIELDS},
        "tokens": s["tokens"],
        "routing_class": base["routing_class"],
        "config_hash": config_hash,
        "fingerprint_hash": sink.fp_hash,
        "device_name": (sink.fp_components or {}).get("device_name"),
        "evidence": evidence,
        "status": status,
        **figures,
        "validation": validation,
    }


def _decided_entry(
    base: Mapping[str, Any], sink: ExportSink, d: pointverdict.PointDecision, status: str
) -> dict[str, Any]:
    return expected_entry(
        base, sink, status=status, config_hash=d.config_hash, evidence=d.evidence,
        figures={name: getattr(d, name) for name in FIGURES}, validation=list(d.validation),
    )  # fmt: skip


def mismatches(
    e: Mapping[str, Any], want: Mapping[str, Any], tol: Tol, allowed: Sequence[str]
) -> list[tuple[str, Any, Any]]:
    """``(field, recomputed, exported)`` for every field of ``e`` that its recomputation
    ``want`` does not support: its key, its figures, its held-out validation (every field of
    every record, token counts and routing classes too) and its status (one of ``allowed``)."""
    out: list[tuple[str, Any, Any]] = [
        (name, want[name], e.get(name)) for name in KEY_FIELDS if e.get(name) != want[name]
    ]
    for name in FIGURES:
        if name in want and not same(e.get(name), want[name], *tol):
            out.append((name, want[name], e.get(name)))
    out += _validation_mismatches(e.get("validation"), want.get("validation"), tol)
    if e.get("status") not in allowed:
        out.append(("status", want["status"], e.get("status")))
    return out


def _validation_mismatches(got: Any, want: Any, tol: Tol) -> list[tuple[str, Any, Any]]:
    # no validation is written as null or as an empty list
    got, want = got or None, want or None
    if same(got, want, *tol):
        return []
    if not (isinstance(got, list) and isinstance(want, list) and len(got) == len(want)):
        return [("validation", want, got)]
    out: list[tuple[str, Any, Any]] = []
    for j, (g, w) in enumerate(zip(got, want, strict=True)):
        if not isinstance(g, dict):
            out.append((f"validation[{j}]", w, g))
            continue
        for k in sorted(set(g) | set(w)):
            if k not in g or k not in w or not same(g[k], w[k], *tol):
                out.append((f"validation[{j}].{k}", w.get(k), g.get(k)))
    return out


def _key(e: Mapping[str, Any]) -> tuple[Any, ...]:
    return (e.get("op"), e.get("dtype"), e.get("family"), e.get("tokens"), e.get("routing_class"))


def check_store_export(
    sink: ExportSink,
    export: Mapping[str, Any],
    summary: Mapping[str, Any],
    runs: Mapping[str, Mapping[str, Any]],
    tol: Tol,
) -> None:
    """Every finding of the export against the runs (see the module docstring)."""
    entries = list(export.get("entries", []))
    for i, e in enumerate(entries):
        h = config_hash(e["config"])
        if h != e["config_hash"]:
            sink.add(
                "store_export.hash_mismatch",
                F,
                f"entries[{i}].config_hash",
                h,
                e["config_hash"],
                "entry's config_hash is not the hash of its config",
            )
        if sink.fp_hash is not None and e.get("fingerprint_hash") not in (None, sink.fp_hash):
            sink.add(
                "store_export.hash_mismatch",
                F,
                f"entries[{i}].fingerprint_hash",
                sink.fp_hash,
                e.get("fingerprint_hash"),
                "exported entry carries another environment fingerprint",
            )
        if e.get("status") not in STATUSES or (
            e.get("status") == "imported" and e.get("source") != SINGLE_SOURCE
        ):
            sink.add(
                "store_export.status_invalid",
                F,
                f"entries[{i}].status",
                " or ".join(STATUSES),
                e.get("status"),
                "a tuning bundle exports only verified, baseline, parity or rejected entries, "
                f"and imported ones of source {SINGLE_SOURCE}",
            )
    if any(r.get("point") for r in runs.values()):
        _check_decisions(sink, entries, runs, tol)
    else:
        _check_legacy(sink, entries, summary, runs, tol)


def decision_rule(runs: Iterable[Mapping[str, Any]]) -> int:
    """The point decision rule a point's runs were written under
    (``pointverdict.RUN_SCHEMA_OF_RULE``: run schema 1.2 rule 2, 1.3 rule 3, earlier rule 1).
    Mixed versions take the lower rule."""
    rules = [pointverdict.rule_of_run_schema(str(r.get("schema_version"))) for r in runs]
    return min(rules) if rules else 1


def decisions(
    runs: Mapping[str, Mapping[str, Any]],
) -> list[tuple[Mapping[str, Any], pointverdict.PointDecision]]:
    """Every point's decision, recomputed from its runs, with the point's replay baseline run."""
    return [(base, d) for base, d, _ in _decided(runs)]


def _decided(
    runs: Mapping[str, Mapping[str, Any]],
) -> list[tuple[Mapping[str, Any], pointverdict.PointDecision, pointverdict.PointDecision | None]]:
    """Each point's replay baseline run, decision and single-config record (or None)."""
    by_point: dict[str, list[Mapping[str, Any]]] = defaultdict(list)
    for r in runs.values():
        if r.get("point"):
            by_point[str(r["point"])].append(r)
    out = []
    for point in sorted(by_point):
        members = by_point[point]
        arms = [pointverdict.arm_from_run(r, run_passes(r)) for r in members]
        # a key reconciliation (comparisons key-N) is decided over all its traces at once
        key_point = pointverdict.is_key_point(arms)
        d = (
            pointverdict.decide_key(arms)
            if key_point
            else pointverdict.decide(arms, rule=decision_rule(members))
        )
        first = f"{pointverdict.KEY_PREFIX}1" if key_point else "replay"
        base = next(
            (
                r
                for r in members
                if r["role"] == "baseline" and (r.get("comparison") or "replay") == first
            ),
            None,
        )
        if base is not None and d.status != "none":
            out.append((base, d, _single(members, arms, d)))
    return out


def _single(
    members: Sequence[Mapping[str, Any]],
    arms: Sequence[pointverdict.Arm],
    d: pointverdict.PointDecision,
) -> pointverdict.PointDecision | None:
    """The point's single-config record as the tuner makes it (``pointverdict.single_decision``)
    beside a verified winner that is not one FlagGems config; None otherwise."""
    by_id = {str(r["run_id"]): r for r in members}

    def single(run: Mapping[str, Any]) -> bool:
        try:
            return KernelConfig.parse(run["config"]).single
        except (ConfigError, KeyError):  # a config that does not parse is no table row
            return False

    winner = next((r for r in members if r.get("config_hash") == d.config_hash), None)
    if d.status != "verified" or winner is None or single(winner):
        return None
    return pointverdict.single_decision(arms, lambda a: single(by_id[a.run_id]), d.baseline_us)


#: The exported statuses a decision allows: an entry may since have been rejected (contradicted
#: by another trace of its key, or superseded by a later tune of its own trace).
ALLOWED = {
    "verified": ("verified", "rejected"),
    "baseline": ("baseline", "rejected"),
    "parity": ("parity", "rejected"),
    "imported": ("imported",),
}


def _check_decisions(
    sink: ExportSink,
    entries: list[Mapping[str, Any]],
    runs: Mapping[str, Mapping[str, Any]],
    tol: Tol,
) -> None:
    made = []
    for base, d, single in _decided(runs):
        s = base["shape"]
        key = (base["op"], s["dtype"], family_of(s), s["tokens"], base["routing_class"])
        made.append((key, base.get("point"), d))
        sink.backing.append(_decided_entry(base, sink, d, d.status))
        if single is not None:
            sink.backing.append(_decided_entry(base, sink, single, "imported"))

    def backs(key: tuple[Any, ...], d: pointverdict.PointDecision, e: Mapping[str, Any]) -> bool:
        return (
            _key(e) == key
            and e.get("config_hash") == d.config_hash
            and e.get("status") in ALLOWED.get(d.status, ())
        )

    _bind_entries(sink, entries, tol)
    for key, point, d in made:
        # one entry per key and config: another point of the key may carry it
        if any(backs(key, d, e) for e in entries):
            continue
        sink.add(
            "store_export.missing_config",
            F,
            "entries",
            f"a {d.status} entry for {'/'.join(map(str, key))} with config_hash {d.config_hash}",
            "none",
            f"a decision of point {point} is absent from the store export",
        )


def _backing_index(
    backing: Iterable[Mapping[str, Any]],
) -> dict[tuple[str, str], Mapping[str, Any]]:
    """Recomputed entries by (evidence run, config hash): the run an entry names binds it."""
    return {(str(b["evidence"]), str(b["config_hash"])): b for b in backing}


def _allowed(want: Mapping[str, Any], legacy: bool) -> tuple[str, ...]:
    if legacy:  # run schema 1.0 records no later trace that could have rejected an entry
        return (str(want["status"]),)
    return ALLOWED.get(str(want["status"]), ())


def _bind_entries(sink: ExportSink, entries: list[Mapping[str, Any]], tol: Tol) -> None:
    """Each entry against the decision of the run it names: every field that differs is a
    finding naming it; an entry naming a run of another bundle waits for the cross-bundle
    check (:func:`resolve_deferred`); two entries naming one decision are a finding."""
    index = _backing_index(sink.backing)
    seen: dict[tuple[str, str], int] = {}
    for i, e in enumerate(entries):
        ident = (str(e.get("evidence")), str(e.get("config_hash")))
        want = index.get(ident)
        if want is None:
            # the entry of a key and config carries the evidence of the first point that
            # decided it, which may be another routing source's bundle of the same tune
            sink.deferred.append((F, f"entries[{i}]", dict(e)))
            continue
        bad = mismatches(e, want, tol, _allowed(want, bool(want.get("legacy"))))
        for name, expected, found in bad:
            sink.add(
                "store_export.field_mismatch",
                F,
                f"entries[{i}].{name}",
                expected,
                found,
                f"the entry's {name} is not the one recomputed from its runs",
            )
        if bad:
            continue
        if ident in seen:
            sink.add(
                "store_export.duplicate_entry",
                F,
                f"entries[{i}]",
                "one entry per decision",
                f"a second entry backed by run {ident[0]} (first: entries[{seen[ident]}])",
                "two exported entries rest on one decision",
            )
            continue
        seen[ident] = i
        sink.backed.append(dict(e))


def _check_legacy(
    sink: ExportSink,
    entries: list[Mapping[str, Any]],
    summary: Mapping[str, Any],
    runs: Mapping[str, Mapping[str, Any]],
    tol: Tol,
) -> None:
    sink.backing.extend(legacy_entries(sink, summary, runs))
    _bind_entries(sink, entries, tol)
    exported = {(*_key(e), e.get("config_hash")) for e in entries}
    for g in summary["groups"]:
        if not g["verified"]:
            continue
        key = (g["op"], g["dtype"], g["family"], g["tokens"], g["routing_class"])
        if (*key, g["best_config_hash"]) not in exported:
            sink.add(
                "store_export.missing_config",
                F,
                "entries",
                f"an entry for {g['key']} with config_hash {g['best_config_hash']}",
                "none",
                "a verified config is absent from the store export",
            )


def legacy_entries(
    sink: ExportSink, summary: Mapping[str, Any], runs: Mapping[str, Mapping[str, Any]]
) -> list[dict[str, Any]]:
    """The entries a run-schema-1.0 bundle's groups back (the earlier rule): a verified
    group's best run, and the baseline record of a group nothing beat."""
    out = []
    for g in summary["groups"]:
        if g["verified"] and g["best_run"] and g["best_run"] in runs:
            figures = {
                "speedup": g["speedup"], "noise_band": g["noise_band"],
                "median_us": g["best_median_us"], "baseline_us": g["baseline_median_us"],
            }  # fmt: skip
            out.append(
                {**expected_entry(
                    runs[g["best_run"]], sink, status="verified",
                    config_hash=g["best_config_hash"], evidence=g["best_run"],
                    figures=figures, validation=None,
                ), "legacy": True}
            )  # fmt: skip
        elif g["baseline_run"] and g["noise_band"] is not None and g["candidate_runs"]:
            base = runs[g["baseline_run"]]
            figures = {
                "speedup": 1.0, "noise_band": g["noise_band"],
                "median_us": g["baseline_median_us"], "baseline_us": g["baseline_median_us"],
            }  # fmt: skip
            out.append(
                {**expected_entry(
                    base, sink, status="baseline", config_hash=base["config_hash"],
                    evidence=g["baseline_run"], figures=figures, validation=None,
                ), "legacy": True}
            )  # fmt: skip
    return out


def resolve_deferred(
    results: Sequence[BundleResult], extra: list[dict[str, Any]] | None = None, tol: Tol = TOL
) -> list[Finding]:
    """Findings for deferred entries: each is bound to the recomputed entry of the run it
    names in another audited bundle (every field compared, as for a bundle's own entries);
    an entry no audited bundle's runs back is a finding.

    Entries resolved here are appended to ``extra`` (backed, for the shipped-export check).
    """
    if extra is None:
        extra = []
    index = _backing_index(b for r in results for b in r.backing)
    out = []
    for r in results:
        seen: dict[tuple[str, str, str], str] = {}
        for file, field, e in r.deferred:
            ident = (str(e.get("evidence")), str(e.get("config_hash")))
            want = index.get(ident)
            if want is None:
                out.append(
                    Finding(
                        "store_export.unbacked_entry",
                        file,
                        field,
                        "an entry whose evidence run backs it in an audited bundle",
                        f"{e.get('status')} {e.get('config_hash')} at "
                        f"{'/'.join(map(str, _key(e)))} (evidence {e.get('evidence')})",
                        "no audited bundle's runs support this entry",
                    )
                )
                continue
            bad = mismatches(e, want, tol, _allowed(want, bool(want.get("legacy"))))
            out.extend(
                Finding(
                    "store_export.field_mismatch", file, f"{field}.{name}", _fmt(expected),
                    _fmt(found), f"the entry's {name} is not the one recomputed from the runs "
                    "of the bundle holding its evidence run",
                )
                for name, expected, found in bad
            )  # fmt: skip
            if bad:
                continue
            dup = (file, *ident)
            if dup in seen:
                out.append(
                    Finding(
                        "store_export.duplicate_entry", file, field, "one entry per decision",
                        f"a second entry backed by run {ident[0]} (first: {seen[dup]})",
                        "two exported entries rest on one decision",
                    )
                )  # fmt: skip
                continue
            seen[dup] = field
            extra.append(dict(e))
    return out


def _fmt(x: Any) -> str:
    return x if isinstance(x, str) else json.dumps(x, sort_keys=True, default=str)


#: File names of shipped store exports (a store export outside any bundle, as the main job
#: imports), audited when they sit directly in a folder given to the audit.
SHIPPED_NAMES = ("store-export.json",)


def shipped_exports(path: Path) -> list[Path]:
    """The shipped store exports at ``path`` (the file itself, or directly inside the folder)."""
    if path.is_file():
        return [path] if path.name in SHIPPED_NAMES else []
    if path.is_dir():
        return [path / n for n in SHIPPED_NAMES if (path / n).is_file()]
    return []


#: Fields of a shipped entry that must equal those of the bundle entry it was exported from
#: (for a decode-op entry: those of the decision of its decode bundle, ``decode.decisions``).
SHIPPED_FIELDS = (
    "op", "dtype", "family", "dims", "tokens", "routing_class", "config", "config_hash",
    "fingerprint_hash", "device_name", "status", "source", "speedup", "noise_band", "median_us",
    "baseline_us", "evidence", "confidence", "validation",
)  # fmt: skip


def _shipped_mismatches(
    e: Mapping[str, Any], src: Mapping[str, Any], tol: Tol
) -> list[tuple[str, Any, Any]]:
    out = [
        (name, src.get(name), e.get(name))
        for name in SHIPPED_FIELDS
        if name != "validation" and not same(src.get(name), e.get(name), *tol)
    ]
    if src.get("op") != "fused_moe" and e.get("evidence") is None:
        # a decode tune run without an evidence folder names none
        out = [m for m in out if m[0] != "evidence"]
    return out + _validation_mismatches(e.get("validation"), src.get("validation"), tol)


def check_shipped_export(
    path: Path,
    results: Sequence[BundleResult],
    resolved: Sequence[dict[str, Any]] = (),
    tol: Tol = TOL,
) -> list[Finding]:
    """Every entry of a shipped export is bound to what an audited bundle backs: a fused-MoE
    entry to the bundle entry of its evidence run and config (itself bound to the runs), a
    decode-op entry to the closest decision of its op in an audited decode bundle; every
    field that differs is a finding naming it, and so is an entry nothing backs."""
    label = path.as_posix()
    try:
        doc = json.loads(path.read_bytes())
    except (OSError, ValueError, RecursionError) as exc:
        msg = str(exc)[:120]
        return [Finding("json.invalid", label, "", "a store export", msg, "not valid JSON")]
    if not isinstance(doc, dict) or doc.get("schema") != "mxdb.store-export":
        return [
            Finding(
                "schema.wrong_document", label, "schema", "mxdb.store-export",
                str(doc.get("schema")) if isinstance(doc, dict) else type(doc).__name__,
                "a shipped store export must be an mxdb.store-export document",
            )
        ]  # fmt: skip
    backed: dict[tuple[Any, ...], list[Mapping[str, Any]]] = defaultdict(list)
    for e in [e for r in results for e in r.backed] + list(resolved):
        backed[_shipped_ident(e)].append(e)
    for d in (d for r in results for d in r.decode):
        backed[_shipped_ident(d)].append(d)
    out = []
    seen: dict[int, str] = {}  # by the decision (bundle entry) that binds an entry
    for i, e in enumerate(doc.get("entries") or []):
        where = f"entries[{i}]"
        if not isinstance(e, dict):
            out.append(Finding("schema.invalid", label, where, "an entry", e, "not an object"))
            continue
        ident = _shipped_ident(e)
        cands = backed.get(ident, [])
        if not cands:
            out.append(
                Finding(
                    "shipped_export.unbacked_entry", label, where,
                    "an entry that an audited bundle's runs back (a fused-MoE entry by its "
                    "evidence run and config, a decode-op entry by its op)",
                    f"{e.get('status')} {e.get('config_hash')} at {'/'.join(map(str, _key(e)))}"
                    f" (evidence {e.get('evidence')})",
                    "no audited bundle backs this entry",
                )
            )  # fmt: skip
            continue
        # the same entry may be exported by several bundles of one tune, and a decode-op
        # entry is one of its op's decisions: the closest one binds it
        bad, src = min(
            ((_shipped_mismatches(e, c, tol), c) for c in cands), key=lambda m: len(m[0])
        )
        out.extend(
            Finding(
                "shipped_export.field_mismatch", label, f"{where}.{name}", _fmt(want), _fmt(got),
                "the shipped entry differs from what its bundle backs",
            )
            for name, want, got in bad
        )  # fmt: skip
        if not bad and id(src) in seen:
            out.append(
                Finding(
                    "shipped_export.duplicate_entry", label, where, "one entry per decision",
                    f"a second entry of {seen[id(src)]}'s decision",
                    "two shipped entries rest on one decision",
                )
            )  # fmt: skip
        elif not bad:
            seen[id(src)] = where
    return out


def _shipped_ident(e: Mapping[str, Any]) -> tuple[Any, ...]:
    """What binds a shipped entry: a fused-MoE entry's evidence run and config; a decode-op
    entry (which names no run) its op."""
    if e.get("op") == "fused_moe":
        return ("run", str(e.get("evidence")), str(e.get("config_hash")))
    return ("op", str(e.get("op")))
