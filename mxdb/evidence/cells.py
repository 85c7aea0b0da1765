"""How the evidence reports write a figure into a Markdown table cell."""

from __future__ import annotations

from typing import Any


def cell(v: Any, spec: str = ".3f") -> str:
    """``v`` formatted by ``spec`` (non-finite floats as ``inf``/``nan``), ``-`` for None."""
    return "-" if v is None else format(v, spec)
