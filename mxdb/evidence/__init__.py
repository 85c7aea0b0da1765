"""Evidence bundles: the file formats, the statistics, the writer the tuner uses.

See ``mxdb.evidence.models`` for the layout and ``mxdb.evidence.writer`` for the API.
"""

from __future__ import annotations

from mxdb.evidence.models import SCHEMA_VERSION, RunRecord
from mxdb.evidence.summary import build_summary, summarize
from mxdb.evidence.thresholds import THRESHOLDS
from mxdb.evidence.writer import BundleWriter, make_correctness, make_timing

__all__ = [
    "SCHEMA_VERSION",
    "THRESHOLDS",
    "BundleWriter",
    "RunRecord",
    "build_summary",
    "make_correctness",
    "make_timing",
    "summarize",
]
