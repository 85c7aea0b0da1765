"""The GPU-free audit of evidence bundles: ``audit_paths`` and the findings it returns."""

from __future__ import annotations

from mxdb.audit.checks import audit_bundle, audit_paths, find_bundles
from mxdb.audit.findings import CHECKS, AuditOptions, AuditResult, BundleResult, Finding

__all__ = [
    "CHECKS",
    "AuditOptions",
    "AuditResult",
    "BundleResult",
    "Finding",
    "audit_bundle",
    "audit_paths",
    "find_bundles",
]
