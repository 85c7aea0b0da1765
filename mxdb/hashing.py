"""Content identities: the SHA-256 of a value's canonical JSON, 16 hex digits.

Configs, fingerprints, traces and workloads are all named this way, so a value
hashes the same wherever it is written or read.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any


def canonical_hash(data: Any) -> str:
    """SHA-256 of ``data`` as JSON with sorted keys and no spaces, first 16 hex digits."""
    text = json.dumps(data, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]
