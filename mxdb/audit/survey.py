"""The compile survey (``survey.json``, ``mxdb.compile-survey``) declared for the claims engine.

The preflight re-runs the resource proxy (``mxdb.resources.estimate``, CPU only) over the grid
under the recorded device profile and Triton release and checks: the fingerprint hash and the
profile agree with the fingerprint, every compile record is self-consistent, the grid is the
declared one and complete (each config once, naming a compilation with its key and status), the
GROUP_SIZE_M controls back the grid's expansion, the recorded verdicts are the proxy's, no
config that compiled is rejected and at least ``PROXY_THRESHOLD`` of the failures are.  The
claims are recomputed from the grid's rows with :func:`mxdb.evidence.survey.survey_figures`.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from mxdb.audit.claims import ClaimKind, Context, Path_
from mxdb.audit.findings import FindingSink
from mxdb.errors import MxdbError
from mxdb.evidence.survey import (
    COMPILE_KEY,
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


class _Limited:
    """Findings with detail for the first few rows of each check and a count for the rest;
    with no sink, only the grid walk (to recompute the figures)."""

    def __init__(self, sink: FindingSink | None, file: str) -> None:
        self.sink = sink
        self.file = file
        self.counts: dict[str, int] = {}

    def add(self, check: str, field: str, expected: Any, found: Any, msg: str) -> None:
        n = self.counts.get(check, 0) + 1
        self.counts[check] = n
        if self.sink is not None and n <= MAX_ROW_FINDINGS:
            self.sink.add(check, self.file, field, expected, found, msg)

    def flush(self) -> None:
        for check, n in self.counts.items():
            if self.sink is not None and n > MAX_ROW_FINDINGS:
                self.sink.add(
                    check,
                    self.file,
                    "rows",
                    "no further rows",
                    f"{n - MAX_ROW_FINDINGS} more",
                    f"{n} rows in all fail this check",
                )


def _code(path: Path_) -> str:
    return "count_mismatch" if path[1:2] and path[1] in _COUNT_FIELDS else "claim_mismatch"


def _preflight(sink: FindingSink, rel: str, doc: Mapping[str, Any], ctx: Context) -> bool:
    lim = _Limited(sink, rel)
    rows = _grid_rows(lim, doc)
    if rows is not None:
        figures = survey_figures(rows, doc["compiles"])
        frac = figures["proxy_rejected_failures_fraction"]
        if frac is not None and frac < PROXY_THRESHOLD:
            lim.add(
                "survey.below_threshold",
                "claims.proxy_rejected_failures_fraction",
                f">= {PROXY_THRESHOLD}",
                frac,
                f"the proxy rejects {figures['proxy_rejected_failures']} of "
                f"{figures['failures']} failing configs",
            )
    lim.flush()
    return rows is not None


def _figures(doc: Mapping[str, Any], _: Context) -> Mapping[str, Any]:
    return {"claims": survey_figures(_grid_rows(_Limited(None, ""), doc) or [], doc["compiles"])}


def _grid_rows(lim: _Limited, doc: Mapping[str, Any]) -> list[dict[str, Any]] | None:
    """Check the survey; its grid rows (each config once) with the statuses of their
    compilations and fresh proxy verdicts, or None if the proxy cannot be re-run."""
    fp = doc["fingerprint"]
    fp_hash = Fingerprint(**fp).hash
    if fp_hash != doc["fingerprint_hash"]:
        lim.add(
            "survey.fingerprint_mismatch",
            "fingerprint_hash",
            fp_hash,
            doc["fingerprint_hash"],
            "fingerprint hash is not the hash of its components",
        )
    try:
        profile = DeviceProfile(**doc["profile"])
        shape = MoEShape.from_dict(doc["shape"])
    except (ValidationError, MxdbError, TypeError, ValueError) as exc:
        lim.add(
            "survey.profile_invalid",
            "profile",
            "a device profile and a shape",
            str(exc)[:120],
            "cannot re-run the proxy",
        )
        return None
    for name in _PROFILE_FACTS:
        if fp.get(name) is not None and fp[name] != getattr(profile, name):
            lim.add(
                "survey.profile_mismatch",
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
        lim.add(
            "survey.shape_mismatch",
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
        lim.add(
            "survey.grid_mismatch",
            "grid.axes",
            {k: list(v) for k, v in VLLM_GRID.items()},
            axes,
            "the axes are not vLLM's grid",
        )
    if list(grid["compile_key"]) != list(COMPILE_KEY):
        lim.add(
            "survey.grid_mismatch",
            "grid.compile_key",
            list(COMPILE_KEY),
            grid["compile_key"],
            "the grid shares compilations by another key",
        )
    expected = {
        tuple(v): dict(zip(axes, v, strict=True)) for v in itertools.product(*axes.values())
    }
    size = len(expected)
    if grid["size"] != size:
        lim.add(
            "survey.grid_mismatch",
            "grid.size",
            size,
            grid["size"],
            "the declared grid size is not the product of its axes",
        )
    seen: dict[tuple[int, ...], int] = {}
    used: set[int] = set()
    triton = fp.get("triton")
    verdicts: dict[tuple[int, ...], dict[str, Any]] = {}
    fixed: list[dict[str, Any]] = []
    for i, row in enumerate(doc["rows"]):
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
        want = index.get(ck)
        # the figures take the status from the compilation and the verdict afresh
        fixed.append({**row, "status": compiles[want]["status"]} if want is not None else {**row})
        ci = row["compile"]
        if ci >= len(compiles) or key_of(compiles[ci]) != ck:
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
        fixed[-1].update(v)
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
        lim.add(
            "survey.grid_incomplete",
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
    return fixed


def _check_record(lim: _Limited, i: int, c: Mapping[str, Any]) -> None:
    where = f"compiles[{i}]"
    status = c["status"]
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


KIND = ClaimKind(
    name="survey",
    document="survey.json",
    schema="mxdb.compile-survey",
    codes=_code,
    figures=_figures,
    preflight=_preflight,
)
