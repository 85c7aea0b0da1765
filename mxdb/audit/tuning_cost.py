"""The tuning-cost claim (``tuning_cost.json``) as a kind of evidence: its declaration.

The figures are defined in :mod:`mxdb.evidence.tuning_cost` (the writer); the audit checks the
document's schema and points, each sweep file and run it names, and recomputes every figure
with the writer's own functions; a mismatch is a finding.  A 1.2 document names the
performance model that ordered the search: the bundle's copy of the model file must have the
recorded SHA-256 and be a model trained on exactly the shape families the document lists
(``tuning_cost.perf_model``), and each point's ``held_out_family`` and target are recomputed
from those families.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

from mxdb.audit.claims import ClaimKind, Context, Unit
from mxdb.audit.findings import FindingSink
from mxdb.configs import config_hash
from mxdb.errors import InvalidInputError
from mxdb.evidence.tuning_cost import (
    SCHEMA,
    SCHEMA_VERSION,
    SCHEMA_VERSIONS,
    TUNING_COST_NAME,
    model_names,
    recompute_point,
    summarise,
    sweep_best,
)
from mxdb.fileio import parse_json

#: what a 1.2 document records of its performance model
_MODEL_FIELDS = ("path", "sha256", "file", "shape_families")


def _families(doc: Mapping[str, Any]) -> list[str] | None:
    """The shape families of the model that ordered the search (1.2), else None."""
    if doc.get("schema_version") != "1.2":
        return None
    return [str(f) for f in doc["perf_model"]["shape_families"]]


def _perf_model_ok(sink: FindingSink, rel: str, doc: Mapping[str, Any], ctx: Context) -> bool:
    """A 1.2 document's model record, against the bundle's copy of the model file."""
    from mxdb.costmodel.model import PerfModel
    from mxdb.errors import MxdbError

    rec = doc.get("perf_model")
    if doc.get("schema_version") != "1.2":
        if rec is not None:
            sink.add("tuning_cost.invalid", rel, "perf_model", "no field before 1.2", "a record",
                     "only a 1.2 document names the model that ordered its search")  # fmt: skip
            return False
        return True
    if not isinstance(rec, Mapping) or any(k not in rec for k in _MODEL_FIELDS):
        sink.add("tuning_cost.invalid", rel, "perf_model", f"a record with {_MODEL_FIELDS}",
                 rec if rec is None else sorted(rec) if isinstance(rec, Mapping) else rec,
                 "a 1.2 claim must name the model that ordered its search")  # fmt: skip
        return False
    claimed = rec["shape_families"]
    if not isinstance(claimed, list) or not all(isinstance(f, str) for f in claimed):
        sink.add("tuning_cost.invalid", rel, "perf_model.shape_families", "a list of families",
                 claimed, "malformed")  # fmt: skip
        return False
    data = ctx.contents.get(str(rec["file"]))
    if data is None:
        sink.add("tuning_cost.perf_model", rel, "perf_model.file", rec["file"], "no file",
                 "the bundle does not hold the model file the claim names")  # fmt: skip
        return True
    digest = hashlib.sha256(data).hexdigest()
    if digest != rec["sha256"]:
        sink.add("tuning_cost.perf_model", rel, "perf_model.sha256", digest, rec["sha256"],
                 "the bundle's model file is not the one the run was ordered by")  # fmt: skip
    try:
        mdoc = parse_json(data, what=str(rec["file"]))
        model = PerfModel.from_doc(mdoc, str(rec["file"]))
    except (MxdbError, ValueError, TypeError) as exc:
        sink.add("tuning_cost.perf_model", str(rec["file"]), "", "a performance model",
                 str(exc)[:160], "the bundle's model file is not a performance model")  # fmt: skip
        return True
    if sorted(model.families) != sorted(claimed):
        sink.add("tuning_cost.perf_model", rel, "perf_model.shape_families",
                 sorted(model.families), sorted(claimed),
                 "the claim lists other training families than the model file")  # fmt: skip
    for key, want in model_names(mdoc).items():
        if rec.get(key) != want:
            sink.add("tuning_cost.perf_model", rel, f"perf_model.{key}", want, rec.get(key),
                     f"the claim's {key} families are not the model file's")  # fmt: skip
    return True


def _preflight(sink: FindingSink, rel: str, doc: Mapping[str, Any], ctx: Context) -> bool:
    # no JSON Schema describes this document: its type, version and points are checked here
    if doc.get("schema") != SCHEMA or doc.get("schema_version") not in SCHEMA_VERSIONS:
        sink.add(
            "tuning_cost.schema",
            rel,
            "schema",
            f"{SCHEMA} {SCHEMA_VERSION}",
            f"{doc.get('schema')} {doc.get('schema_version')}",
            "not a tuning-cost document this mxdb understands",
        )
        return False
    points = doc.get("points")
    if not isinstance(points, list) or not points:
        sink.add("tuning_cost.invalid", rel, "points", "a list of points", points, "no points")
        return False
    return _perf_model_ok(sink, rel, doc, ctx)


def _point_ok(sink: FindingSink, rel: str, where: str, p: Mapping[str, Any], ctx: Context) -> bool:
    """The point's runs and sweep files are the bundle's, and its figures can be recomputed."""
    try:
        ids, runs, contents = p["runs"], ctx.runs, ctx.contents
        missing = [lbl for lbl, rid in ids.items() if rid not in runs]
        if missing:
            sink.add(
                "tuning_cost.missing_run",
                rel,
                f"{where}.runs",
                "runs present in runs/",
                missing,
                "the claim names runs the bundle does not hold",
            )
            return False
        if ctx.doc.get("schema_version") != "1.0" and "comparison" not in p["mxdb"]:
            sink.add(
                "tuning_cost.invalid",
                rel,
                f"{where}.mxdb.comparison",
                "mxdb's final comparison",
                None,
                "a 1.1 claim must carry the samples that decide mxdb's answer",
            )
            return False
        # raises on a malformed point, before its figures are compared
        recompute_point(p, runs, _families(ctx.doc))
        recorded = p["exhaustive"].get("recorded_in")
        if recorded is not None:
            # reused sweeps: the bundle's copies must be the files the run recorded
            found = [
                hashlib.sha256(contents[s]).hexdigest() if s in contents else None
                for s in p["exhaustive"]["sweeps"]
            ]
            if found != list(recorded.get("sweep_sha256") or []):
                sink.add(
                    "tuning_cost.sweep_source",
                    rel,
                    f"{where}.exhaustive.recorded_in.sweep_sha256",
                    found,
                    recorded.get("sweep_sha256"),
                    "the sweep files differ from the recorded run's",
                )
        for sweep_rel, label in zip(
            p["exhaustive"]["sweeps"], ("exhaustive_gemm1", "exhaustive_gemm2"), strict=True
        ):
            if sweep_rel not in contents:
                sink.add(
                    "tuning_cost.missing_sweep",
                    rel,
                    f"{where}.exhaustive.sweeps",
                    sweep_rel,
                    "no file",
                    "the claim names a sweep file the bundle does not hold",
                )
                continue
            sweep = parse_json(contents[sweep_rel], what=sweep_rel)
            best_hash, _ = sweep_best(sweep)
            run_hash = runs[ids[label]].get("config_hash")
            if best_hash != config_hash(sweep.get("best", {})) or best_hash != run_hash:
                sink.add(
                    "tuning_cost.sweep_best",
                    sweep_rel,
                    "best",
                    best_hash,
                    run_hash,
                    f"the {label} run does not time the sweep's fastest config",
                )
        return True
    except (AttributeError, KeyError, TypeError, ValueError, InvalidInputError) as exc:
        sink.add("tuning_cost.invalid", rel, where, "a complete point", repr(exc)[:80], "malformed")
        return False


def _point_figures(p: Mapping[str, Any], ctx: Context) -> Mapping[str, Any]:
    sweeps = [s for s in p["exhaustive"]["sweeps"] if s in ctx.contents]
    n = sum(sweep_best(parse_json(ctx.contents[s], what=s))[1] for s in sweeps)
    return {**recompute_point(p, ctx.runs, _families(ctx.doc)), "exhaustive_configs_timed": n}


def _figures(doc: Mapping[str, Any], ctx: Context) -> Mapping[str, Any]:
    # the summary of the recomputed points (each point's claimed figures are compared above)
    fams = _families(doc)
    return {"summary": summarise([recompute_point(p, ctx.runs, fams) for p in doc["points"]])}


KIND = ClaimKind(
    name="tuning_cost",
    document=TUNING_COST_NAME,
    schema=None,
    codes=lambda _: "mismatch",
    units=(Unit("points", check=_point_ok, figures=_point_figures),),
    figures=_figures,
    preflight=_preflight,
    fingerprint_field=None,
)
