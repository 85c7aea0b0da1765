"""The runtime side of mxdb: the FlagGems hook, drift governance and online self-healing.

``mxdb.runtime.healing`` and ``mxdb.runtime.drift`` are GPU-free.  ``mxdb.runtime.hook``
imports torch and flag_gems only inside ``install()``; importing this package imports neither.
"""

from __future__ import annotations
