"""The audit: every claim of an evidence bundle re-hashed and recomputed from raw samples.

Per bundle, in order: signatures (first, when trusted keys are given; a failure stops the
bundle there), the manifest (schema, digest, safe paths, each file's SHA-256 in both
directions, links never followed), each document's schema and version (``jsonschema``, no
pydantic), then the semantics: fingerprints, traces, runs (figures from samples,
correctness against the thresholds, config hashes), the summary and the report (recomputed
with ``mxdb.evidence.summary.summarize`` and compared within the stated tolerance), and the
store export (every verified config present with the same hash).
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from mxdb.audit import decode
from mxdb.audit.claims import Context, audit_claim, check_rendering
from mxdb.audit.compare import Tol, same
from mxdb.audit.fastschema import compile_schema
from mxdb.audit.findings import AuditOptions, AuditResult, BundleResult, Finding
from mxdb.audit.kinds import KINDS
from mxdb.audit.store_export import (
    check_shipped_export,
    check_store_export,
    decisions,
    resolve_deferred,
    shipped_exports,
)
from mxdb.configs import config_hash
from mxdb.errors import ConfigError, InvalidInputError, UsageError
from mxdb.evidence import stats
from mxdb.evidence.files import (
    MANIFEST_NAME,
    SIGNATURES_DIR,
    is_manifested,
    manifest_digest,
    scan_tree,
    trace_hash,
    unsafe_reason,
)
from mxdb.evidence.models import KNOWN_VERSIONS
from mxdb.evidence.summary import group_key, run_passes, summarize
from mxdb.evidence.thresholds import THRESHOLDS
from mxdb.fileio import MAX_DOCUMENT_BYTES, parse_json
from mxdb.hashing import canonical_hash
from mxdb.models import FINGERPRINT_COMPONENTS

_NAN = float("nan")


def _parse_constant(name: str) -> float:
    # NaN/Infinity are not JSON; read them as floats so the semantic checks name the field
    return {"NaN": _NAN, "Infinity": math.inf, "-Infinity": -math.inf}[name]


def _fmt(x: Any) -> str:
    if isinstance(x, float):
        return repr(x)
    if isinstance(x, str):
        return x
    return json.dumps(x, sort_keys=True, default=str)[:200]


def fingerprint_hash(fp: Mapping[str, Any]) -> str:
    """``mxdb.models.Fingerprint.hash`` of a fingerprint dict, without pydantic."""
    return canonical_hash({k: fp.get(k) for k in FINGERPRINT_COMPONENTS})


#: leaf field -> check suffix, for summary and report comparisons
_FIELD_CODES: dict[str, str] = {
    "speedup": "speedup_mismatch",
    "speedup_low": "speedup_mismatch",
    "noise_band": "noise_band_mismatch",
    "baseline_median_us": "median_mismatch",
    "best_median_us": "median_mismatch",
    "geomean_speedup": "geomean_mismatch",
    "geomean_verified_speedup": "geomean_mismatch",
    "verified": "verified_mismatch",
    "best_run": "best_mismatch",
    "best_config_hash": "best_mismatch",
    "failures": "failures_mismatch",
    "floor_us": "floor_mismatch",
    "floor_fraction": "floor_mismatch",
}


class _BundleAudit:
    """The audit of one bundle directory; collects findings."""

    def __init__(self, root: Path, label: str, options: AuditOptions) -> None:
        self.root = root
        self.label = label
        self.opt = options
        self.tol: Tol = (options.rel_tol, options.abs_tol)
        self.findings: list[Finding] = []
        self.bundle_id: str | None = None
        self.milestone: str | None = None
        self.fp_hash: str | None = None
        self.fp_components: dict[str, Any] | None = None
        self.n_runs = 0
        self.backed: list[dict[str, Any]] = []
        self.deferred: list[tuple[str, str, dict[str, Any]]] = []
        self.backing: list[dict[str, Any]] = []
        self.decode: list[dict[str, Any]] = []

    def add(self, check: str, file: str, field: str, expected: Any, found: Any, msg: str) -> None:
        self.findings.append(
            Finding(check, f"{self.label}/{file}", field, _fmt(expected), _fmt(found), msg)
        )

    # -- documents ---------------------------------------------------------------------

    def parse(self, rel: str, data: bytes, expect: str | None) -> dict[str, Any] | None:
        """JSON, document type, version and schema of one file; ``None`` if unusable.  With
        ``expect`` None (a document without a JSON Schema) only a JSON object is required."""
        from mxdb.schemas import DOCUMENT_NAMES, validator

        try:
            doc = parse_json(data, what=rel, parse_constant=_parse_constant)
        except InvalidInputError as exc:
            text = str(exc).removeprefix(f"{rel}: ").removeprefix(f"{rel} ")
            # a document without a schema has always reported any unreadable JSON as json.invalid
            if "duplicate key" in text and expect is not None:
                self.add(
                    "json.duplicate_key",
                    rel,
                    "",
                    "each key once per object",
                    text[:160],
                    "a duplicate key: readers disagree on which value counts",
                )
            else:
                self.add("json.invalid", rel, "", "a JSON document", text[:160], "not valid JSON")
            return None
        if not isinstance(doc, dict):
            self.add(
                "json.invalid", rel, "", "a JSON object", type(doc).__name__, "not a JSON object"
            )
            return None
        if expect is None:
            return doc
        name = doc.get("schema")
        if name != expect:
            self.add(
                "schema.wrong_document",
                rel,
                "schema",
                expect,
                name,
                "file declares another document type",
            )
            return None
        version = doc.get("schema_version")
        if version not in KNOWN_VERSIONS.get(expect, ()):
            self.add(
                "schema.unknown_version",
                rel,
                "schema_version",
                " or ".join(KNOWN_VERSIONS.get(expect, ())),
                version,
                f"this mxdb does not understand {expect} version {version!r}",
            )
            return None
        name_ = DOCUMENT_NAMES[expect]
        fast = _fast_validator(name_, str(version))
        if fast is not None and fast(doc):
            return doc
        val = validator(name_, str(version))
        if val is not None and not val.is_valid(doc):
            errors = sorted(val.iter_errors(doc), key=lambda e: list(e.absolute_path))
            for err in errors[: self.opt.max_schema_errors]:
                field = ".".join(str(p) for p in err.absolute_path)
                self.add(
                    "schema.invalid",
                    rel,
                    field,
                    f"valid {expect} {version}",
                    _fmt(err.instance)[:80],
                    err.message[:160],
                )
            return None
        return doc

    # -- the bundle --------------------------------------------------------------------

    def run(self) -> None:
        if self.opt.trusted_keys is not None:
            from mxdb.signing import check_signatures, load_trusted_keys

            keys = load_trusted_keys(self.opt.trusted_keys)
            sig = check_signatures(self.root, keys, label=self.label)
            if sig:
                self.findings += sig
                return
        elif (self.root / SIGNATURES_DIR).is_dir():
            from mxdb.signing import check_signatures

            self.findings += check_signatures(self.root, None, label=self.label)

        mpath = self.root / MANIFEST_NAME
        if mpath.is_symlink():
            self.add(
                "bundle.symlink",
                MANIFEST_NAME,
                "",
                "a regular file",
                "a symbolic link",
                "manifest is a symbolic link (not followed)",
            )
            return
        mdata = self.read_file(MANIFEST_NAME, mpath)
        if mdata is None:
            return
        manifest = self.parse(MANIFEST_NAME, mdata, "mxdb.manifest")
        if manifest is None:
            return
        self.bundle_id = manifest["bundle_id"]
        self.milestone = manifest["milestone"]
        listed: dict[str, str] = manifest["files"]
        digest = manifest_digest(listed)
        if digest != manifest["digest"]:
            self.add(
                "manifest.digest_mismatch",
                MANIFEST_NAME,
                "digest",
                digest,
                manifest["digest"],
                "digest is not that of the file list",
            )

        present, links, special = scan_tree(self.root)
        for rel in links:
            self.add(
                "bundle.symlink",
                rel,
                "",
                "a regular file",
                "a symbolic link",
                "symbolic link in the bundle (not followed)",
            )
        for rel in special:
            self.add(
                "bundle.special_file",
                rel,
                "",
                "a regular file",
                "a special file",
                "non-regular file in the bundle",
            )
        contents: dict[str, bytes] = {}
        link_set = set(links)
        for rel, want in listed.items():
            why = unsafe_reason(rel)
            if why is not None or not is_manifested(rel):
                self.add(
                    "manifest.unsafe_path",
                    MANIFEST_NAME,
                    f"files[{rel!r}]",
                    "a relative path inside the bundle",
                    rel,
                    why or "manifest lists itself or a signature",
                )
                continue
            path = present.get(rel)
            if path is None:
                if rel not in link_set:
                    self.add(
                        "manifest.missing_file",
                        rel,
                        "",
                        f"a file with sha256 {want}",
                        "no file",
                        "listed in the manifest but absent",
                    )
                continue
            data = self.read_file(rel, path)
            if data is None:
                continue
            contents[rel] = data
            got = hashlib.sha256(data).hexdigest()
            if got != want:
                self.add(
                    "manifest.changed",
                    rel,
                    "sha256",
                    want,
                    got,
                    "file differs from its manifest hash",
                )
        for rel in sorted(present):
            if rel in listed or rel == MANIFEST_NAME:
                continue
            if rel.startswith(SIGNATURES_DIR + "/") and rel.endswith(".sig"):
                continue
            self.add(
                "manifest.extra_file",
                rel,
                "",
                "only files listed in the manifest",
                "an unlisted file",
                "file is not in the manifest",
            )
            extra = self.read_file(rel, present[rel])
            if extra is not None:
                contents[rel] = extra
        self.check_links_and_names(present)
        self.semantics(contents)

    def read_file(self, rel: str, path: Path) -> bytes | None:
        """A bundle file's bytes, or a finding when it is too large or unreadable."""
        try:
            size = path.stat().st_size
            if size > MAX_DOCUMENT_BYTES:
                self.add(
                    "bundle.file_too_large",
                    rel,
                    "",
                    f"at most {MAX_DOCUMENT_BYTES:,} bytes",
                    f"{size:,} bytes",
                    "file exceeds the audit's size limit (not read)",
                )
                return None
            return path.read_bytes()
        except OSError as exc:
            self.add("bundle.unreadable", rel, "", "a readable file", str(exc), "cannot read")
            return None

    def check_links_and_names(self, present: Mapping[str, Path]) -> None:
        """Hard links to files outside the bundle; names that differ only in letter case."""
        inodes: Counter[tuple[int, int]] = Counter()
        stats: dict[str, os.stat_result] = {}
        for rel, path in present.items():
            try:
                st = path.stat(follow_symlinks=False) if hasattr(path, "stat") else os.lstat(path)
            except OSError:
                continue
            stats[rel] = st
            inodes[(st.st_dev, st.st_ino)] += 1
        for rel in sorted(stats):
            st = stats[rel]
            inside = inodes[(st.st_dev, st.st_ino)]
            if st.st_nlink > inside:
                self.add(
                    "bundle.hardlink",
                    rel,
                    "",
                    "a file of the bundle's own",
                    f"{st.st_nlink} hard links, {st.st_nlink - inside} outside the bundle",
                    "hard link to a file outside the bundle: it can change without the bundle",
                )
        by_case: dict[str, list[str]] = defaultdict(list)
        for rel in present:
            by_case[rel.casefold()].append(rel)
        for names in by_case.values():
            if len(names) > 1:
                names.sort()
                for rel in names[1:]:
                    self.add(
                        "bundle.case_collision",
                        rel,
                        "",
                        "one file per name, whatever the letter case",
                        f"{rel} and {names[0]}",
                        "names differ only in case: on a case-insensitive file system one "
                        "replaces the other, and readers disagree on which one counts",
                    )

    def semantics(self, contents: dict[str, bytes]) -> None:
        fp_doc = None
        if "fingerprint.json" not in contents and any(
            k.startswith("runs/") or k == "store_export.json" for k in contents
        ):
            # without it the one-fingerprint checks would have nothing to compare with
            self.add(
                "fingerprint.missing",
                "fingerprint.json",
                "",
                "the bundle's environment fingerprint",
                "no file",
                "a bundle with runs or a store export must record its fingerprint",
            )
        if "fingerprint.json" in contents:
            fp_doc = self.parse(
                "fingerprint.json", contents["fingerprint.json"], "mxdb.fingerprint"
            )
        if fp_doc is not None:
            self.fp_components = fp_doc["fingerprint"]
            self.fp_hash = fingerprint_hash(fp_doc["fingerprint"])
            if self.fp_hash != fp_doc["hash"]:
                self.add(
                    "fingerprint.hash_mismatch",
                    "fingerprint.json",
                    "hash",
                    self.fp_hash,
                    fp_doc["hash"],
                    "fingerprint hash is not the hash of its components",
                )

        traces: dict[str, dict[str, Any]] = {}
        for rel in sorted(r for r in contents if r.startswith("traces/")):
            doc = self.parse(rel, contents[rel], "mxdb.trace")
            if doc is not None and self.check_trace(rel, doc):
                traces[doc["trace_hash"]] = doc

        runs: dict[str, dict[str, Any]] = {}
        run_files: dict[str, str] = {}
        for rel in sorted(r for r in contents if r.startswith("runs/")):
            doc = self.parse(rel, contents[rel], "mxdb.run")
            if doc is None:
                continue
            rid = doc["run_id"]
            if rel != f"runs/{rid}.json":
                self.add(
                    "run.id_mismatch",
                    rel,
                    "run_id",
                    f"runs/{rid}.json",
                    rel,
                    "file name is not the run id",
                )
            if rid in runs:
                self.add(
                    "run.duplicate_id",
                    rel,
                    "run_id",
                    "a unique run id",
                    f"{rid} (also in {run_files[rid]})",
                    "duplicated run id",
                )
                continue
            runs[rid] = doc
            run_files[rid] = rel
            self.check_run(rel, doc, traces)
        self.n_runs = len(runs)
        self.check_groups(runs, run_files)
        self.check_claims(contents, runs, traces)

        summary = None
        if "summary.json" in contents:
            summary = self.parse("summary.json", contents["summary.json"], "mxdb.summary")
        elif runs:
            self.add(
                "summary.missing",
                "summary.json",
                "",
                "a summary of the runs",
                "no file",
                "bundle has runs but no summary",
            )
        if summary is None:
            return
        active = {h: len({x for row in t["ids"] for x in row}) for h, t in traces.items()}
        recomputed = summarize(
            list(runs.values()),
            milestone=summary["milestone"],
            fingerprint_hash=self.fp_hash or summary["fingerprint_hash"],
            bandwidth_bytes_per_s=summary["bandwidth_bytes_per_s"],
            active_experts=active,
        )
        self.check_summary(summary, recomputed, runs)

        if "report/report.json" in contents:
            from mxdb.report import build_report

            report = self.parse("report/report.json", contents["report/report.json"], "mxdb.report")
            if report is not None:
                self.compare("report", "report/report.json", "", report, build_report(recomputed))
                self.check_report_markdown(contents, report)
        if "store_export.json" not in contents and decisions(runs):
            self.add(
                "store_export.missing",
                "store_export.json",
                "",
                "the store export of the bundle's tuning decisions",
                "no file",
                "a tuning bundle whose points decided entries has no store export",
            )
        if "store_export.json" in contents:
            export = self.parse(
                "store_export.json", contents["store_export.json"], "mxdb.store-export"
            )
            if export is not None:
                check_store_export(self, export, recomputed, runs, self.tol)

    # -- checks ------------------------------------------------------------------------

    def check_report_markdown(
        self, contents: Mapping[str, bytes], report: Mapping[str, Any]
    ) -> None:
        """``report/report.md`` must be exactly the rendering of ``report/report.json``."""
        from mxdb.report import render_markdown

        md = contents.get("report/report.md")
        if md is None:
            return
        try:
            want = render_markdown(report).encode()
            if md != want and md == render_markdown(report, failure_ids=True).encode():
                return  # the earlier rendering of the same report.json
        except (KeyError, TypeError, ValueError) as exc:
            self.add(
                "report.markdown", "report/report.md", "", "a report", str(exc), "cannot render"
            )
            return
        check_rendering(
            self, "report/report.md", "report.markdown_mismatch", md, want,
            "report.md is not the rendering of report.json",
        )  # fmt: skip

    def check_claims(
        self, contents: dict[str, bytes], runs: dict[str, Any], traces: dict[str, Any]
    ) -> None:
        """Every declared kind of evidence (:mod:`mxdb.audit.kinds`) whose document the bundle
        holds."""
        tol = self.tol
        ctx = Context(runs=runs, traces=traces, contents=contents, fp_hash=self.fp_hash)
        for kind in KINDS:
            if kind.document in contents:
                doc = self.parse(kind.document, contents[kind.document], kind.schema)
                if doc is not None:
                    audit_claim(kind, self, doc, ctx, tol)
                    if kind is decode.KIND:  # what a shipped export's decode entries must match
                        device = (self.fp_components or {}).get("device_name")
                        self.decode += decode.decisions(doc, device, self.root.name)

    def check_trace(self, rel: str, doc: dict[str, Any]) -> bool:
        ids = doc["ids"]
        h = trace_hash(doc["experts"], ids)
        ok = True
        if h != doc["trace_hash"] or rel != f"traces/{doc['trace_hash']}.json":
            self.add(
                "trace.hash_mismatch",
                rel,
                "trace_hash",
                h,
                doc["trace_hash"],
                "trace hash is not the hash of its ids (or of its file name)",
            )
            ok = False
        e, k = doc["experts"], doc["topk"]
        if len(ids) != doc["tokens"] or any(len(r) != k for r in ids):
            self.add(
                "trace.invalid",
                rel,
                "ids",
                f"[{doc['tokens']}][{k}] ids",
                f"{len(ids)} rows",
                "ids do not match tokens x topk",
            )
            ok = False
        elif any(x < 0 or x >= e for r in ids for x in r):
            self.add(
                "trace.invalid",
                rel,
                "ids",
                f"expert ids in [0, {e})",
                "an id out of range",
                "expert id out of range",
            )
            ok = False
        return ok

    def check_timing(self, rel: str, name: str, t: dict[str, Any]) -> None:
        samples = t["samples_us"]
        bad = [i for i, x in enumerate(samples) if not stats.valid_sample(x)]
        if bad:
            i = bad[0]
            self.add(
                "run.sample_invalid",
                rel,
                f"{name}.samples_us[{i}]",
                "a finite positive number of microseconds",
                samples[i],
                f"{len(bad)} invalid timing sample(s)",
            )
            return
        med, p90 = stats.median(samples), stats.p90(samples)
        if not same(t["median_us"], med, *self.tol):
            self.add(
                "run.median_mismatch",
                rel,
                f"{name}.median_us",
                med,
                t["median_us"],
                "median is not the median of the samples",
            )
        if not same(t["p90_us"], p90, *self.tol):
            self.add(
                "run.p90_mismatch",
                rel,
                f"{name}.p90_us",
                p90,
                t["p90_us"],
                "p90 is not the p90 (linear interpolation) of the samples",
            )
        if t["replicates"] != len(samples):
            self.add(
                "run.count_mismatch",
                rel,
                f"{name}.replicates",
                len(samples),
                t["replicates"],
                "replicate count is not the number of samples",
            )

    def check_run(self, rel: str, r: dict[str, Any], traces: Mapping[str, Any]) -> None:
        if self.milestone is not None and r["milestone"] != self.milestone:
            self.add(
                "run.milestone_mismatch",
                rel,
                "milestone",
                self.milestone,
                r["milestone"],
                "run belongs to another milestone",
            )
        fp = r["fingerprint"]
        h = fingerprint_hash(fp)
        if h != r["fingerprint_hash"]:
            self.add(
                "fingerprint.hash_mismatch",
                rel,
                "fingerprint_hash",
                h,
                r["fingerprint_hash"],
                "fingerprint hash is not that of its components",
            )
        if self.fp_components is not None and fp != self.fp_components:
            for comp in FINGERPRINT_COMPONENTS:
                if fp.get(comp) != self.fp_components.get(comp):
                    self.add(
                        "fingerprint.component_mismatch",
                        rel,
                        f"fingerprint.{comp}",
                        self.fp_components.get(comp),
                        fp.get(comp),
                        f"run measured with another {comp} than the milestone",
                    )
        cfg_hash = config_hash(r["config"])
        if cfg_hash != r["config_hash"]:
            self.add(
                "run.config_hash_mismatch",
                rel,
                "config_hash",
                cfg_hash,
                r["config_hash"],
                "config_hash is not the hash of the config",
            )
        problem = _config_problem(json.dumps(r["config"], sort_keys=True))
        if problem is not None:
            self.add(
                "run.config_invalid",
                rel,
                "config",
                "a valid kernel config",
                problem[:120],
                "config is not a valid kernel config",
            )
        s = r["shape"]
        if s["topk"] > s["experts"]:
            self.add(
                "run.shape_invalid",
                rel,
                "shape.topk",
                f"<= {s['experts']}",
                s["topk"],
                "top-k exceeds the expert count",
            )
        th = r.get("trace_hash")
        if th is not None:
            t = traces.get(th)
            if t is None:
                self.add(
                    "run.trace_missing",
                    rel,
                    "trace_hash",
                    f"traces/{th}.json",
                    "no trace",
                    "run names a trace the bundle does not hold",
                )
            elif (t["experts"], t["tokens"], t["topk"]) != (s["experts"], s["tokens"], s["topk"]):
                self.add(
                    "run.trace_mismatch",
                    rel,
                    "trace_hash",
                    f"E{s['experts']} M{s['tokens']} k{s['topk']}",
                    f"E{t['experts']} M{t['tokens']} k{t['topk']}",
                    "run shape does not match its trace",
                )
        for name in ("timing", "eager_timing"):
            if r.get(name) is not None:
                self.check_timing(rel, name, r[name])
        if r["status"] == "ok" and r["role"] != "peer" and r.get("timing") is None:
            self.add(
                "run.timing_missing",
                rel,
                "timing",
                "timing samples",
                None,
                "status ok without timing",
            )
        c = r.get("correctness")
        dtype = s["dtype"]
        verdict = run_passes(r)
        if c is not None:
            t_ = THRESHOLDS[dtype]
            for field, want in (("threshold_abs", t_.max_abs), ("threshold_rel", t_.max_rel)):
                if c[field] != want:
                    self.add(
                        "correctness.threshold_mismatch",
                        rel,
                        f"correctness.{field}",
                        want,
                        c[field],
                        f"threshold is not the {dtype} table's",
                    )
            if c["passed"] != verdict:
                self.add(
                    "correctness.passed_mismatch",
                    rel,
                    "correctness.passed",
                    verdict,
                    c["passed"],
                    "passed flag is not the verdict of the recorded errors",
                )
        if r["status"] == "ok" and r["role"] == "candidate" and not verdict:
            self.add(
                "correctness.status_mismatch",
                rel,
                "status",
                "wrong (fails correctness)",
                "ok",
                "a candidate marked ok fails correctness",
            )
        if r["status"] == "wrong" and verdict:
            self.add(
                "correctness.status_mismatch",
                rel,
                "status",
                "ok (passes correctness)",
                "wrong",
                "a run marked wrong passes correctness",
            )
        if r["role"] == "control" and not r.get("pair_id"):
            self.add(
                "run.pair_invalid",
                rel,
                "pair_id",
                "the id of its A-vs-A pair",
                None,
                "control run without a pair",
            )

    def check_groups(self, runs: Mapping[str, dict[str, Any]], files: Mapping[str, str]) -> None:
        groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for r in runs.values():
            groups[group_key(r)].append(r)
        for key, members in groups.items():
            members.sort(key=lambda r: r["run_id"])
            traces = sorted({r["trace_hash"] for r in members if r.get("trace_hash")})
            if len(traces) > 1:
                odd = next(r for r in members if r.get("trace_hash") != traces[0])
                self.add(
                    "run.trace_mismatch",
                    files[odd["run_id"]],
                    "trace_hash",
                    traces[0],
                    odd["trace_hash"],
                    f"group {key} mixes traces (not one replayed routing)",
                )
            bases = [r["run_id"] for r in members if r["role"] == "baseline"]
            if len(bases) > 1:
                self.add(
                    "summary.baseline_ambiguous",
                    files[bases[1]],
                    "role",
                    "one baseline",
                    ", ".join(bases),
                    f"group {key} has {len(bases)} baselines",
                )
            pairs: dict[str, list[dict[str, Any]]] = defaultdict(list)
            for r in members:
                if r["role"] == "control" and r.get("pair_id"):
                    pairs[r["pair_id"]].append(r)
            for pid, p in sorted(pairs.items()):
                if len(p) != 2:
                    self.add(
                        "run.pair_invalid",
                        files[p[-1]["run_id"]],
                        "pair_id",
                        "exactly two runs",
                        f"{len(p)} runs",
                        f"control pair {pid} in {key}",
                    )
                elif p[0]["config_hash"] != p[1]["config_hash"]:
                    self.add(
                        "run.pair_invalid",
                        files[p[1]["run_id"]],
                        "config_hash",
                        p[0]["config_hash"],
                        p[1]["config_hash"],
                        f"control pair {pid} compares two configs (must be A vs A)",
                    )

    def check_summary(
        self, claimed: dict[str, Any], recomputed: dict[str, Any], runs: Mapping[str, Any]
    ) -> None:
        f = "summary.json"
        if self.milestone is not None and claimed["milestone"] != self.milestone:
            self.add(
                "summary.field_mismatch",
                f,
                "milestone",
                self.milestone,
                claimed["milestone"],
                "summary names another milestone",
            )
        for item in claimed["failures"]:
            if item["run_id"] not in runs:
                self.add(
                    "summary.failure_missing",
                    f,
                    "failures",
                    f"runs/{item['run_id']}.json",
                    "no such run",
                    f"listed failure {item['run_id']} is not in the bundle",
                )
        for g in claimed["groups"]:
            where = f"groups[{g['key']}]"
            refs = [g["baseline_run"], g["best_run"], *g["candidate_runs"], *g["failures"]]
            refs += [x for p in g["control_pairs"] for x in p]
            for rid in refs:
                if rid is not None and rid not in runs:
                    check = (
                        "summary.failure_missing" if rid in g["failures"] else "summary.unknown_run"
                    )
                    self.add(
                        check,
                        f,
                        where,
                        f"runs/{rid}.json",
                        "no such run",
                        f"summary refers to run {rid}, absent from the bundle",
                    )
            best = runs.get(g["best_run"]) if g["best_run"] else None
            base = runs.get(g["baseline_run"]) if g["baseline_run"] else None
            if best is not None and (
                best["role"] not in ("candidate", "peer")
                or (base is not None and best["config_hash"] == base["config_hash"])
            ):
                self.add(
                    "summary.control_in_speedup",
                    f,
                    f"{where}.best_run",
                    "a candidate with a config other than the baseline's",
                    f"{g['best_run']} (role {best['role']})",
                    "a same-config (control) comparison is counted as a speedup",
                )
        self.compare("summary", f, "", claimed, recomputed)

    def compare(self, prefix: str, file: str, path: str, claimed: Any, recomputed: Any) -> None:
        """Recursive comparison of a claimed document with its recomputation."""
        if isinstance(claimed, dict) and isinstance(recomputed, dict):
            for k in sorted(set(claimed) | set(recomputed)):
                sub = f"{path}.{k}" if path else k
                if k not in claimed or k not in recomputed:
                    self.add(
                        f"{prefix}.field_mismatch",
                        file,
                        sub,
                        recomputed.get(k, "absent"),
                        claimed.get(k, "absent"),
                        "field differs from its recomputation",
                    )
                elif k in ("groups", "rows"):
                    self.compare_keyed(prefix, file, sub, claimed[k], recomputed[k])
                elif path.startswith("counts") or k == "counts":
                    if not same(claimed[k], recomputed[k], *self.tol):
                        self.compare_counts(prefix, file, sub, claimed[k], recomputed[k])
                else:
                    self.compare(prefix, file, sub, claimed[k], recomputed[k])
            return
        if not same(claimed, recomputed, *self.tol):
            leaf = path.rsplit(".", 1)[-1]
            if leaf.startswith("failures") or ".failures" in path or path.startswith("failures"):
                leaf = "failures"
            code = f"{prefix}.{_FIELD_CODES.get(leaf, 'field_mismatch')}"
            self.add(
                code,
                file,
                path,
                recomputed,
                claimed,
                f"claimed {leaf} differs from the figure recomputed from the raw samples",
            )

    def compare_counts(self, prefix: str, file: str, path: str, claimed: Any, rec: Any) -> None:
        if isinstance(claimed, dict) and isinstance(rec, dict):
            for k in sorted(set(claimed) | set(rec)):
                self.compare_counts(prefix, file, f"{path}.{k}", claimed.get(k), rec.get(k))
        elif not same(claimed, rec, *self.tol):
            self.add(
                f"{prefix}.count_mismatch",
                file,
                path,
                rec,
                claimed,
                "claimed count differs from the runs",
            )

    def compare_keyed(self, prefix: str, file: str, path: str, claimed: Any, rec: Any) -> None:
        c = {g.get("key"): g for g in claimed if isinstance(g, dict)}
        r = {g["key"]: g for g in rec}
        for key in sorted(set(r) - set(c), key=str):
            self.add(
                f"{prefix}.group_missing",
                file,
                f"{path}[{key}]",
                "a group recomputed from the runs",
                "absent",
                f"group {key} is missing",
            )
        for key in sorted(set(c) - set(r), key=str):
            self.add(
                f"{prefix}.group_extra",
                file,
                f"{path}[{key}]",
                "absent",
                "a group no run supports",
                f"group {key} has no runs",
            )
        for key in sorted(set(c) & set(r), key=str):
            self.compare(prefix, file, f"{path}[{key}]", c[key], r[key])
        if [g.get("key") for g in claimed if isinstance(g, dict)] != [
            g["key"] for g in rec
        ] and set(c) == set(r):
            self.add(
                f"{prefix}.field_mismatch",
                file,
                path,
                "groups sorted by key",
                "another order",
                "groups are not in their canonical order",
            )


@functools.cache
def _fast_validator(name: str, version: str | None = None) -> Callable[[Any], bool] | None:
    from mxdb.schemas import load_schema

    schema = load_schema(name, version)
    return compile_schema(schema) if schema is not None else None


@functools.lru_cache(maxsize=4096)
def _config_problem(config_json: str) -> str | None:
    from mxdb.configs import KernelConfig

    try:
        KernelConfig.parse(config_json)
    except ConfigError as exc:
        return str(exc)
    return None


def find_bundles(path: Path) -> list[Path]:
    """The bundle directories at or under ``path`` (those holding manifest.json), links skipped."""
    if (path / MANIFEST_NAME).is_file() or (path / MANIFEST_NAME).is_symlink():
        return [path]
    found: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(path, followlinks=False):
        if MANIFEST_NAME in filenames:
            found.append(Path(dirpath))
            dirnames.clear()  # a bundle's own subfolders are its content
        else:
            dirnames.sort()
    return sorted(found)


#: What a bundle folder holds before its manifest is written (the manifest comes last).
_BUNDLE_MARKERS = ("runs", "traces", "fingerprint.json", "summary.json")


def find_unfinished(path: Path) -> list[Path]:
    """Folders at or under ``path`` that hold bundle content but no manifest.json.

    A tune killed before it finished leaves such a folder; it is not a bundle, so nothing in
    it can be checked, and saying nothing would let ``mxdb audit OUT/`` pass.  Folders
    inside a bundle are the bundle's content and are not reported.
    """
    found: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(path, followlinks=False):
        if MANIFEST_NAME in filenames:
            dirnames.clear()
            continue
        names = set(filenames) | set(dirnames)
        if any(m in names for m in _BUNDLE_MARKERS) and (
            "runs" in dirnames or "fingerprint.json" in filenames
        ):
            found.append(Path(dirpath))
            dirnames.clear()
            continue
        dirnames.sort()
    return sorted(found)


def audit_bundle(root: Path, options: AuditOptions | None = None) -> BundleResult:
    """Audit one bundle directory."""
    audit = _BundleAudit(Path(root), Path(root).as_posix(), options or AuditOptions())
    audit.run()
    return BundleResult(
        path=audit.label,
        bundle_id=audit.bundle_id,
        milestone=audit.milestone,
        fingerprint_hash=audit.fp_hash,
        runs=audit.n_runs,
        findings=tuple(audit.findings),
        backed=tuple(audit.backed),
        deferred=tuple((f"{audit.label}/{f}", fld, e) for f, fld, e in audit.deferred),
        backing=tuple(audit.backing),
        decode=tuple(audit.decode),
    )


def audit_paths(
    paths: Iterable[Path],
    options: AuditOptions | None = None,
    *,
    progress: Callable[[BundleResult], None] | None = None,
) -> AuditResult:
    """Audit every bundle at or under each path; a path with no bundle is a finding."""
    options = options or AuditOptions()
    results: list[BundleResult] = []
    findings: list[Finding] = []
    for p in paths:
        p = Path(p)
        if not p.exists():
            raise UsageError(f"audit path {p} does not exist; give a bundle or a folder of bundles")
        if p.is_file() and p.name == MANIFEST_NAME:
            p = p.parent
        bundles = find_bundles(p) if p.is_dir() else []
        unfinished = find_unfinished(p) if p.is_dir() else []
        for u in unfinished:
            findings.append(
                Finding(
                    "bundle.no_manifest",
                    f"{u.as_posix()}/{MANIFEST_NAME}",
                    "",
                    "a manifest.json listing every file of the bundle",
                    "no file",
                    "a bundle folder without a manifest (a tune killed before it finished?): "
                    "nothing in it can be checked; finish it by running the same tune again, "
                    "or remove the folder",
                )
            )
        if not bundles and not unfinished:
            findings.append(
                Finding(
                    "bundle.none_found",
                    p.as_posix(),
                    "",
                    "an evidence bundle (a folder with manifest.json)",
                    "none",
                    "no bundle to audit here",
                )
            )
        for b in bundles:
            res = audit_bundle(b, options)
            results.append(res)
            findings.extend(res.findings)
            if progress is not None:
                progress(res)
    findings.extend(_cross_bundle(results))
    resolved: list[dict[str, Any]] = []
    tol = (options.rel_tol, options.abs_tol)
    findings.extend(resolve_deferred(results, resolved, tol))
    for p in paths:
        p = Path(p)
        for f in shipped_exports(p):
            findings.extend(check_shipped_export(f, results, resolved, tol))
    return AuditResult(bundles=tuple(results), findings=tuple(findings))


def _cross_bundle(results: list[BundleResult]) -> list[Finding]:
    by_milestone: dict[str, Counter[str]] = defaultdict(Counter)
    where: dict[tuple[str, str], str] = {}
    for r in results:
        if r.milestone and r.fingerprint_hash:
            by_milestone[r.milestone][r.fingerprint_hash] += 1
            where.setdefault((r.milestone, r.fingerprint_hash), r.path)
    out = []
    for m, hashes in sorted(by_milestone.items()):
        if len(hashes) > 1:
            (first, _), *rest = hashes.most_common()
            for h, _ in rest:
                out.append(
                    Finding(
                        "bundle.milestone_fingerprint",
                        f"{where[(m, h)]}/fingerprint.json",
                        "hash",
                        first,
                        h,
                        f"milestone {m} spans two environments",
                    )
                )
    return out
