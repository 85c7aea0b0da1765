"""How well the resource proxy predicts real compile failures, from an audited compile survey.

Prints the figures of a compile-survey bundle (default: evidence/h200-compile-survey) after
auditing it; with ``--from`` it first (re)builds the bundle from the ``survey.json`` that
benchmarks/gpu_survey.py wrote on the GPU host:

    python benchmarks/proxy_accuracy.py [--bundle evidence/h200-compile-survey] [--json]
    python benchmarks/proxy_accuracy.py --from .dev/gpu_results/survey.json \\
        --out evidence/h200-compile-survey [--replace]

Exit status: 0 when the audit is clean and the proxy meets the claim (at least 95% of the
failing configs rejected, none that compiled), 1 otherwise, 2 on bad usage.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path
from typing import Any

from mxdb.audit import audit_paths
from mxdb.evidence.survey import SURVEY_FILE, build_survey, write_survey_bundle

DEFAULT_BUNDLE = Path("evidence/h200-compile-survey")


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def render(doc: dict[str, Any]) -> str:
    c = doc["claims"]
    fp = doc["fingerprint"]
    lines = [
        f"{doc['what']}",
        f"device {fp['device_name']} ({fp['arch']}), triton {fp['triton']}, "
        f"flag_gems {fp['flag_gems']}, torch {fp['torch']}, driver {fp['driver']}",
        f"grid: {c['grid_configs']} configs ({doc['grid']['name']}), "
        f"{c['distinct_compiles']} distinct compilations",
        "status:  "
        + ", ".join(f"{k} {v}" for k, v in c["by_status"].items())
        + "  (distinct: "
        + ", ".join(f"{k} {v}" for k, v in c["distinct_by_status"].items())
        + ")",
        f"failing: {c['failures']} of {c['grid_configs']}",
    ]
    for kind, k in c["by_failure_kind"].items():
        lines.append(
            f"  {kind:<14} {k['configs']:>5} configs, proxy rejects {k['proxy_rejected']:>5} "
            f"({_pct(k['proxy_rejected_fraction'])})"
        )
    rr = c["resource_rules_only"]
    lines += [
        f"proxy rejects {c['proxy_rejected_failures']} of {c['failures']} failing configs "
        f"({_pct(c['proxy_rejected_failures_fraction'])}); threshold {_pct(c['threshold'])}",
        f"  resource (oor) failures: {_pct(c['resource_failures']['proxy_rejected_fraction'])}; "
        f"resource rules alone, all failures: {rr['proxy_rejected']} of {rr['configs']} "
        f"({_pct(rr['proxy_rejected_fraction'])})",
        f"proxy rejects {c['proxy_rejected_ok']} configs that compiled (false rejections)",
        f"meets the claim: {c['meets_threshold']}",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--bundle", type=Path, default=None, help="survey bundle to report")
    parser.add_argument("--from", dest="source", type=Path, help="gpu_survey.py survey.json")
    parser.add_argument("--out", type=Path, default=None, help="bundle to write (with --from)")
    parser.add_argument("--replace", action="store_true", help="replace an existing --out")
    parser.add_argument("--json", action="store_true", help="print the claims as JSON")
    args = parser.parse_args(argv)

    bundle = args.bundle or args.out or DEFAULT_BUNDLE
    if args.source is not None:
        out = args.out or DEFAULT_BUNDLE
        if out.exists() and any(out.iterdir()):
            if not args.replace:
                print(f"{out} exists; pass --replace to rebuild it", file=sys.stderr)
                return 2
            shutil.rmtree(out)
        survey = build_survey(json.loads(args.source.read_text()))
        write_survey_bundle(out, survey)
        print(f"wrote {out}", file=sys.stderr)
        bundle = out
    if not (bundle / SURVEY_FILE).is_file():
        print(f"{bundle} holds no {SURVEY_FILE}; build it with --from", file=sys.stderr)
        return 2
    result = audit_paths([bundle])
    doc = json.loads((bundle / SURVEY_FILE).read_text())
    if args.json:
        print(json.dumps({"claims": doc["claims"], "audit_ok": result.ok}, indent=2))
    else:
        print(render(doc))
        print(f"audit: {'clean' if result.ok else f'{len(result.findings)} findings'}")
    for f in result.findings:
        print(f.line(), file=sys.stderr)
    return 0 if result.ok and doc["claims"]["meets_threshold"] else 1


if __name__ == "__main__":
    sys.exit(main())
