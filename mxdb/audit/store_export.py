"""The store export of a bundle, rebuilt from its runs: no entry without runs behind it.

A tuning bundle's ``store_export.json`` is what ``mxdb import mxdb`` loads and the dispatcher
answers from, so the audit does not take it on trust.  For bundles whose runs name their
tuning point (run schema 1.1), every point's decision is made again from the raw samples with
the tuner's own rule (:func:`mxdb.pointverdict.decide`) and each exported entry must be one of
those decisions, with the same key, config, status and figures.  For earlier bundles (run
schema 1.0) each entry must have its evidence run in the bundle, or a comparison group at its
key that the earlier rule verified with its config, and its speedup and noise band must be
those of its runs.  An entry with nothing behind it is a finding; so is a decision missing
from the export.
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
from mxdb.evidence.summary import family_of, group_key, run_passes
from mxdb.models import DECIDED_STATUSES, SINGLE_SOURCE


class ExportSink(FindingSink, Protocol):
    """A bundle audit that also keeps what its store export rests on (cross-bundle checks)."""

    backed: list[dict[str, Any]]
    deferred: list[tuple[str, str, dict[str, Any]]]
    backing: list[tuple[str, str, str, float | None, float | None, float | None]]


F = "store_export.json"
#: Entry figures compared with their recomputation.
FIGURES = ("speedup", "noise_band", "median_us", "baseline_us", "confidence")
#: Statuses an exported tune entry may carry; ``rejected`` is a verified entry that a later
#: trace of its key contradicted (never dispatched, so it needs no more than its decision);
#: ``imported`` only for the tuner's single-config record (source ``tune-single``).
STATUSES = (*DECIDED_STATUSES, "rejected", "imported")


def _key(e: Mapping[str, Any]) -> tuple[Any, ...]:
    return (e.get("op"), e.get("dtype"), e.get("family"), e.get("tokens"), e.get("routing_class"))


def _shipped_key(e: Mapping[str, Any]) -> tuple[Any, ...]:
    k = _key(e)
    return (k[0], k[1], k[2], k[3], k[4], e.get("config_hash"), e.get("status"))


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
    singles = []
    for base, d, single in _decided(runs):
        s = base["shape"]
        key = (base["op"], s["dtype"], family_of(s), s["tokens"], base["routing_class"])
        made.append((key, base.get("point"), d))
        sink.backing.append(
            (str(d.evidence), str(d.config_hash), d.status, d.speedup, d.noise_band, d.confidence)
        )
        if single is not None:
            singles.append((key, single))
            sink.backing.append(
                (str(single.evidence), str(single.config_hash), "imported", single.speedup,
                 single.noise_band, None)
            )  # fmt: skip

    def backs(key: tuple[Any, ...], d: pointverdict.PointDecision, e: Mapping[str, Any]) -> bool:
        return (
            _key(e) == key
            and e.get("config_hash") == d.config_hash
            and e.get("status") in ALLOWED.get(d.status, ())
        )

    for i, e in enumerate(entries):
        if e.get("status") == "imported":
            # a single-config record: one the tuner's rule makes again from its point's runs
            found = next(
                (
                    d
                    for k, d in singles
                    if _key(e) == k
                    and e.get("config_hash") == d.config_hash
                    and e.get("evidence") == d.evidence
                ),
                None,
            )
            if found is None:
                sink.deferred.append((F, f"entries[{i}]", dict(e)))
            else:
                _compare_figures(sink, i, e, found, tol)
                sink.backed.append(dict(e))
            continue
        found = next(
            (d for k, _, d in made if backs(k, d, e) and d.evidence == e.get("evidence")), None
        )
        if found is None:
            # one entry per key and config: it carries the evidence of the first point that
            # decided it, which may be another routing source's bundle of the same tune
            sink.deferred.append((F, f"entries[{i}]", dict(e)))
            continue
        _compare_figures(sink, i, e, found, tol)
        sink.backed.append(dict(e))
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


def _compare_figures(
    sink: FindingSink,
    i: int,
    e: Mapping[str, Any],
    d: pointverdict.PointDecision,
    tol: Tol,
) -> None:
    for name in FIGURES:
        if not same(e.get(name), getattr(d, name), *tol):
            sink.add(
                "store_export.field_mismatch",
                F,
                f"entries[{i}].{name}",
                getattr(d, name),
                e.get(name),
                f"the entry's {name} is not the one recomputed from its runs",
            )
    if e.get("evidence") != d.evidence:
        sink.add(
            "store_export.field_mismatch",
            F,
            f"entries[{i}].evidence",
            d.evidence,
            e.get("evidence"),
            "the entry's evidence run is not the one its decision rests on",
        )
    want = [(v.get("comparison"), bool(v.get("won"))) for v in d.validation]
    got = [(v.get("comparison"), bool(v.get("won"))) for v in e.get("validation") or []]
    if want != got:
        sink.add(
            "store_export.field_mismatch",
            F,
            f"entries[{i}].validation",
            want,
            got,
            "the entry's held-out validation is not the one recomputed from its runs",
        )


def _check_legacy(
    sink: ExportSink,
    entries: list[Mapping[str, Any]],
    summary: Mapping[str, Any],
    runs: Mapping[str, Mapping[str, Any]],
    tol: Tol,
) -> None:
    groups = {g["key"]: g for g in summary["groups"]}
    by_key: dict[tuple[Any, ...], list[Mapping[str, Any]]] = defaultdict(list)
    for g in summary["groups"]:
        by_key[(g["op"], g["dtype"], g["family"], g["tokens"], g["routing_class"])].append(g)
    for g in summary["groups"]:
        if g["verified"] and g["best_run"]:
            sink.backing.append(
                (g["best_run"], g["best_config_hash"], "verified", g["speedup"], g["noise_band"],
                 None)
            )  # fmt: skip
        elif g["baseline_run"] and g["noise_band"] is not None and g["candidate_runs"]:
            base = runs[g["baseline_run"]]
            sink.backing.append(
                (g["baseline_run"], base["config_hash"], "baseline", 1.0, g["noise_band"], None)
            )
    exported: set[tuple[Any, ...]] = set()
    for i, e in enumerate(entries):
        exported.add((*_key(e), e.get("config_hash")))
        run = runs.get(str(e.get("evidence")))
        if run is not None:
            g = groups.get(group_key(run))
            if g is None:
                continue
            if _key(e) != (g["op"], g["dtype"], g["family"], g["tokens"], g["routing_class"]):
                sink.add(
                    "store_export.field_mismatch",
                    F,
                    f"entries[{i}]",
                    g["key"],
                    "/".join(map(str, _key(e))),
                    "the entry's key is not that of its evidence run",
                )
            if run["config_hash"] != e.get("config_hash"):
                sink.add(
                    "store_export.field_mismatch",
                    F,
                    f"entries[{i}].config_hash",
                    run["config_hash"],
                    e.get("config_hash"),
                    "the entry's config is not that of its evidence run",
                )
            want_status = "baseline" if run["role"] == "baseline" else "verified"
            ok_status = (want_status, e.get("status")) in (
                ("verified", "verified"),
                ("verified", "rejected"),
                ("baseline", "baseline"),
            )
            if not ok_status or (want_status == "verified" and not g["verified"]):
                sink.add(
                    "store_export.field_mismatch",
                    F,
                    f"entries[{i}].status",
                    want_status if g["verified"] or want_status == "baseline" else "not verified",
                    e.get("status"),
                    "the entry's status is not what its runs support",
                )
            verified = want_status == "verified"
            want = {
                "speedup": g["speedup"] if verified else 1.0,
                "noise_band": g["noise_band"],
                "median_us": g["best_median_us"] if verified else g["baseline_median_us"],
                "baseline_us": g["baseline_median_us"],
            }
            for name, value in want.items():
                if not same(e.get(name), value, *tol):
                    sink.add(
                        "store_export.field_mismatch",
                        F,
                        f"entries[{i}].{name}",
                        value,
                        e.get(name),
                        f"the entry's {name} is not the one recomputed from its runs",
                    )
            sink.backed.append(dict(e))
            continue
        # a config that won two points of one class carries the first point's evidence, which
        # may sit in the bundle of another routing source: a group here must back it
        backed = any(
            (e.get("status") in ("verified", "rejected") and g["verified"]
             and g["best_config_hash"] == e.get("config_hash"))
            or (e.get("status") == "baseline" and not g["verified"] and g["baseline_run"]
                and runs[g["baseline_run"]]["config_hash"] == e.get("config_hash"))
            for g in by_key.get(_key(e), [])
        )  # fmt: skip
        if backed:
            sink.backed.append(dict(e))
        else:
            # resolved against the other bundles audited with this one (the same tune wrote
            # one bundle per routing source): unresolved, it is a finding
            sink.deferred.append((F, f"entries[{i}]", dict(e)))
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


def resolve_deferred(
    results: Sequence[BundleResult], extra: list[dict[str, Any]] | None = None, tol: Tol = TOL
) -> list[Finding]:
    """Findings for deferred entries that no bundle of the same audit backs.

    Entries resolved here are appended to ``extra`` (backed, for the shipped-export check).
    """
    if extra is None:
        extra = []
    backing = {(b[0], b[1]): b[2:] for r in results for b in r.backing}
    out = []
    for r in results:
        for file, field, e in r.deferred:
            got = backing.get((str(e.get("evidence")), str(e.get("config_hash"))))
            if (
                got is not None
                # the exported status is one the backing decision allows (a verified or parity
                # entry may since have been rejected)
                and e.get("status") in ALLOWED.get(str(got[0]), ())
                and same(got[1], e.get("speedup"), *tol)
                and same(got[2], e.get("noise_band"), *tol)
                and (got[3] is None or same(got[3], e.get("confidence"), *tol))
            ):
                extra.append(dict(e))
                continue
            out.append(
                Finding(
                    "store_export.unbacked_entry",
                    file,
                    field,
                    "an entry whose evidence run backs it in an audited bundle",
                    f"{e.get('status')} {e.get('config_hash')} at {'/'.join(map(str, _key(e)))}"
                    f" (evidence {e.get('evidence')})",
                    "no audited bundle's runs support this entry",
                )
            )
    return out


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


#: Fields of a shipped entry that must equal those of the bundle entry it was exported from.
SHIPPED_FIELDS = (
    "op", "dtype", "family", "dims", "tokens", "routing_class", "config", "config_hash",
    "fingerprint_hash", "status", "speedup", "noise_band", "median_us", "baseline_us",
    "evidence", "confidence", "validation",
)  # fmt: skip


def check_shipped_export(
    path: Path,
    results: Sequence[BundleResult],
    resolved: Sequence[dict[str, Any]] = (),
    tol: Tol = TOL,
) -> list[Finding]:
    """Every entry of a shipped export must be an entry some audited bundle backs."""
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
    backed: dict[tuple[Any, ...], list[dict[str, Any]]] = defaultdict(list)
    for e in [e for r in results for e in r.backed] + list(resolved):
        backed[_shipped_key(e)].append(e)
    decode = {d for r in results for d in r.decode}
    out = []
    for i, e in enumerate(doc.get("entries") or []):
        where = f"entries[{i}]"
        if not isinstance(e, dict):
            out.append(Finding("schema.invalid", label, where, "an entry", e, "not an object"))
            continue
        if e.get("op") != "fused_moe":
            dims = tuple(sorted((e.get("dims") or {}).items()))
            impl = (e.get("config") or {}).get("impl")
            hit = any(
                d[:4] == (e.get("op"), e.get("dtype"), dims, impl)
                and same(d[4], e.get("speedup"), *tol)
                and same(d[5], e.get("noise_band"), *tol)
                for d in decode
            )
            if not hit or e.get("status") != "verified":
                out.append(
                    Finding(
                        "shipped_export.unbacked_entry", label, where,
                        "a decision of an audited decode-op bundle",
                        f"{e.get('op')} {impl} at tokens {e.get('tokens')}",
                        "no audited decode-op bundle decided this entry",
                    )
                )  # fmt: skip
            continue
        cands = backed.get(_shipped_key(e), [])
        if not cands:
            out.append(
                Finding(
                    "shipped_export.unbacked_entry", label, where,
                    "an entry that an audited bundle's runs back",
                    f"{e.get('status')} {e.get('config_hash')} at {'/'.join(map(str, _key(e)))}",
                    "no audited bundle exports this entry",
                )
            )  # fmt: skip
            continue
        src = next((c for c in cands if c.get("evidence") == e.get("evidence")), cands[0])
        for name in SHIPPED_FIELDS:
            if not same(src.get(name), e.get(name), *tol):
                out.append(
                    Finding(
                        "shipped_export.field_mismatch", label, f"{where}.{name}",
                        str(src.get(name)), str(e.get(name)),
                        "the shipped entry differs from the bundle entry it came from",
                    )
                )  # fmt: skip
    return out
