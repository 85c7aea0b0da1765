"""Write an evidence bundle: the tuner's API.

Example::

    w = BundleWriter(Path("evidence/h200-m1"), milestone="h200-m1", fingerprint=fp)
    gen = {"kind": "zipf", "seed": 0, "params": {"s": 1.2}}
    th = w.add_trace(topk_ids, experts=8, generator=gen)
    w.record(run_id="m4-base", shape=shape, routing_class="skewed", trace_hash=th, seed=0,
             config=anchor, role="baseline", status="ok", samples_us=base_samples,
             max_abs_err=9.8e-4, rel_err=2e-4)
    w.record(run_id="m4-ctl-a", ..., config=anchor, role="control", pair_id="m4-ctl", ...)
    w.record(run_id="m4-ctl-b", ..., config=anchor, role="control", pair_id="m4-ctl", ...)
    w.record(run_id="m4-c17", ..., config=cfg, role="candidate", status="ok", samples_us=s, ...)
    w.record(run_id="m4-c18", ..., config=big, role="candidate", status="oor", error="smem ...")
    w.set_store_export(export_doc)          # optional
    w.finish(bandwidth_bytes_per_s=4.27e12)  # summary.json, report/report.json, manifest.json

Every file is written atomically; the manifest is written last, so a bundle without
``manifest.json`` is unfinished.  ``add_run`` refuses a record inconsistent with itself (a
config hash that is not its config's, figures that are not its samples', thresholds that are
not the dtype's, an unknown trace), so a writer cannot produce a bundle the audit rejects.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Mapping, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from mxdb.configs import KernelConfig, config_hash
from mxdb.errors import EvidenceError, TraceError
from mxdb.evidence import stats
from mxdb.evidence.files import (
    MANIFEST_NAME,
    atomic_write,
    dumps,
    is_manifested,
    manifest_digest,
    scan_tree,
    sha256_hex,
    trace_hash,
)
from mxdb.evidence.models import (
    Correctness,
    FingerprintDoc,
    Manifest,
    RunRecord,
    ShapeDoc,
    Timing,
    TraceDoc,
)
from mxdb.evidence.summary import summarize
from mxdb.evidence.thresholds import THRESHOLDS, passes
from mxdb.models import Fingerprint
from mxdb.shapes import MoEShape


def make_timing(
    samples_us: Sequence[float], *, method: str = "cuda_graph_replay", warmup: int = 0
) -> Timing:
    """A ``Timing`` with its median, p90 and replicate count computed from the samples."""
    samples = [float(x) for x in samples_us]
    bad = [x for x in samples if not stats.valid_sample(x)]
    if not samples or bad:
        raise EvidenceError(
            f"timing samples must be finite positive microseconds; got {len(samples)} samples "
            f"with invalid values {bad[:3]}; drop or re-measure them"
        )
    return Timing(
        method=method,
        samples_us=samples,
        median_us=stats.median(samples),
        p90_us=stats.p90(samples),
        warmup=warmup,
        replicates=len(samples),
    )


def make_correctness(dtype: str, max_abs_err: float | None, rel_err: float | None) -> Correctness:
    """The correctness record of errors measured for ``dtype``, judged by the shared table."""
    t = THRESHOLDS[dtype]
    return Correctness(
        max_abs_err=max_abs_err,
        rel_err=rel_err,
        threshold_abs=t.max_abs,
        threshold_rel=t.max_rel,
        passed=passes(dtype, max_abs_err, rel_err),
    )


class BundleWriter:
    """Builds one evidence bundle in ``out_dir`` (which must be absent or empty)."""

    def __init__(
        self,
        out_dir: Path,
        *,
        milestone: str,
        fingerprint: Fingerprint,
        bundle_id: str | None = None,
        fingerprint_data: Mapping[str, str] | None = None,
    ) -> None:
        self.root = Path(out_dir)
        if self.root.exists() and (not self.root.is_dir() or any(self.root.iterdir())):
            raise EvidenceError(
                f"cannot write an evidence bundle to {self.root}: it exists and is not an empty "
                "directory; choose a new directory"
            )
        self.root.mkdir(parents=True, exist_ok=True)
        self.milestone = milestone
        self.fingerprint = fingerprint
        self.fingerprint_hash = fingerprint.hash
        stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
        self.bundle_id = bundle_id or f"{milestone}-{stamp}-{secrets.token_hex(3)}"
        self._runs: dict[str, dict[str, Any]] = {}
        self._traces: dict[str, int] = {}  # hash -> active experts
        self._trace_dims: dict[str, tuple[int, int, int]] = {}
        self._finished = False
        doc = FingerprintDoc(
            fingerprint=fingerprint, hash=self.fingerprint_hash, data=dict(fingerprint_data or {})
        )
        self._write("fingerprint.json", doc.to_json_dict())

    # -- content ---------------------------------------------------------------------------

    def add_trace(self, ids: Any, *, experts: int, generator: Mapping[str, Any]) -> str:
        """Store top-k ids ``[tokens][topk]`` (list or array) once; returns the trace hash."""
        self._check_open()
        rows = ids.tolist() if hasattr(ids, "tolist") else ids
        if not isinstance(rows, list) or not rows or not all(isinstance(r, list) for r in rows):
            raise TraceError("a trace must be a non-empty [tokens][topk] list of expert ids")
        topk = len(rows[0])
        if topk == 0 or any(len(r) != topk for r in rows):
            raise TraceError(f"every token needs the same number of expert ids ({topk})")
        flat = [int(x) for r in rows for x in r]
        if any(x < 0 or x >= experts for x in flat):
            raise TraceError(f"expert ids must lie in [0, {experts}); got {min(flat)}..{max(flat)}")
        norm = [[int(x) for x in r] for r in rows]
        h = trace_hash(experts, norm)
        if h not in self._traces:
            doc = TraceDoc(
                experts=experts,
                tokens=len(norm),
                topk=topk,
                ids=norm,
                trace_hash=h,
                generator=dict(generator),
            )
            self._write(f"traces/{h}.json", doc.to_json_dict())
            self._traces[h] = len(set(flat))
            self._trace_dims[h] = (experts, len(norm), topk)
        return h

    def record(
        self,
        *,
        run_id: str,
        shape: MoEShape,
        routing_class: str,
        config: KernelConfig | Mapping[str, Any],
        role: str,
        status: str,
        trace_hash: str | None = None,
        seed: int | None = None,
        samples_us: Sequence[float] | None = None,
        timing_method: str = "cuda_graph_replay",
        warmup: int = 0,
        eager_samples_us: Sequence[float] | None = None,
        max_abs_err: float | None = None,
        rel_err: float | None = None,
        error: str | None = None,
        pair_id: str | None = None,
        fidelity: str = "replay",
        point: str | None = None,
        comparison: str | None = None,
        margin: float | None = None,
        order_seed: int | None = None,
        schema_version: str | None = None,
    ) -> RunRecord:
        """Build a run from raw measurements (figures computed here) and add it.

        ``schema_version`` defaults to the newest; a tuner's run of a point decided by
        ``mxdb.pointverdict`` rule 1 is written as 1.1 (the version names the rule)."""
        cfg = config.model_dump() if isinstance(config, KernelConfig) else dict(config)
        measured_correctness = max_abs_err is not None or rel_err is not None
        try:
            run = RunRecord(
                run_id=run_id,
                milestone=self.milestone,
                shape=ShapeDoc(**shape.to_dict()),
                routing_class=routing_class,
                trace_hash=trace_hash,
                seed=seed,
                config=cfg,
                config_hash=config_hash(cfg),
                role=role,
                pair_id=pair_id,
                fidelity=fidelity,
                status=status,
                error=error,
                correctness=make_correctness(shape.dtype, max_abs_err, rel_err)
                if measured_correctness
                else None,
                timing=make_timing(samples_us, method=timing_method, warmup=warmup)
                if samples_us
                else None,
                eager_timing=make_timing(eager_samples_us, method="eager")
                if eager_samples_us
                else None,
                fingerprint=self.fingerprint,
                fingerprint_hash=self.fingerprint_hash,
                point=point,
                comparison=comparison,
                margin=margin,
                order_seed=order_seed,
                **({"schema_version": schema_version} if schema_version else {}),
            )
        except ValidationError as exc:
            raise EvidenceError(f"run {run_id!r} is malformed: {exc}") from None
        self.add_run(run)
        return run

    def add_run(self, run: RunRecord) -> Path:
        """Write ``runs/<run_id>.json`` after checking the record against itself and the bundle."""
        self._check_open()
        rid = run.run_id
        problems: list[str] = []
        if rid in self._runs:
            problems.append("the run id is already in this bundle")
        if run.milestone != self.milestone:
            problems.append(f"milestone {run.milestone!r} is not the bundle's {self.milestone!r}")
        if run.fingerprint_hash != self.fingerprint_hash or run.fingerprint != self.fingerprint:
            problems.append("its fingerprint is not the bundle's")
        if config_hash(run.config) != run.config_hash:
            problems.append("config_hash is not the hash of its config")
        if run.trace_hash is not None:
            dims = self._trace_dims.get(run.trace_hash)
            s = run.shape
            if dims is None:
                problems.append(f"trace {run.trace_hash} was not added (add_trace first)")
            elif dims != (s.experts, s.tokens, s.topk):
                problems.append(f"trace {run.trace_hash} has (E, M, k) {dims}, not the shape's")
        for t in (run.timing, run.eager_timing):
            if t is not None and t != make_timing(t.samples_us, method=t.method, warmup=t.warmup):
                problems.append("timing figures are not those of its samples (use make_timing)")
        c = run.correctness
        if c is not None and c != make_correctness(run.shape.dtype, c.max_abs_err, c.rel_err):
            problems.append("correctness thresholds or verdict differ from the dtype's table")
        if run.status == "ok" and run.role in ("baseline", "candidate", "control", "peer"):
            if run.timing is None:
                problems.append("status ok needs timing samples")
            if run.role in ("candidate", "peer") and (c is None or not c.passed):
                problems.append("a candidate with status ok must pass correctness")
        if run.role == "control" and not run.pair_id:
            problems.append("a control run needs a pair_id")
        if problems:
            raise EvidenceError(f"cannot add run {rid!r}: " + "; ".join(problems))
        doc = run.to_json_dict()
        self._runs[rid] = doc
        return self._write(f"runs/{rid}.json", doc)

    def set_store_export(self, export: Mapping[str, Any] | BaseModel) -> None:
        """Include the store export (``mxdb.store-export``) of the entries this tune verified."""
        self._check_open()
        doc = (
            export.model_dump(mode="json", by_alias=True)
            if isinstance(export, BaseModel)
            else json.loads(json.dumps(dict(export), default=str))
        )
        self._write("store_export.json", doc)

    def summary(self, *, bandwidth_bytes_per_s: float | None = None) -> dict[str, Any]:
        """The summary of the runs added so far (what ``finish`` will write)."""
        return summarize(
            list(self._runs.values()),
            milestone=self.milestone,
            fingerprint_hash=self.fingerprint_hash,
            bandwidth_bytes_per_s=bandwidth_bytes_per_s,
            active_experts=self._traces,
        )

    def finish(self, *, bandwidth_bytes_per_s: float | None = None, report: bool = True) -> Path:
        """Write summary.json (and report/), then the manifest, last; returns the bundle dir."""
        self._check_open()
        summary = self.summary(bandwidth_bytes_per_s=bandwidth_bytes_per_s)
        self._write("summary.json", summary)
        if report:
            from mxdb.report import build_report, render_markdown

            rep = build_report(summary)
            self._write("report/report.json", rep)
            atomic_write(self.root / "report/report.md", render_markdown(rep).encode())
        write_manifest(self.root, bundle_id=self.bundle_id, milestone=self.milestone)
        self._finished = True
        return self.root

    # -- helpers ---------------------------------------------------------------------------

    def _write(self, rel: str, doc: Any) -> Path:
        path = self.root / rel
        atomic_write(path, dumps(doc))
        return path

    def _check_open(self) -> None:
        if self._finished:
            raise EvidenceError(f"bundle {self.root} is finished; start a new BundleWriter")


def write_manifest(root: Path, *, bundle_id: str, milestone: str) -> Manifest:
    """Hash every file of ``root`` (except the manifest and signatures) into manifest.json."""
    files, links, special = scan_tree(root)
    if links or special:
        raise EvidenceError(
            f"bundle {root} contains symbolic links or special files {links + special}; "
            "a bundle holds regular files only"
        )
    hashes = {
        rel: sha256_hex(path.read_bytes())
        for rel, path in sorted(files.items())
        if is_manifested(rel)
    }
    manifest = Manifest(
        bundle_id=bundle_id,
        milestone=milestone,
        created_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        files=hashes,
        digest=manifest_digest(hashes),
    )
    atomic_write(root / MANIFEST_NAME, dumps(manifest.to_json_dict()))
    return manifest


def staging_dir(bundle: Path) -> Path:
    """An empty folder beside ``bundle`` (``<name>.new``) to build its replacement in."""
    import shutil

    tmp = Path(bundle).with_name(Path(bundle).name + ".new")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    return tmp


def finish_bundle(tmp: Path, bundle: Path, *, bundle_id: str, milestone: str) -> Path:
    """Write ``tmp``'s manifest (last, so a bundle without one is unfinished), then put ``tmp``
    in the place of ``bundle`` (an older bundle there is replaced)."""
    import shutil

    write_manifest(tmp, bundle_id=bundle_id, milestone=milestone)
    bundle = Path(bundle)
    if bundle.exists():
        shutil.rmtree(bundle)
    tmp.rename(bundle)
    return bundle


def publish_bundle(
    bundle: Path,
    *,
    fingerprint: Fingerprint,
    files: Mapping[str, str | Mapping[str, Any]],
    milestone: str,
    bundle_id: str | None = None,
) -> Path:
    """Write a bundle of documents: fingerprint.json, then ``files`` (bundle-relative name ->
    a JSON document or the text of a report), then the manifest; built beside ``bundle`` and
    moved into its place at the end, so a reader never sees half of it."""
    tmp = staging_dir(bundle)
    fp_doc = FingerprintDoc(fingerprint=fingerprint, hash=fingerprint.hash)
    atomic_write(tmp / "fingerprint.json", dumps(fp_doc.to_json_dict()))
    for rel, content in files.items():
        path = tmp / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, content.encode() if isinstance(content, str) else dumps(dict(content)))
    return finish_bundle(tmp, bundle, bundle_id=bundle_id or Path(bundle).name, milestone=milestone)


def write_document_bundle(
    out_dir: Path,
    *,
    kind: str,
    fingerprint: Fingerprint,
    file_name: str,
    document: Mapping[str, Any],
    milestone: str,
    bundle_id: str | None = None,
) -> Path:
    """Write a one-document bundle: fingerprint.json, ``file_name``, then (last) the manifest.

    For evidence that is one claims document with its raw samples inside (a compile survey,
    a self-healing run, a decode benchmark); ``out_dir`` must be new or empty.
    """
    root = Path(out_dir)
    if root.exists() and (not root.is_dir() or any(root.iterdir())):
        raise EvidenceError(
            f"cannot write a {kind} bundle to {root}: it exists and is not an empty "
            "directory; choose a new directory or remove the old bundle"
        )
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    return publish_bundle(
        root,
        fingerprint=fingerprint,
        files={file_name: document},
        milestone=milestone,
        bundle_id=bundle_id or f"{milestone}-{stamp}-{secrets.token_hex(3)}",
    )
