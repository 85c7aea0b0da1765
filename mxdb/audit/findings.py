"""What the audit reports: findings (one per problem), options and the overall result."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from mxdb.evidence import stats


class FindingSink(Protocol):
    """Where an audit module's checks put their findings (the bundle auditor)."""

    #: the bundle's environment fingerprint hash, once known
    fp_hash: str | None

    def add(self, check: str, file: str, field: str, expected: Any, found: Any, msg: str) -> None:
        """Record one finding."""


#: Every check code the audit emits, with its meaning (stable: tests and CI key on them).
CHECKS: dict[str, str] = {
    "bundle.none_found": "a PATH holds no bundle (no manifest.json under it)",
    "bundle.symlink": "a symbolic link inside a bundle (never followed)",
    "bundle.special_file": "a non-regular file (fifo, socket, device) inside a bundle",
    "bundle.milestone_fingerprint": "two bundles of one milestone have different fingerprints",
    "json.invalid": "a file is not valid JSON (truncated, edited) or not a JSON object",
    "schema.wrong_document": "a file declares another document type than its place requires",
    "schema.unknown_version": "a document's schema_version is one this mxdb does not understand",
    "schema.invalid": "a document violates its JSON Schema",
    "manifest.digest_mismatch": "the manifest digest is not the digest of its file list",
    "manifest.unsafe_path": "a manifest path is absolute, has '..' or is otherwise unsafe",
    "manifest.changed": "a file's SHA-256 differs from the manifest",
    "manifest.missing_file": "a file listed in the manifest is absent",
    "manifest.extra_file": "a file is present but not listed in the manifest",
    "bundle.no_manifest": "a bundle folder without manifest.json (a tune killed before it ended)",
    "bundle.hardlink": "a bundle file is a hard link to a file outside the bundle",
    "bundle.case_collision": "two file names differ only in letter case (Summary.json, summary.json)",
    "bundle.file_too_large": "a bundle file exceeds the audit's size limit (not read)",
    "bundle.unreadable": "a bundle file cannot be read",
    "json.duplicate_key": "a JSON object repeats a key (readers disagree on which value counts)",
    "report.markdown_mismatch": "report/report.md is not the rendering of report/report.json",
    "report.markdown": "report/report.json cannot be rendered to compare report.md",
    "signature.missing": "no signature by a trusted key",
    "signature.invalid": "a signature does not verify (wrong key, edited manifest, bad bytes)",
    "signature.duplicate": "two signatures by the same key",
    "signature.untrusted": "signed only by keys outside --trusted-keys",
    "signature.malformed": "a signature file cannot be read",
    "fingerprint.hash_mismatch": "a fingerprint's hash is not the hash of its components",
    "fingerprint.component_mismatch": "a run's environment differs from the milestone's",
    "trace.hash_mismatch": "a trace's hash is not the hash of its ids (or of its file name)",
    "trace.invalid": "a trace's ids do not match its declared tokens/topk/experts",
    "run.id_mismatch": "a run file's name is not its run_id",
    "run.duplicate_id": "two run files carry the same run_id",
    "run.milestone_mismatch": "a run names another milestone than the bundle",
    "run.config_hash_mismatch": "a run's config_hash is not the hash of its config",
    "run.config_invalid": "a run's config is not a valid kernel config",
    "run.shape_invalid": "a run's shape is impossible (top-k above the expert count)",
    "run.trace_missing": "a run names a trace the bundle does not hold",
    "run.trace_mismatch": "a run's shape does not match its trace, or its group mixes traces",
    "run.sample_invalid": "a timing sample is not a finite positive number",
    "run.median_mismatch": "a run's median is not the median of its samples",
    "run.p90_mismatch": "a run's p90 is not the p90 of its samples",
    "run.count_mismatch": "a run's replicate count is not its number of samples",
    "run.timing_missing": "a run with status ok has no timing",
    "run.pair_invalid": "a control run without a pair, or a pair that is not two same-config runs",
    "correctness.threshold_mismatch": "a run's thresholds are not the dtype's table",
    "correctness.passed_mismatch": "a run's passed flag is not the verdict of its errors",
    "correctness.status_mismatch": "a run's status contradicts its correctness",
    "summary.missing": "a bundle has runs but no summary.json",
    "summary.unknown_run": "the summary refers to a run that is not in the bundle",
    "summary.failure_missing": "the summary lists a failure whose run is not in the bundle",
    "summary.control_in_speedup": "a control (same-config) run is counted as a speedup",
    "summary.baseline_ambiguous": "a comparison group has more than one baseline",
    "summary.group_missing": "a comparison group recomputed from the runs is absent",
    "summary.group_extra": "the summary claims a group no run supports",
    "summary.speedup_mismatch": "a claimed speedup differs from the recomputed one",
    "summary.noise_band_mismatch": "a claimed noise band differs from the recomputed one",
    "summary.median_mismatch": "a claimed median differs from the runs' samples",
    "summary.geomean_mismatch": "a claimed geometric mean differs from the recomputed one",
    "summary.count_mismatch": "a claimed count differs from the runs",
    "summary.verified_mismatch": "a claimed verified flag differs from the recomputed one",
    "summary.best_mismatch": "the claimed best candidate is not the recomputed one",
    "summary.failures_mismatch": "the listed failures differ from the runs' failures",
    "summary.floor_mismatch": "a memory-floor figure differs from the recomputed one",
    "summary.field_mismatch": "another summary field differs from its recomputation",
    "store_export.missing": "a tuning bundle whose points decided entries has no store export",
    "store_export.unbacked_entry": "an exported entry that no audited bundle's runs support",
    "store_export.field_mismatch": (
        "a field of an exported entry (key, device, status, figure, validation record) differs "
        "from the entry recomputed from the runs of its evidence"
    ),
    "store_export.duplicate_entry": "two exported entries rest on one decision (one run)",
    "shipped_export.duplicate_entry": "two shipped entries rest on one decision",
    "store_export.status_invalid": "an exported tune entry with a status a tune never writes",
    "fingerprint.missing": "a bundle with runs or a store export has no fingerprint.json",
    "shipped_export.unbacked_entry": "an entry of a shipped store export found in no bundle",
    "shipped_export.field_mismatch": (
        "a field of a shipped entry differs from the bundle entry (or decode-op decision) "
        "that backs it"
    ),
    "report.speedup_mismatch": "a report's speedup differs from the recomputed one",
    "report.noise_band_mismatch": "a report's noise band differs from the recomputed one",
    "report.median_mismatch": "a report's median differs from the recomputed one",
    "report.geomean_mismatch": "a report's geometric mean differs from the recomputed one",
    "report.count_mismatch": "a report's count differs from the runs",
    "report.verified_mismatch": "a report's verified flag differs from the recomputed one",
    "report.failures_mismatch": "a report's failures differ from the runs'",
    "report.floor_mismatch": "a report's memory-floor figure differs",
    "report.group_missing": "a report lacks a row for a comparison group",
    "report.group_extra": "a report has a row no run supports",
    "report.field_mismatch": "another report field differs from its recomputation",
    "store_export.missing_config": "a decision (verified or baseline) is not in the store export",
    "store_export.hash_mismatch": "a store-export entry's config hash differs from the evidence",
    "survey.fingerprint_mismatch": "a compile survey's environment is not its fingerprint",
    "survey.profile_invalid": "a compile survey's device profile or shape cannot be read",
    "survey.profile_mismatch": "a compile survey's device profile contradicts its environment",
    "survey.shape_mismatch": "a compile survey's GEMM is not the GEMM of its shape",
    "survey.record_invalid": "a compile record contradicts itself (status, error, resources)",
    "survey.duplicate_compile": "a compile survey records one compilation twice",
    "survey.grid_mismatch": "a compile survey's grid is not the declared grid",
    "survey.grid_extra": "a compile survey row is not a config of its grid",
    "survey.duplicate_config": "a compile survey lists one grid config twice",
    "survey.grid_incomplete": "a compile survey lacks configs of its grid",
    "survey.row_compile_mismatch": "a grid row names a compilation of another config",
    "survey.compile_unused": "a compilation no grid row shares",
    "survey.status_mismatch": "a grid row's status is not its compilation's",
    "survey.group_control_mismatch": "a GROUP_SIZE_M control's flag or key is wrong",
    "survey.group_m_differs": "GROUP_SIZE_M changed a compilation: the grid's expansion fails",
    "survey.proxy_mismatch": "a recorded proxy verdict differs from mxdb.resources",
    "survey.false_rejection": "the resource proxy rejects a config that compiled",
    "survey.count_mismatch": "a compile survey's claimed count differs from its rows",
    "survey.claim_mismatch": "a compile survey's claimed proxy figure differs from its rows",
    "survey.below_threshold": "the proxy rejects under 95% of the configs that fail to compile",
    "decode.fingerprint_mismatch": "a decode document names another fingerprint than its bundle",
    "decode.threshold_mismatch": "a decode case's thresholds are not the dtype's table",
    "decode.samples_invalid": "a decode case or model lacks the raw samples its claims need",
    "decode.claim_mismatch": "a decode claim (winner, speedup, tokens/s, launches) differs from its samples",
    "decode.target_mismatch": "a decode model's target verdict differs from the recomputed figures",
    "peers.fingerprint_mismatch": "a peers claim names another environment than its bundle",
    "peers.run_missing": "a peers point names a run (with samples) or trace the bundle lacks",
    "peers.run_mismatch": "a peers point's run has another role, shape, trace or config",
    "peers.median_mismatch": "a peers median differs from the median of its run's samples",
    "peers.noise_band_mismatch": "a peers noise band differs from its control pair's",
    "peers.floor_mismatch": "a peers memory-floor figure differs from the recomputed one",
    "peers.ratio_mismatch": "a peers speedup, eager ratio or floor fraction differs",
    "peers.flag_mismatch": "a peers point's winner or slower/differs flag differs",
    "peers.geomean_mismatch": "a peers geometric mean differs from the recomputed one",
    "peers.count_mismatch": "a peers count of points differs from the recomputed one",
    "peers.target_missing": "a peers target is absent or unknown",
    "peers.target_threshold_mismatch": "a peers target's threshold or comparison is not mxdb's",
    "peers.target_measured_mismatch": "a peers target's measured value is not its figure",
    "peers.target_verdict_mismatch": "a peers target's pass flag is not its verdict",
    "peers.field_mismatch": "another peers field differs from its recomputation",
    "peers.report_mismatch": "report/peers.md is not the rendering of peers.json",
    "lean_layer.fingerprint_mismatch": "a lean-layer claim names another environment",
    "lean_layer.sample_invalid": "a lean-layer sample is not a finite positive number",
    "lean_layer.shape_mismatch": "a lean-layer point's shape is not its family's at M",
    "lean_layer.config_hash_mismatch": "a lean-layer point's config hash is not its config's",
    "lean_layer.correctness_mismatch": "a lean-layer correctness verdict contradicts its errors",
    "lean_layer.median_mismatch": "a lean-layer median or p90 differs from its samples'",
    "lean_layer.ratio_mismatch": "a lean-layer eager/graph/synced/host ratio differs",
    "lean_layer.geomean_mismatch": "a lean-layer geometric mean (or maximum) differs",
    "lean_layer.count_mismatch": "a lean-layer count of points differs",
    "lean_layer.target_missing": "a lean-layer target is absent or unknown",
    "lean_layer.target_threshold_mismatch": "a lean-layer target's threshold is not mxdb's",
    "lean_layer.target_measured_mismatch": "a lean-layer target's measured value differs",
    "lean_layer.target_verdict_mismatch": "a lean-layer target's pass flag is not its verdict",
    "lean_layer.field_mismatch": "another lean-layer field differs from its recomputation",
    "lean_layer.report_mismatch": "report/lean_layer.md is not the rendering of lean_layer.json",
    "healing.fingerprint_mismatch": "a self-healing run's fingerprint is not the bundle's",
    "healing.config_mismatch": "a self-healing candidate's config hash is wrong, or repeated",
    "healing.calibration_mismatch": "a calibration median is not the median of its samples",
    "healing.sample_invalid": "a self-healing timing is not a finite positive number",
    "healing.stream_invalid": "a stream's phases are missing, out of order or of the wrong size",
    "healing.injection_mismatch": "the slowdown was injected outside (or not in) the slowed phase",
    "healing.transition_mismatch": "switches or active choices contradict the transitions",
    "healing.throughput_mismatch": "a claimed throughput differs from the batches' recomputation",
    "healing.ratio_mismatch": "a claimed healing/static ratio differs from its recomputation",
    "healing.overhead_mismatch": "a claimed sampling overhead differs from the repetitions",
    "healing.claim_mismatch": "a claimed verdict (demoted, recovered, met) is not supported",
    "serving.fingerprint_mismatch": "a serving claim names another environment than its bundle",
    "serving.sample_invalid": "a serving timing sample or tokens/s chunk is not finite positive",
    "serving.layout_mismatch": "serving samples are not one per round, or chunks do not fit",
    "serving.median_mismatch": "a serving median differs from the median of its samples",
    "serving.speedup_mismatch": "a serving speedup, interval bound or median ratio differs",
    "serving.noise_band_mismatch": "a serving noise band differs from the stock copies'",
    "serving.verdict_mismatch": "a serving point's verdict (mxdb.verdict) or slower flag differs",
    "serving.geomean_mismatch": "a serving geometric mean differs from the recomputed one",
    "serving.count_mismatch": "a serving count or list of points differs from the recomputed one",
    "serving.capture_mismatch": "the serving capture figure is not what its capture record gives",
    "serving.throughput_mismatch": "a serving tokens/s figure differs from its chunks",
    "serving.ratio_mismatch": "a serving tokens/s ratio (healed/clean, ...) differs",
    "serving.overhead_mismatch": "a serving monitoring-overhead figure differs from the ladder",
    "serving.transition_mismatch": "a serving healing transition count differs",
    "serving.target_missing": "a serving target is absent or unknown",
    "serving.target_threshold_mismatch": "a serving target's threshold or comparison is not mxdb's",
    "serving.target_measured_mismatch": "a serving target's measured value is not its figure",
    "serving.target_verdict_mismatch": "a serving target's pass flag is not its verdict",
    "serving.report_mismatch": "a serving bundle's report.md is not the rendering of serving.json",
    "serving.field_mismatch": "another serving field differs from its recomputation",
    "stages.fingerprint_mismatch": "a stage profile names another environment than its bundle",
    "stages.sample_invalid": "a stage-profile or bandwidth sample is not finite positive, or a "
    "stage's samples are missing (or present where its implementation has no such stage)",
    "stages.shape_mismatch": "a stage-profile point's shape is not its family's at its M",
    "stages.config_hash_mismatch": "a stage-profile point's config hash is not its config's",
    "stages.median_mismatch": "a stage median differs from the median of its samples",
    "stages.figure_mismatch": "a stage-profile point's share, floor or touched-expert count differs",
    "stages.bandwidth_mismatch": "a bandwidth median differs from its samples",
    "stages.geomean_mismatch": "a stage-profile geometric mean or count differs",
    "stages.field_mismatch": "another stage-profile field differs from mxdb's",
    "stages.report_mismatch": "report/stages.md is not the rendering of stages.json",
    "perfcheck.fingerprint_mismatch": "a model check names another environment than its bundle",
    "perfcheck.sample_invalid": "a model-check sample is not finite positive, an arm that ran has "
    "not one sample per round, or an arm that did not run has samples",
    "perfcheck.arms_invalid": "a model-check point's arms are not FlagGems' choice as baseline "
    "and controls, then at most one candidate",
    "perfcheck.config_mismatch": "a model-check copy does not run the point's baseline, or its "
    "candidate is not the config of its plan entry",
    "perfcheck.shape_mismatch": "a model-check point's shape is not its family's at its M (bf16)",
    "perfcheck.routing_mismatch": "a model-check point's counts are not a routing of its slots, "
    "or its routing class is not the class of its counts",
    "perfcheck.trace_mismatch": "a model-check routing instance does not regenerate to its trace "
    "hash and counts (or is not of the check's generator)",
    "perfcheck.point_duplicate": "a model-check routing instance is counted twice",
    "perfcheck.plan_mismatch": "a model-check plan entry is missing, repeated, not the gate's "
    "verdict, not lofo_plan's recomputation, or not the one a point used",
    "perfcheck.bundle_missing": "a model or sweep bundle a model check names is not beside it",
    "perfcheck.bundle_mismatch": "a model or sweep document a model check names has another "
    "SHA-256 or schema, or another gate or sweep than the check",
    "perfcheck.median_mismatch": "a model-check arm's median is not the median of its samples",
    "perfcheck.speedup_mismatch": "a model-check speedup or noise band differs from the verdict's",
    "perfcheck.verdict_mismatch": "a model-check point's outcome is not the verdict of its samples",
    "perfcheck.geomean_mismatch": "a model-check geometric mean differs from the recomputed one",
    "perfcheck.count_mismatch": "a model-check count of points differs from the recomputed one",
    "perfcheck.calibration_mismatch": "a model-check calibration figure (error, bins) differs",
    "perfcheck.target_missing": "a model-check target is absent or unknown",
    "perfcheck.target_threshold_mismatch": "a model-check target's threshold, comparison or "
    "statement is not mxdb's",
    "perfcheck.target_measured_mismatch": "a model-check target's measured value is not its figure",
    "perfcheck.target_verdict_mismatch": "a model-check target's pass flag is not its verdict",
    "perfcheck.field_mismatch": "another model-check field differs from mxdb's or its recomputation",
    "perfcheck.report_mismatch": "report/check.md is not the rendering of check.json",
    "sweep.fingerprint_mismatch": "a performance sweep names another environment than its bundle",
    "sweep.sample_invalid": "a performance-sweep timing sample is not a finite positive number",
    "sweep.arms_invalid": "a sweep key's copies are not one baseline and its controls of FlagGems' "
    "choice, timed, or an arm has not one sample per round (ok) or none (any other status)",
    "sweep.config_invalid": "a sweep key's config (FlagGems' choice or an arm's) does not parse",
    "sweep.shape_mismatch": "a sweep key's shape is not its family's at its M (bf16)",
    "sweep.counts_invalid": "a sweep key's counts are not one per expert summing to tokens x top-k",
    "sweep.class_mismatch": "a sweep key's routing class is not the class of its counts",
    "sweep.routing_mismatch": "a sweep key's routing does not regenerate to its counts and trace hash",
    "sweep.duplicate_key": "a sweep key (family, M, routing source) is recorded twice",
    "sweep.median_mismatch": "a sweep median differs from the median of its samples",
    "sweep.speedup_mismatch": "a sweep arm's speedup differs from the verdict's",
    "sweep.verdict_mismatch": "a sweep arm's outcome is not the verdict of its samples",
    "sweep.config_hash_mismatch": "a sweep arm's config hash is not its config's",
    "sweep.noise_band_mismatch": "a sweep key's noise band differs from its copies'",
    "sweep.best_mismatch": "a sweep key's best candidate is not the recomputed one",
    "sweep.geomean_mismatch": "a sweep geometric mean differs from the recomputed one",
    "sweep.count_mismatch": "a sweep count (keys, families, arms, faster) differs",
    "sweep.field_mismatch": "another sweep field or setting differs from mxdb's",
    "sweep.report_mismatch": "report/sweep.md is not the rendering of sweep.json",
    "perfmodel.fingerprint_mismatch": "a performance model names another environment than its bundle",
    "perfmodel.sweep_missing": "a sweep bundle a performance model was trained on is not beside it",
    "perfmodel.sweep_mismatch": "a sweep a performance model names has another SHA-256, schema or "
    "environment, or is named twice",
    "perfmodel.check_missing": "the check bundle a performance model was calibrated on is not "
    "beside it",
    "perfmodel.check_mismatch": "the check a performance model was calibrated on has another "
    "SHA-256, schema, environment or sweep, or did not time the model's choices",
    "perfmodel.model_invalid": "a performance model's forest is malformed (tree arrays, children, "
    "feature indices)",
    "perfmodel.feature_mismatch": "a performance model's feature names are not mxdb's",
    "perfmodel.family_mismatch": "a performance model's shape families are not its training keys'",
    "perfmodel.gate_mismatch": "a performance model's gate is not mxdb's",
    "perfmodel.model_mismatch": "a performance model's trees differ from training again",
    "perfmodel.calibration_mismatch": "a performance model's calibration differs from its "
    "recomputation",
    "perfmodel.score_mismatch": "a model class's score or the chosen class differs from its "
    "recomputation",
    "perfmodel.outcome_mismatch": "a leave-one-family-out outcome differs from its recomputation",
    "perfmodel.training_mismatch": "another training figure (rows, keys, families) differs",
    "perfmodel.field_mismatch": "another performance-model field differs from mxdb's",
    "perfmodel.report_mismatch": "report/model.md is not the rendering of model.json",
}


@dataclass(frozen=True, slots=True)
class Finding:
    """One problem: which check, where (file and field), what was expected and what was found."""

    check: str
    file: str
    field: str
    expected: str
    found: str
    message: str

    def to_dict(self) -> dict[str, str]:
        return asdict(self)

    def line(self) -> str:
        where = f"{self.file}: {self.field}" if self.field else self.file
        return (
            f"{where}: [{self.check}] {self.message} (expected {self.expected}; found {self.found})"
        )


@dataclass(frozen=True)
class AuditOptions:
    """How to audit: trusted public keys (signatures then required) and float tolerance."""

    trusted_keys: Path | None = None
    rel_tol: float = stats.REL_TOL
    abs_tol: float = stats.ABS_TOL
    max_schema_errors: int = 5


@dataclass(frozen=True)
class BundleResult:
    """The audit of one bundle."""

    path: str
    bundle_id: str | None
    milestone: str | None
    fingerprint_hash: str | None
    runs: int
    findings: tuple[Finding, ...]
    #: store-export entries this bundle's runs back, for the cross-bundle checks
    backed: tuple[dict[str, Any], ...] = ()
    #: entries whose evidence run is not in this bundle: (file, field, entry), resolved
    #: against the other bundles of the same audit
    deferred: tuple[tuple[str, str, dict[str, Any]], ...] = ()
    #: the entries this bundle's runs back, recomputed (key, figures, validation), each naming
    #: the run it rests on (``evidence``)
    backing: tuple[dict[str, Any], ...] = ()
    #: the entries this bundle's decode-op decisions back (``mxdb.audit.decode.decisions``)
    decode: tuple[dict[str, Any], ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "bundle_id": self.bundle_id,
            "milestone": self.milestone,
            "fingerprint_hash": self.fingerprint_hash,
            "runs": self.runs,
            "ok": not self.findings,
            "findings": len(self.findings),
        }


@dataclass(frozen=True)
class AuditResult:
    """The audit of every PATH: its bundles and all findings (bundle-level and cross-bundle)."""

    bundles: tuple[BundleResult, ...]
    findings: tuple[Finding, ...] = field(default=())

    @property
    def ok(self) -> bool:
        return not self.findings

    def to_dict(self) -> dict[str, Any]:
        return {
            "bundles": [b.to_dict() for b in self.bundles],
            "findings": [f.to_dict() for f in self.findings],
            "ok": self.ok,
        }
