"""The audit of a decode bundle (``decode.json``, ``mxdb.decode``).

Recomputes from the raw samples: each case's correctness verdicts (the dtype's thresholds),
winner, speedup and noise band (the tuner's rule, :func:`mxdb.tune.decode.decide`); each
benchmarked model's tokens/s, launches per token, speedups and launch ratios against the stock
variant, and the dense model's target verdict.  Checks the document names the bundle's
fingerprint.  A mismatch is a finding.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mxdb.audit.compare import Tol, same
from mxdb.audit.findings import FindingSink
from mxdb.evidence import stats
from mxdb.evidence.decode import STOCK, case_claims, model_claims
from mxdb.evidence.thresholds import THRESHOLDS


def check_decode(sink: FindingSink, rel: str, doc: Mapping[str, Any], tol: Tol) -> None:
    """Add a finding for every claim of ``doc`` that its raw figures do not support."""
    if sink.fp_hash is not None and doc["fingerprint_hash"] != sink.fp_hash:
        sink.add(
            "decode.fingerprint_mismatch",
            rel,
            "fingerprint_hash",
            sink.fp_hash,
            doc["fingerprint_hash"],
            "the document names another environment than the bundle's fingerprint",
        )
    for i, case in enumerate(doc["cases"]):
        where = f"cases[{i}]"
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
        if roles.count("baseline") != 1 or not all(
            c["samples_us"] and all(stats.valid_sample(x) for x in c["samples_us"])
            for c in case["candidates"]
            if c["status"] == "ok"
        ):
            sink.add(
                "decode.samples_invalid",
                rel,
                where,
                "one baseline; finite positive samples for every ok candidate",
                roles,
                "the case's raw samples cannot back a decision",
            )
            continue
        rec = case_claims(case)
        for key, value in rec.items():
            if not same(case["claims"].get(key), value, *tol):
                sink.add(
                    "decode.claim_mismatch",
                    rel,
                    f"{where}.claims.{key}",
                    value,
                    case["claims"].get(key),
                    f"{case['op']} {case['dtype']}: the claim differs from its recomputation",
                )
    for i, model in enumerate(doc["models"]):
        where = f"models[{i}]"
        bad = [
            v["name"]
            for v in model["variants"]
            if not all(stats.valid_sample(x) for x in v["step_s"])
        ]
        names = [v["name"] for v in model["variants"]]
        if bad or STOCK not in names or len(set(names)) != len(names):
            sink.add(
                "decode.samples_invalid",
                rel,
                where,
                "a unique stock variant and finite positive step times",
                bad or names,
                "the model's raw figures cannot back its claims",
            )
            continue
        claims, meets = model_claims(model)
        claimed = model["claims"]
        if set(claimed) != set(claims):
            sink.add(
                "decode.claim_mismatch",
                rel,
                f"{where}.claims",
                sorted(claims),
                sorted(claimed),
                "claimed variants differ from the measured ones",
            )
        for name, figs in claims.items():
            for key, value in figs.items():
                found = claimed.get(name, {}).get(key)
                if not same(found, value, *tol):
                    sink.add(
                        "decode.claim_mismatch",
                        rel,
                        f"{where}.claims.{name}.{key}",
                        value,
                        found,
                        f"{model['name']}: the claim differs from its recomputation",
                    )
        if model["meets_target"] is not meets:
            sink.add(
                "decode.target_mismatch",
                rel,
                f"{where}.meets_target",
                meets,
                model["meets_target"],
                "the target verdict differs from the recomputed figures",
            )
