"""Correctness thresholds per dtype: defined once, in :mod:`mxdb.verdict`, and re-exported here.

A candidate's output (fp16/bf16) is compared with a float32 PyTorch computation of the same
layer: ``max_abs_err = max |out - ref|`` and ``rel_err = max_abs_err / max |ref|``; it passes
when both are finite and within the dtype's thresholds.
"""

from __future__ import annotations

from mxdb.verdict import THRESHOLDS, Threshold, passes

__all__ = ["THRESHOLDS", "Threshold", "passes"]
