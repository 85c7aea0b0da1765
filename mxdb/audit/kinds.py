"""Every kind of evidence the audit knows, by declaration (:class:`mxdb.audit.claims.ClaimKind`).

A new kind of evidence adds its declaration here; :mod:`mxdb.audit.checks` audits each one
whose document a bundle holds with :func:`mxdb.audit.claims.audit_claim`.
"""

from __future__ import annotations

from mxdb.audit import (
    decode,
    healing,
    lean_layer,
    peers,
    perfcheck,
    perfmodel,
    serving,
    stages,
    survey,
    sweep,
    tuning_cost,
)
from mxdb.audit.claims import ClaimKind

KINDS: tuple[ClaimKind, ...] = (
    decode.KIND,
    healing.KIND,
    lean_layer.KIND,
    peers.KIND,
    perfcheck.KIND,
    perfmodel.KIND,
    serving.KIND,
    stages.KIND,
    survey.KIND,
    sweep.KIND,
    tuning_cost.KIND,
)
