"""How the audit compares a claimed figure with the one it recomputes.

One rule for every kind of evidence: :func:`same`, with the audit's tolerances
(``AuditOptions.rel_tol`` / ``abs_tol``, passed on as ``tol``).
"""

from __future__ import annotations

import math
from typing import Any

from mxdb.evidence.stats import ABS_TOL, REL_TOL

#: ``(rel_tol, abs_tol)`` as the audit options give them.
Tol = tuple[float, float]
#: The default tolerances (those of :class:`mxdb.audit.findings.AuditOptions`).
TOL: Tol = (REL_TOL, ABS_TOL)


def same(a: Any, b: Any, rel: float, abs_: float) -> bool:
    """Deep equality with numbers compared within tolerance.

    Booleans equal only booleans (``True`` is not ``1``); NaN equals only NaN; ``None`` equals
    only ``None``; mappings need the same keys and sequences (a list, or the tuple a
    recomputation may give) the same length, their items compared by this rule; anything else
    must be equal and of the same type.
    """
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        fa, fb = float(a), float(b)
        if math.isnan(fa) or math.isnan(fb):
            return math.isnan(fa) and math.isnan(fb)
        return math.isclose(fa, fb, rel_tol=rel, abs_tol=abs_)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k], rel, abs_) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y, rel, abs_) for x, y in zip(a, b, strict=True))
    return bool(a == b) and type(a) is type(b)
