"""Every kind of evidence the audit knows, by declaration (:class:`mxdb.audit.claims.ClaimKind`).

A new kind of evidence adds its declaration here; :mod:`mxdb.audit.checks` audits each one
whose document a bundle holds with :func:`mxdb.audit.claims.audit_claim`.
"""

from __future__ import annotations

from mxdb.audit import lean_layer, peers, tuning_cost
from mxdb.audit.claims import ClaimKind

KINDS: tuple[ClaimKind, ...] = (
    peers.KIND,
    lean_layer.KIND,
    tuning_cost.KIND,
)
