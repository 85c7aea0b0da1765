"""Test helper: load a script of ``benchmarks/`` as a module (the folder is not a package)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def load(script: str, name: str | None = None) -> Any:
    """``benchmarks/<script>`` executed as a fresh module (named ``name``, default from it)."""
    path = BENCHMARKS / script
    spec = importlib.util.spec_from_file_location(name or f"bench_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
