"""The audit of a decode bundle (``decode.json``, ``mxdb.decode``), declared as a claim kind.

Per case: the thresholds are the dtype's table, there is one baseline and every ok candidate
has finite positive samples; then its winner, speedup and noise band are recomputed with the
tuner's rule (:func:`mxdb.evidence.decode.case_claims`).  Per model: a unique stock variant and
finite positive step times; then every variant's tokens/s, launches per token and ratios to
stock, and the dense model's target verdict (:func:`mxdb.evidence.decode.model_claims`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mxdb.audit.claims import ClaimKind, Context, Path_, Unit
from mxdb.audit.findings import FindingSink
from mxdb.configs import config_hash
from mxdb.decode_rule import ROUTING_CLASS
from mxdb.errors import ShapeError
from mxdb.evidence import stats
from mxdb.evidence.decode import STOCK, case_claims, model_claims
from mxdb.evidence.thresholds import THRESHOLDS
from mxdb.shapes import OpShape


def _case_ok(sink: FindingSink, rel: str, where: str, case: Mapping[str, Any], _: Context) -> bool:
    t = THRESHOLDS.get(case["dtype"])
    if t is None or (case["threshold_abs"], case["threshold_rel"]) != (t.max_abs, t.max_rel):
        sink.add(
            "decode.threshold_mismatch",
            rel,
            f"{where}.threshold_abs",
            t,
            (case["threshold_abs"], case["threshold_rel"]),
            "thresholds are not the dtype's table",
        )
    roles = [c["role"] for c in case["candidates"]]
    if roles.count("baseline") == 1 and all(
        c["samples_us"] and all(stats.valid_sample(x) for x in c["samples_us"])
        for c in case["candidates"]
        if c["status"] == "ok"
    ):
        return True
    sink.add(
        "decode.samples_invalid",
        rel,
        where,
        "one baseline; finite positive samples for every ok candidate",
        roles,
        "the case's raw samples cannot back a decision",
    )
    return False


def _model_ok(sink: FindingSink, rel: str, where: str, m: Mapping[str, Any], _: Context) -> bool:
    bad = [v["name"] for v in m["variants"] if not all(map(stats.valid_sample, v["step_s"]))]
    names = [v["name"] for v in m["variants"]]
    if not bad and STOCK in names and len(set(names)) == len(names):
        return True
    sink.add(
        "decode.samples_invalid",
        rel,
        where,
        "a unique stock variant and finite positive step times",
        bad or names,
        "the model's raw figures cannot back its claims",
    )
    return False


def _model_figures(model: Mapping[str, Any], _: Context) -> Mapping[str, Any]:
    claims, meets = model_claims(model)
    return {"claims": claims, "meets_target": meets}


def decisions(doc: Mapping[str, Any], device_name: str | None, bundle: str) -> list[dict[str, Any]]:
    """The entries the document's decided cases back, as the decode tuner writes them
    (``mxdb.tune.decode``): what a shipped store export's decode entries must equal.
    ``device_name`` is the bundle fingerprint's, ``bundle`` the folder name an entry's
    evidence names."""
    out = []
    for c in doc["cases"]:
        claims = c.get("claims") or {}
        if claims.get("winner"):
            config = {"impl": claims["winner"]}
            try:
                family: str | None = OpShape(c["op"], c["dims"], c["tokens"], c["dtype"]).family
            except ShapeError:  # no entry can be of a shape that is none
                family = None
            out.append(
                {
                    "op": c["op"],
                    "dtype": c["dtype"],
                    "family": family,
                    "dims": {**c["dims"], "tokens": c["tokens"]},
                    "tokens": c["tokens"],
                    "routing_class": ROUTING_CLASS,
                    "config": config,
                    "config_hash": config_hash(config),
                    "fingerprint_hash": doc["fingerprint_hash"],
                    "device_name": device_name,
                    "status": "verified",
                    "source": "tune",
                    "speedup": claims.get("speedup"),
                    "noise_band": claims.get("noise_band"),
                    "median_us": claims.get("winner_median_us"),
                    "baseline_us": claims.get("baseline_median_us"),
                    "evidence": bundle,
                    "confidence": None,
                    "validation": None,
                }
            )
    return out


def _code(path: Path_) -> str:
    return "target_mismatch" if path[2:3] == ("meets_target",) else "claim_mismatch"


KIND = ClaimKind(
    name="decode",
    document="decode.json",
    schema="mxdb.decode",
    codes=_code,
    units=(
        Unit("cases", check=_case_ok, figures=lambda c, _: {"claims": case_claims(c)}),
        Unit("models", check=_model_ok, figures=_model_figures),
    ),
)
