"""Test helpers for tampering with a bundle's claims as a careful forger would.

``edit_claim`` changes one document, re-renders its kind's report (where the kind declares
one, :data:`mxdb.audit.kinds.KINDS`) and re-manifests, so that only the semantic checks of
the figures can catch the change; ``audit_codes`` is the set of finding codes an audit gives.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mxdb.audit import CHECKS, audit_paths
from mxdb.audit.kinds import KINDS
from mxdb.evidence.files import dumps
from mxdb.evidence.writer import write_manifest


def edit_claim(root: Path, rel: str, change: Callable[[Any], object]) -> None:
    """Apply ``change`` to the JSON document ``rel`` of bundle ``root``, re-render its report
    and re-write the manifest."""
    doc = json.loads((root / rel).read_text())
    change(doc)
    (root / rel).write_bytes(dumps(doc))
    kind = next((k for k in KINDS if k.document == rel), None)
    if kind is not None and kind.report is not None:
        name, render = kind.report
        try:
            (root / name).write_text(render(doc))
        except (KeyError, TypeError, ValueError, AttributeError):
            pass  # a document its report cannot show: the audit says so as well
    m = json.loads((root / "manifest.json").read_text())
    write_manifest(root, bundle_id=m["bundle_id"], milestone=m["milestone"])


def audit_codes(root: Path) -> set[str]:
    """The codes of an audit's findings on ``root`` (each one a code mxdb documents)."""
    res = audit_paths([root])
    for f in res.findings:
        assert f.check in CHECKS, f
    return {f.check for f in res.findings}
