"""Milestone reports: the summary as Markdown, JSON and PNG plots.

``build_report`` is a pure function of a summary document, so the auditor recomputes a
bundle's ``report/report.json`` from the runs and compares every figure.  Plots need
matplotlib (the ``plot`` extra), imported only when plots are drawn, with the Agg backend.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mxdb.errors import EvidenceError, NotFoundError
from mxdb.evidence.cells import cell
from mxdb.evidence.files import atomic_write, dumps
from mxdb.evidence.models import SCHEMA_VERSION
from mxdb.evidence.summary import build_summary
from mxdb.fileio import load_json


def build_report(summary: Mapping[str, Any]) -> dict[str, Any]:
    """The ``mxdb.report`` document of a summary: one row per shape and routing class."""
    rows = []
    for g in summary["groups"]:
        sp, nb = g["speedup"], g["noise_band"]
        rows.append(
            {
                "key": g["key"],
                "family": g["family"],
                "dtype": g["dtype"],
                "tokens": g["tokens"],
                "routing_class": g["routing_class"],
                "baseline_median_us": g["baseline_median_us"],
                "best_median_us": g["best_median_us"],
                "speedup": sp,
                "noise_band": nb,
                "speedup_low": sp / (1.0 + nb) if sp is not None and nb is not None else None,
                "verified": g["verified"],
                "floor_fraction": g["floor_fraction"],
                "failures": list(g["failures"]),
            }
        )
    return {
        "schema": "mxdb.report",
        "schema_version": SCHEMA_VERSION,
        "milestone": summary["milestone"],
        "fingerprint_hash": summary["fingerprint_hash"],
        "rows": rows,
        "geomean_speedup": summary["geomean_speedup"],
        "geomean_verified_speedup": summary["geomean_verified_speedup"],
        "failures": [dict(f) for f in summary["failures"]],
        "counts": json.loads(json.dumps(summary["counts"])),
    }


def render_markdown(report: Mapping[str, Any], *, failure_ids: bool = False) -> str:
    """The report as Markdown: a table per shape, every failure listed.

    ``failure_ids``: each row's failures as run ids, the form reports had before they
    showed counts by status (the audit accepts either rendering of report.json).
    """
    out = [f"# Milestone {report['milestone']}", ""]
    out.append(f"Environment fingerprint `{report['fingerprint_hash']}`.")
    c = report["counts"]
    out.append(
        f"{c['runs']} runs in {c['groups']} comparison groups; {c['verified_groups']} verified; "
        f"{c['control_pairs']} control pairs (A vs A, never counted in a speedup)."
    )
    out.append(
        f"Geometric mean speedup: {cell(report['geomean_speedup'], '.4f')} (all groups with a "
        f"speedup), {cell(report['geomean_verified_speedup'], '.4f')} (verified groups)."
    )
    out.append("")
    out.append(
        "Speedup = median(baseline) / median(best correct candidate); noise band = largest "
        "max/min - 1 of the group's control pairs; verified when speedup - 1 > noise band."
    )
    status_of = {f["run_id"]: f["status"] for f in report["failures"]}

    def failures(row: Mapping[str, Any]) -> str:
        if failure_ids:
            return ", ".join(row["failures"]) or "-"
        return _failure_counts(row["failures"], status_of)

    by_shape: dict[str, list[Mapping[str, Any]]] = defaultdict(list)
    for r in report["rows"]:
        by_shape[f"{r['family']} {r['dtype']}"].append(r)
    for shape, rows in sorted(by_shape.items()):
        out += ["", f"## {shape}", ""]
        out.append(
            "| M | routing | baseline us | best us | speedup | noise band | verified "
            "| floor fraction | failures |"
        )
        out.append("|---:|---|---:|---:|---:|---:|---|---:|---|")
        for r in sorted(rows, key=lambda r: (r["tokens"], r["routing_class"])):
            out.append(
                f"| {r['tokens']} | {r['routing_class']} | {cell(r['baseline_median_us'], '.3f')} "
                f"| {cell(r['best_median_us'], '.3f')} | {cell(r['speedup'], '.4f')} "
                f"| {cell(r['noise_band'], '.4f')} | {'yes' if r['verified'] else 'no'} "
                f"| {cell(r['floor_fraction'], '.3f')} | {failures(r)} |"
            )
    out += ["", "## Failures", ""]
    if not report["failures"]:
        out.append("None.")
    for f in report["failures"]:
        out.append(f"- `{f['run_id']}`: {f['status']}" + (f" ({f['error']})" if f["error"] else ""))
    return "\n".join(out) + "\n"


def _failure_counts(run_ids: list[str], status_of: Mapping[str, str]) -> str:
    """A row's failures as counts by status (each one is listed under Failures)."""
    counts: dict[str, int] = defaultdict(int)
    for run_id in run_ids:
        counts[status_of.get(run_id, "failed")] += 1
    return ", ".join(f"{status} {n}" for status, n in sorted(counts.items())) or "-"


def _matplotlib() -> Any:
    """matplotlib with the Agg backend, or an error that says what is wrong and what to do."""
    import importlib.util

    try:
        spec = importlib.util.find_spec("matplotlib")
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        raise EvidenceError(
            "the plots of mxdb report are drawn with matplotlib, which is not installed here; "
            "install it (pip install 'mxdb[plot]'), or pass --no-plots to write report.md and "
            "report.json only; nothing was written"
        )
    try:
        import matplotlib
    except Exception as exc:  # installed but broken: say so rather than "not installed"
        raise EvidenceError(
            f"matplotlib is installed but cannot be imported ({type(exc).__name__}: {exc}); "
            "repair it (pip install --force-reinstall matplotlib), or pass --no-plots; "
            "nothing was written"
        ) from None
    matplotlib.use("Agg")
    return matplotlib


def _plot(report: Mapping[str, Any], out_dir: Path) -> list[Path]:
    import matplotlib.pyplot as plt

    written = []
    for field, ylabel, name in (
        ("speedup", "speedup over baseline", "speedup_vs_m.png"),
        ("floor_fraction", "fraction of memory-bound floor", "floor_fraction_vs_m.png"),
    ):
        series: dict[str, list[tuple[int, float, float]]] = defaultdict(list)
        for r in report["rows"]:
            if r[field] is not None:
                err = (r["noise_band"] or 0.0) * r[field] if field == "speedup" else 0.0
                label = f"{r['family']} {r['dtype']} {r['routing_class']}"
                series[label].append((r["tokens"], r[field], err))
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for label, pts in sorted(series.items()):
            pts.sort()
            ax.errorbar(
                [p[0] for p in pts],
                [p[1] for p in pts],
                yerr=[p[2] for p in pts],
                marker="o",
                capsize=3,
                label=label,
            )
        if field == "speedup":
            ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens M")
        ax.set_ylabel(ylabel)
        ax.set_title(f"{report['milestone']}: {ylabel}")
        if series:
            ax.legend(fontsize=7)
        path = out_dir / name
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def write_report(bundle: Path, out_dir: Path, *, plots: bool = True) -> list[Path]:
    """Recompute a bundle's summary from its runs and write report.md, report.json and plots."""
    bundle = Path(bundle)
    summary_path = bundle / "summary.json"
    if not summary_path.is_file():
        raise NotFoundError(
            f"no summary.json in {bundle}; give the directory of a finished evidence bundle"
        )
    if plots:
        _matplotlib()  # before anything is written
    claimed = load_json(summary_path, what="summary", error=EvidenceError)
    if not isinstance(claimed, dict):
        raise EvidenceError(f"{summary_path} is not a JSON object")
    try:
        summary = build_summary(bundle, bandwidth_bytes_per_s=claimed.get("bandwidth_bytes_per_s"))
        rep = build_report(summary)
    except (KeyError, TypeError, ValueError, IndexError, AttributeError, ZeroDivisionError) as exc:
        raise EvidenceError(
            f"the bundle {bundle} is malformed ({type(exc).__name__}: {exc}); "
            f"run `mxdb audit {bundle}` for the details"
        ) from None
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write(out_dir / "report.json", dumps(rep))
    atomic_write(out_dir / "report.md", render_markdown(rep).encode())
    written = [out_dir / "report.md", out_dir / "report.json"]
    if plots:
        written += _plot(rep, out_dir)
    return written
