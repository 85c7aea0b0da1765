"""The claims engine: one driver audits every kind of evidence from its declaration.

A kind of evidence (the peers comparison, the lean layer, the decode ops, ...) is declared once
as a :class:`ClaimKind`: the document it lives in and its schema, the units of raw samples it
holds (points, cases, models), the checks on them that are not formulas (sample validity,
shapes, hashes), the derived figures as functions over the samples (the writer's own
functions), its targets, and the finding code of each figure.  :func:`audit_claim` then does
the same for every kind: the fingerprint the document names, each unit's invariants, each
unit's figures recomputed and compared leaf by leaf, the document's figures recomputed from the
valid units, and every target's threshold, measured value and verdict.  A new kind of evidence
is one declaration (and its schema); the auditor finds it in :mod:`mxdb.audit.kinds`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from mxdb.audit.compare import Tol, same
from mxdb.audit.findings import FindingSink
from mxdb.configs import config_hash
from mxdb.evidence import stats
from mxdb.evidence.peers import DECODE_MAX_TOKENS, TargetSpec, judge
from mxdb.shapes import preset_shape

#: A place in a document: keys and list indices from its root.
Path_ = tuple[str | int, ...]


@dataclass(frozen=True)
class Context:
    """What a kind's checks may read besides its document: the bundle's runs (by run id), its
    traces (by trace hash), every file's bytes (by bundle-relative name) and its fingerprint;
    ``doc`` is the document under audit (set by :func:`audit_claim`), for a unit's checks that
    depend on a document-wide setting."""

    runs: Mapping[str, Any] = field(default_factory=dict)
    traces: Mapping[str, Any] = field(default_factory=dict)
    contents: Mapping[str, bytes] = field(default_factory=dict)
    fp_hash: str | None = None
    doc: Mapping[str, Any] = field(default_factory=dict)


#: ``check(sink, rel, where, unit, ctx) -> ok``: the invariants of one unit that are not
#: formulas; findings go to ``sink``; False when the unit's figures cannot be recomputed.
UnitCheck = Callable[[FindingSink, str, str, Mapping[str, Any], Context], bool]
#: ``recompute(unit, ctx)``: the unit's derived fields as the writer computes them (a mapping
#: of the unit's keys to their values; each is compared leaf by leaf with the claimed one).
UnitFigures = Callable[[Mapping[str, Any], Context], Mapping[str, Any]]


@dataclass(frozen=True)
class Unit:
    """One list of raw-sample units in a document (``doc[path]``), checked one by one."""

    path: str
    check: UnitCheck | None = None
    figures: UnitFigures | None = None


@dataclass(frozen=True)
class ClaimKind:
    """One kind of evidence, declared once (module docstring).

    ``figures(doc, ctx)`` recomputes the document's derived part (every key it returns is
    compared leaf by leaf; ``targets`` are judged on ``result[figures_key]``); it runs only
    when every unit passed its checks; ``targets`` may be a function of the document (targets
    that depend on its schema version) and ``target_figures(recomputed)`` the figures they
    name when those are not one key of it.  ``codes`` maps a leaf's path to its finding code (a
    code without a dot gets the kind's prefix).  ``preflight(sink, rel, doc, ctx)`` holds
    document-level invariants and returns False when nothing else can be checked.  ``schema``
    is None for a document without a JSON Schema: the auditor then only reads it as a JSON
    object, and the preflight checks its type and shape.
    """

    name: str
    document: str
    schema: str | None
    codes: Callable[[Path_], str]
    units: Sequence[Unit] = ()
    figures: Callable[[Mapping[str, Any], Context], Mapping[str, Any]] | None = None
    targets: Sequence[TargetSpec] | Callable[[Mapping[str, Any]], Sequence[TargetSpec]] = ()
    figures_key: str = "figures"
    target_figures: Callable[[Mapping[str, Any]], Mapping[str, Any]] | None = None
    preflight: Callable[[FindingSink, str, Mapping[str, Any], Context], bool] | None = None
    #: the document's key naming the environment it was measured in (None: not checked here)
    fingerprint_field: str | None = "fingerprint_hash"
    #: ``figures`` rebuilds the whole document (but its targets): a claimed key it does not
    #: give is a finding too
    whole_document: bool = False
    #: fixed settings of the kind: key -> (mxdb's value, why); another value is a
    #: ``<name>.field_mismatch``
    settings: Mapping[str, tuple[Any, str]] = field(default_factory=dict)
    #: ``(file, render)``: the bundle's report file, when present, must be exactly
    #: ``render(doc)`` (else ``<name>.report_mismatch``)
    report: tuple[str, Callable[[Mapping[str, Any]], str]] | None = None

    def code(self, path: Path_) -> str:
        c = self.codes(path)
        return c if "." in c else f"{self.name}.{c}"


#: The setting of every kind with decode points: which token counts they are.
DECODE_SETTING: Mapping[str, tuple[Any, str]] = {
    "decode_max_tokens": (DECODE_MAX_TOKENS, "decode points are those with M at most 16"),
}


def dotted(path: Path_) -> str:
    """``("points", 3, "median_us")`` -> ``points[3].median_us``."""
    out = ""
    for p in path:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else p)
    return out


def audit_claim(
    kind: ClaimKind,
    sink: FindingSink,
    doc: Mapping[str, Any],
    ctx: Context,
    tol: Tol,
    rel: str | None = None,
) -> None:
    """Audit one schema-valid document of ``kind``; every finding goes to ``sink``."""
    rel = rel or kind.document
    ctx = replace(ctx, doc=doc)
    fp_key = kind.fingerprint_field
    if fp_key is not None and ctx.fp_hash is not None and doc.get(fp_key) != ctx.fp_hash:
        sink.add(
            f"{kind.name}.fingerprint_mismatch",
            rel,
            fp_key,
            ctx.fp_hash,
            doc.get(fp_key),
            "the claim names another environment than the bundle's fingerprint",
        )
    for key, (want, why) in kind.settings.items():
        if doc.get(key) != want:
            sink.add(f"{kind.name}.field_mismatch", rel, key, want, doc.get(key), why)
    if kind.report is not None and kind.report[0] in ctx.contents:
        name, render = kind.report
        try:
            want = render(doc).encode()
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            sink.add(f"{kind.name}.report_mismatch", name, "", "a report", str(exc)[:160],
                     "cannot render")  # fmt: skip
        else:
            check_rendering(sink, name, f"{kind.name}.report_mismatch", ctx.contents[name],
                            want, f"{name} is not the rendering of {kind.document}")  # fmt: skip
    if kind.preflight is not None and not kind.preflight(sink, rel, doc, ctx):
        return
    all_ok = True
    for unit in kind.units:
        for i, item in enumerate(doc.get(unit.path) or ()):
            where = f"{unit.path}[{i}]"
            ok = unit.check(sink, rel, where, item, ctx) if unit.check is not None else True
            all_ok &= ok
            if ok and unit.figures is not None:
                for key, value in unit.figures(item, ctx).items():
                    compare_claims(
                        sink, rel, item.get(key), value, kind.code, tol, (unit.path, i, key)
                    )
    if not all_ok or kind.figures is None:
        return  # figures of invalid samples cannot be recomputed
    recomputed = dict(kind.figures(doc, ctx))
    if kind.whole_document:
        claimed = {k: v for k, v in doc.items() if k != "targets"}
        compare_claims(
            sink, rel, claimed, {k: v for k, v in recomputed.items() if k != "targets"},
            kind.code, tol,
        )  # fmt: skip
    else:
        for key, value in recomputed.items():
            if key != "targets":
                compare_claims(sink, rel, doc.get(key), value, kind.code, tol, (key,))
    specs = kind.targets(doc) if callable(kind.targets) else kind.targets
    if specs:
        figures = (
            kind.target_figures(recomputed)
            if kind.target_figures is not None
            else recomputed.get(kind.figures_key) or {}
        )
        check_targets(sink, rel, kind.name, doc.get("targets") or [], specs, figures, tol)


def check_rendering(
    sink: FindingSink, rel: str, code: str, got: bytes, want: bytes, why: str
) -> bool:
    """A ``code`` finding at the first line where a rendered file differs from its rendering
    (edited by hand?); True when they are the same bytes."""
    if got == want:
        return True
    got_lines = got.decode("utf-8", "replace").splitlines()
    want_lines = want.decode().splitlines()
    line = next(
        (i for i, (a, b) in enumerate(zip(got_lines, want_lines, strict=False)) if a != b),
        min(len(got_lines), len(want_lines)),
    )
    sink.add(
        code,
        rel,
        f"line {line + 1}",
        want_lines[line] if line < len(want_lines) else "(end of file)",
        got_lines[line] if line < len(got_lines) else "(end of file)",
        f"{why} (edited by hand?)",
    )
    return False


def check_samples(
    sink: FindingSink,
    rel: str,
    where: str,
    prefix: str,
    series: Mapping[str, Any],
    expected: str = "a finite positive number of microseconds",
) -> bool:
    """A ``<prefix>.sample_invalid`` finding for each series (name -> list of timings, or one
    timing) holding a sample that is not a finite positive number; True when all are valid."""
    ok = True
    for name, samples in series.items():
        many = isinstance(samples, list)
        invalid = [j for j, x in enumerate(samples if many else [samples])
                   if not stats.valid_sample(x)]  # fmt: skip
        if invalid:
            j = invalid[0]
            sink.add(
                f"{prefix}.sample_invalid",
                rel,
                f"{where}.{name}[{j}]" if many else f"{where}.{name}",
                expected,
                samples[j] if many else samples,
                f"{len(invalid)} invalid timing sample(s)",
            )
            ok = False
    return ok


def check_shape_and_config(
    sink: FindingSink, rel: str, where: str, prefix: str, p: Mapping[str, Any]
) -> None:
    """``<prefix>.shape_mismatch`` where the point's shape is not its family's at its token
    count, ``<prefix>.config_hash_mismatch`` where its config hash is not its config's."""
    try:
        want = preset_shape(p["family"], p["tokens"], p["shape"]["dtype"]).to_dict()
    except Exception:  # an unknown family or dtype: no shape can match
        want = {"family": p["family"], "tokens": p["tokens"]}
    if want != p["shape"]:
        sink.add(f"{prefix}.shape_mismatch", rel, f"{where}.shape", want, p["shape"],
                 "the shape is not that of the family at this token count")  # fmt: skip
    try:
        h = config_hash(p["config"])
    except Exception as exc:  # a config that cannot be hashed is a finding, not a crash
        h = f"no hash ({type(exc).__name__})"
    if h != p["config_hash"]:
        sink.add(f"{prefix}.config_hash_mismatch", rel, f"{where}.config_hash", h,
                 p["config_hash"], "config_hash is not the hash of the config")  # fmt: skip


def compare_claims(
    sink: FindingSink,
    rel: str,
    claimed: Any,
    recomputed: Any,
    code_for: Callable[[Path_], str],
    tol: Tol,
    path: Path_ = (),
) -> None:
    """A finding for each leaf where the claim differs from its recomputation."""
    if isinstance(claimed, dict) and isinstance(recomputed, dict):
        for k in sorted(set(claimed) | set(recomputed)):
            sub = (*path, k)
            if k not in claimed or k not in recomputed:
                sink.add(
                    code_for(sub),
                    rel,
                    dotted(sub),
                    recomputed.get(k, "no field"),
                    claimed.get(k, "no field"),
                    "a claimed figure is missing" if k not in claimed else "an unknown field",
                )
            else:
                compare_claims(sink, rel, claimed[k], recomputed[k], code_for, tol, sub)
        return
    if (
        isinstance(claimed, list)
        and isinstance(recomputed, list)
        and len(claimed) == len(recomputed)
    ):
        for i, (c, r) in enumerate(zip(claimed, recomputed, strict=True)):
            compare_claims(sink, rel, c, r, code_for, tol, (*path, i))
        return
    if not same(claimed, recomputed, *tol):
        sink.add(
            code_for(path),
            rel,
            dotted(path),
            recomputed,
            claimed,
            "claimed figure differs from its recomputation from the raw samples",
        )


def check_targets(
    sink: FindingSink,
    rel: str,
    prefix: str,
    claimed: Sequence[Mapping[str, Any]],
    specs: Sequence[TargetSpec],
    figures: Mapping[str, Any],
    tol: Tol,
) -> None:
    """Targets: present, with mxdb's threshold, the recomputed value and the right verdict."""
    by_name: dict[str, tuple[int, Mapping[str, Any]]] = {}
    for i, t in enumerate(claimed):
        by_name[str(t.get("name"))] = (i, t)
    known = {s.name for s in specs}
    for name, (i, _) in sorted(by_name.items()):
        if name not in known:
            sink.add(
                f"{prefix}.target_missing",
                rel,
                f"targets[{i}].name",
                " or ".join(sorted(known)),
                name,
                "a target mxdb does not define",
            )
    for spec in specs:
        if spec.name not in by_name:
            sink.add(
                f"{prefix}.target_missing",
                rel,
                "targets",
                spec.name,
                "no such target",
                "a target of this claim is not reported",
            )
            continue
        i, t = by_name[spec.name]
        where = f"targets[{i}]"
        for key in ("figure", "comparison", "threshold"):
            want = getattr(spec, key)
            if not same(t.get(key), want, *tol):
                sink.add(
                    f"{prefix}.target_threshold_mismatch",
                    rel,
                    f"{where}.{key}",
                    want,
                    t.get(key),
                    f"target {spec.name}'s {key} is not mxdb's",
                )
        measured = figures.get(spec.figure)
        value = None if measured is None else float(measured)
        if not same(t.get("measured"), value, *tol):
            sink.add(
                f"{prefix}.target_measured_mismatch",
                rel,
                f"{where}.measured",
                value,
                t.get("measured"),
                f"target {spec.name}'s measured value is not the recomputed {spec.figure}",
            )
        verdict = judge(spec.comparison, value, spec.threshold)
        if t.get("passed") is not verdict:
            op = ">=" if spec.comparison == "ge" else "<="
            sink.add(
                f"{prefix}.target_verdict_mismatch",
                rel,
                f"{where}.passed",
                verdict,
                t.get("passed"),
                f"target {spec.name} is {'met' if verdict else 'missed'}: "
                f"{value} {op} {spec.threshold} is {verdict}",
            )
