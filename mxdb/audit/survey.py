"""The audit of a compile survey (``survey.json``, ``mxdb.compile-survey``).

Re-runs the resource proxy (``mxdb.resources.estimate``, CPU only) over every grid config under
the recorded device profile and Triton release, and checks: the fingerprint and profile agree,
every compile record is self-consistent, the grid is the declared one and complete (each config
once, each naming a compilation with its key and status), the GROUP_SIZE_M controls back the
grid's expansion, the proxy's recorded verdicts are its verdicts, no config that compiled is
rejected, at least ``PROXY_THRESHOLD`` of the failures are rejected, and every claimed figure is
the one recomputed from the raw rows.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from mxdb.audit.compare import Tol, same
from mxdb.audit.findings import FindingSink
from mxdb.errors import MxdbError
from mxdb.evidence.survey import (
    COMPILE_KEY,
    COMPILE_STATUSES,
    PROXY_THRESHOLD,
    key_of,
    proxy_verdict,
    survey_figures,
)
from mxdb.models import Fingerprint
from mxdb.profiles import DeviceProfile
from mxdb.resources import VLLM_GRID
from mxdb.shapes import MoEShape

#: At most this many per-row findings of one check; the rest are counted in one more finding.
MAX_ROW_FINDINGS = 20
#: Fingerprint components the device profile must agree with.
_PROFILE_FACTS = ("device_name", "arch", "sm_count", "smem_per_block", "warp_size")
#: Claim fields that count rows (``survey.count_mismatch``); the rest are proxy figures.
_COUNT_FIELDS = ("grid_configs", "distinct_compiles", "by_status", "distinct_by_status", "failures")


def _leaves(prefix: str, x: Any) -> dict[str, Any]:
    if isinstance(x, dict):
        out: dict[str, Any] = {}
        for k, v in x.items():
            out.update(_leaves(f"{prefix}.{k}", v))
        return out
    return {prefix: x}


class _Limited:
    """Per-check finding counter: detail for the first few rows, a count for the rest."""

    def __init__(self, sink: FindingSink, file: str) -> None:
        self.sink = sink
        self.file = file
        self.counts: dict[str, int] = {}

    def add(self, check: str, field: str, expected: Any, found: Any, msg: str) -> None:
        n = self.counts.get(check, 0) + 1
        self.counts[check] = n
        if n <= MAX_ROW_FINDINGS:
            self.sink.add(check, self.file, field, expected, found, msg)

    def flush(self) -> None:
        for check, n in self.counts.items():
            if n > MAX_ROW_FINDINGS:
                self.sink.add(
                    check,
                    self.file,
                    "rows",
                    "no further rows",
                    f"{n - MAX_ROW_FINDINGS} more",
                    f"{n} rows in all fail this check",
                )


def check_survey(sink: FindingSink, rel: str, doc: Mapping[str, Any], tol: Tol) -> None:
    """Audit one schema-valid ``mxdb.compile-survey`` document; findings go to ``sink.add``."""
    lim = _Limited(sink, rel)
    fp = doc["fingerprint"]
    fp_hash = Fingerprint(**fp).hash
    if fp_hash != doc["fingerprint_hash"]:
        sink.add(
            "survey.fingerprint_mismatch",
            rel,
            "fingerprint_hash",
            fp_hash,
            doc["fingerprint_hash"],
            "fingerprint hash is not the hash of its components",
        )
    elif sink.fp_hash is not None and sink.fp_hash != fp_hash:
        sink.add(
            "survey.fingerprint_mismatch",
            rel,
            "fingerprint_hash",
            sink.fp_hash,
            fp_hash,
            "the survey's environment is not the bundle's fingerprint.json",
        )
    try:
        profile = DeviceProfile(**doc["profile"])
        shape = MoEShape.from_dict(doc["shape"])
    except (ValidationError, MxdbError, TypeError, ValueError) as exc:
        sink.add(
            "survey.profile_invalid",
            rel,
            "profile",
            "a device profile and a shape",
            str(exc)[:120],
            "cannot re-run the proxy",
        )
        return
    for name in _PROFILE_FACTS:
        if fp.get(name) is not None and fp[name] != getattr(profile, name):
            sink.add(
                "survey.profile_mismatch",
                rel,
                f"profile.{name}",
                fp[name],
                getattr(profile, name),
                "the proxy's device profile contradicts the measured environment",
            )
    n_dim, k_dim = (
        (2 * shape.intermediate, shape.hidden)
        if doc["gemm_index"] == 1
        else (shape.hidden, shape.intermediate)
    )
    if (doc["gemm_n"], doc["gemm_k"]) != (n_dim, k_dim):
        sink.add(
            "survey.shape_mismatch",
            rel,
            "gemm_n",
            f"N={n_dim}, K={k_dim}",
            f"N={doc['gemm_n']}, K={doc['gemm_k']}",
            f"the GEMM is not GEMM{doc['gemm_index']} of the shape",
        )

    compiles: list[dict[str, Any]] = doc["compiles"]
    index: dict[tuple[int, ...], int] = {}
    for i, c in enumerate(compiles):
        _check_record(lim, i, c)
        k = key_of(c)
        if k in index:
            lim.add(
                "survey.duplicate_compile",
                f"compiles[{i}]",
                "each compile key once",
                f"{k} (also compiles[{index[k]}])",
                "a compilation is recorded twice",
            )
        else:
            index[k] = i

    grid = doc["grid"]
    axes: dict[str, list[int]] = grid["axes"]
    if grid["name"] == "vllm" and axes != {k: list(v) for k, v in VLLM_GRID.items()}:
        sink.add(
            "survey.grid_mismatch",
            rel,
            "grid.axes",
            {k: list(v) for k, v in VLLM_GRID.items()},
            axes,
            "the axes are not vLLM's grid",
        )
    if list(grid["compile_key"]) != list(COMPILE_KEY):
        sink.add(
            "survey.grid_mismatch",
            rel,
            "grid.compile_key",
            list(COMPILE_KEY),
            grid["compile_key"],
            "the grid shares compilations by another key",
        )
    expected = {
        tuple(v): dict(zip(axes, v, strict=True)) for v in itertools.product(*axes.values())
    }
    size = len(expected)
    rows: list[dict[str, Any]] = doc["rows"]
    if grid["size"] != size:
        sink.add(
            "survey.grid_mismatch",
            rel,
            "grid.size",
            size,
            grid["size"],
            "the declared grid size is not the product of its axes",
        )
    seen: dict[tuple[int, ...], int] = {}
    used: set[int] = set()
    triton = fp.get("triton")
    verdicts: dict[tuple[int, ...], dict[str, Any]] = {}
    for i, row in enumerate(rows):
        where = f"rows[{i}]"
        cfg = row["config"]
        if set(cfg) != set(axes):
            lim.add(
                "survey.grid_extra",
                f"{where}.config",
                sorted(axes),
                sorted(cfg),
                "config fields are not the grid's axes",
            )
            continue
        vkey = tuple(int(cfg[a]) for a in axes)
        if vkey not in expected:
            lim.add(
                "survey.grid_extra",
                f"{where}.config",
                "a config of the grid",
                cfg,
                "config is not in the grid",
            )
            continue
        if vkey in seen:
            lim.add(
                "survey.duplicate_config",
                f"{where}.config",
                "each grid config once",
                f"{cfg} (also rows[{seen[vkey]}])",
                "a grid config is listed twice",
            )
            continue
        seen[vkey] = i
        ck = key_of(cfg)
        ci = row["compile"]
        if ci >= len(compiles) or key_of(compiles[ci]) != ck:
            want = index.get(ck)
            lim.add(
                "survey.row_compile_mismatch",
                f"{where}.compile",
                want if want is not None else f"a compilation of {ck}",
                ci,
                "row names a compilation of another config",
            )
            if want is None:
                continue
            ci = want
        used.add(ci)
        if row["status"] != compiles[ci]["status"]:
            lim.add(
                "survey.status_mismatch",
                f"{where}.status",
                compiles[ci]["status"],
                row["status"],
                f"row status is not its compilation's (compiles[{ci}])",
            )
        if ck not in verdicts:
            verdicts[ck] = proxy_verdict(
                {**cfg}, shape=shape, profile=profile, gemm_index=doc["gemm_index"], triton=triton
            )
        v = verdicts[ck]
        for name in ("proxy_rejects", "proxy_reasons", "known_failure"):
            if row[name] != v[name]:
                lim.add(
                    "survey.proxy_mismatch",
                    f"{where}.{name}",
                    v[name],
                    row[name],
                    "recorded proxy verdict differs from mxdb.resources on this profile",
                )
        if v["proxy_rejects"] and compiles[ci]["status"] == "ok":
            lim.add(
                "survey.false_rejection",
                f"{where}.config",
                "the proxy accepts a config that compiled",
                "; ".join(v["proxy_reasons"]),
                "the proxy rejects a config that compiled on the device",
            )
    missing = [cfg for k, cfg in expected.items() if k not in seen]
    if missing:
        sink.add(
            "survey.grid_incomplete",
            rel,
            "rows",
            f"{size} grid configs",
            f"{len(seen)}; missing e.g. {missing[:3]}",
            f"{len(missing)} grid configs have no row",
        )
    for i in range(len(compiles)):
        if i not in used:
            lim.add(
                "survey.compile_unused",
                f"compiles[{i}]",
                "a compilation some grid row shares",
                key_of(compiles[i]),
                "a compilation no grid config uses",
            )
    _check_controls(lim, doc["group_m_control"], compiles, index)
    lim.flush()

    # the figures from the raw rows, with statuses from the compilations and fresh verdicts
    fixed = []
    for i in seen.values():
        row = rows[i]
        ci = index.get(key_of(row["config"]))
        status = compiles[ci]["status"] if ci is not None else row["status"]
        fixed.append({**row, "status": status, **verdicts.get(key_of(row["config"]), {})})
    figures = survey_figures(fixed, compiles)
    claims = doc["claims"]
    want_leaves = _leaves("claims", figures)
    got_leaves = _leaves("claims", claims)
    for field in sorted(set(want_leaves) | set(got_leaves)):
        want, got = want_leaves.get(field), got_leaves.get(field)
        if field not in got_leaves or field not in want_leaves or not same(want, got, *tol):
            top = field.split(".")[1]
            check = "survey.count_mismatch" if top in _COUNT_FIELDS else "survey.claim_mismatch"
            sink.add(check, rel, field, want, got, "claimed figure differs from the raw rows")
    frac = figures["proxy_rejected_failures_fraction"]
    if frac is not None and frac < PROXY_THRESHOLD:
        sink.add(
            "survey.below_threshold",
            rel,
            "claims.proxy_rejected_failures_fraction",
            f">= {PROXY_THRESHOLD}",
            frac,
            f"the proxy rejects {figures['proxy_rejected_failures']} of "
            f"{figures['failures']} failing configs",
        )


def _check_record(lim: _Limited, i: int, c: Mapping[str, Any]) -> None:
    where = f"compiles[{i}]"
    status = c["status"]
    if status not in COMPILE_STATUSES:  # the schema forbids it; kept for direct callers
        lim.add("survey.record_invalid", f"{where}.status", COMPILE_STATUSES, status, "bad status")
        return
    if status == "ok":
        if c["error"] is not None or c["smem_bytes"] is None or c["n_regs"] is None:
            lim.add(
                "survey.record_invalid",
                where,
                "ok: no error; shared memory and registers recorded",
                {k: c[k] for k in ("error", "smem_bytes", "n_regs")},
                "a compiled config without its resources, or with an error",
            )
        return
    if not c["error"]:
        lim.add(
            "survey.record_invalid",
            f"{where}.error",
            "the compiler's error text",
            c["error"],
            "a failure without its error",
        )
    if status == "oor":
        req, limit = c["smem_required"], c["smem_limit"]
        if req is None or limit is None or req <= limit:
            lim.add(
                "survey.record_invalid",
                where,
                "out of resources: required > limit",
                f"required {req}, limit {limit}",
                "an out-of-resources record that does not exceed its limit",
            )


def _check_controls(
    lim: _Limited,
    controls: list[dict[str, Any]],
    compiles: list[dict[str, Any]],
    index: dict[tuple[int, ...], int],
) -> None:
    for j, ctl in enumerate(controls):
        where = f"group_m_control[{j}]"
        i = index.get(key_of(ctl))
        if i is None:
            lim.add(
                "survey.group_control_mismatch",
                where,
                "a control of a recorded compilation",
                key_of(ctl),
                "control of a compilation the survey lacks",
            )
            continue
        base = compiles[i]
        fields = ("status", "smem_bytes", "n_regs", "n_spills")
        same = all(base[f] == ctl[f] for f in fields)
        if same is not ctl["same_as_group1"]:
            lim.add(
                "survey.group_control_mismatch",
                f"{where}.same_as_group1",
                same,
                ctl["same_as_group1"],
                f"the flag is not the comparison with compiles[{i}]",
            )
        if not same:
            lim.add(
                "survey.group_m_differs",
                where,
                {f: base[f] for f in fields},
                {f: ctl[f] for f in fields},
                f"GROUP_SIZE_M {ctl['group_m']} compiles differently: the grid's expansion "
                "does not hold",
            )
