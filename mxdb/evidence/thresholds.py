"""Correctness thresholds per dtype, shared by the tuner (to judge) and the auditor (to re-judge).

A candidate's output (fp16/bf16) is compared with a float32 PyTorch computation of the same
layer.  Two figures are recorded:

- ``max_abs_err``: ``max |out - ref|`` over all output elements;
- ``rel_err``: ``max_abs_err / max |ref|``, the error relative to the output's scale.

A result passes when both are finite and within the dtype's thresholds (``<=``).  The absolute
thresholds leave room over a few units in the last place at output magnitudes around 1-8
(fp16 has 10 mantissa bits, bf16 7): the C500 M0 evidence measured 0.0009765625 (fp16) and
0.0078125 (bf16).
"""

from __future__ import annotations

import math
from typing import NamedTuple


class Threshold(NamedTuple):
    """The largest accepted absolute and relative errors for one dtype."""

    max_abs: float
    max_rel: float


#: The table, keyed by canonical dtype name (see ``mxdb.shapes.canonical_dtype``).
THRESHOLDS: dict[str, Threshold] = {
    "fp16": Threshold(max_abs=1e-2, max_rel=1e-2),
    "bf16": Threshold(max_abs=6.25e-2, max_rel=5e-2),
    "fp32": Threshold(max_abs=1e-4, max_rel=1e-5),
}


def passes(dtype: str, max_abs_err: float | None, rel_err: float | None) -> bool:
    """Whether errors measured for ``dtype`` pass its thresholds."""
    t = THRESHOLDS[dtype]
    if max_abs_err is None or rel_err is None:
        return False
    if not (math.isfinite(max_abs_err) and math.isfinite(rel_err)):
        return False
    return 0 <= max_abs_err <= t.max_abs and 0 <= rel_err <= t.max_rel
