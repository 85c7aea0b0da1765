"""Online self-healing: notice when a dispatched config degrades, switch, and switch back.

A pure state machine over injected timings (microseconds); nothing here touches a GPU.  The
FlagGems hook (``mxdb.runtime.hook``) feeds it the timings of a sample of calls, measured with
CUDA events and read later, and applies its decisions as dispatcher overrides.

Per key ``(shape, routing class)`` the machine holds the ranked candidates the dispatcher
admits (``Dispatcher.alternatives``: index 0 is the store's answer) and, for each, a baseline:
the entry's recorded median, or, when none is recorded (or ``baseline="calibrate"``), the median
of its first ``window`` in-situ samples.  The rules, applied to each sample of candidate ``i``:

1. *Judge* (``i`` is the active choice, not cooling down): the median of its last ``window``
   samples (at least ``(window + 1) // 2`` of them) over its baseline is a *strike* when above
   ``degrade_ratio``; any other sample resets the strikes.  ``degrade_samples`` consecutive
   strikes *demote* ``i``: the next-ranked candidate that is not demoted becomes active.
2. *Exhausted*: when every candidate is demoted the slowdown is not the config's (a throttled
   or shared GPU slows them all), so the original becomes active again, the demotions are
   forgotten and no move is made for ``cooldown`` samples.
3. *Probe*: while a better-ranked candidate is demoted, every ``probe_every``-th sampled call
   runs the best demoted candidate instead of the active one.  ``recover_samples``
   consecutive probes within ``recover_ratio`` of its baseline *recover* it: it becomes
   active again when it outranks the active one.  A slow probe resets the count.

Samples of a candidate that is neither active nor probed (timings still in flight when the
choice changed) only enter its window.
"""

from __future__ import annotations

import statistics
import threading
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

from mxdb.decision import Decision
from mxdb.errors import UsageError

#: How a candidate's baseline is chosen.
BASELINE_MODES = ("auto", "recorded", "calibrate")


@dataclass(frozen=True)
class HealingOptions:
    """The parameters of the self-healing rules (see the module docstring)."""

    sample_every: int = 64
    window: int = 5
    degrade_ratio: float = 1.5
    degrade_samples: int = 3
    recover_ratio: float = 1.2
    recover_samples: int = 2
    probe_every: int = 8
    cooldown: int = 32
    baseline: str = "auto"

    def __post_init__(self) -> None:
        for name in ("sample_every", "window", "degrade_samples", "recover_samples", "probe_every"):
            if getattr(self, name) < 1:
                raise UsageError(f"healing option {name} must be >= 1, got {getattr(self, name)}")
        if self.cooldown < 0:
            raise UsageError(f"healing option cooldown must be >= 0, got {self.cooldown}")
        if not self.degrade_ratio > 1.0 or not self.recover_ratio >= 1.0:
            raise UsageError(
                f"healing needs degrade_ratio > 1 and recover_ratio >= 1; got "
                f"{self.degrade_ratio} and {self.recover_ratio}"
            )
        if self.recover_ratio > self.degrade_ratio:
            raise UsageError(
                f"recover_ratio ({self.recover_ratio}) must not exceed degrade_ratio "
                f"({self.degrade_ratio}), or a choice could flap between the two"
            )
        if self.baseline not in BASELINE_MODES:
            raise UsageError(
                f"healing baseline mode {self.baseline!r} unknown; use {', '.join(BASELINE_MODES)}"
            )


@dataclass(frozen=True)
class Transition:
    """One change of a key's active choice (or a calibration), for logs and evidence."""

    sample: int
    key: Any
    kind: str  # "calibrated" | "demote" | "exhausted" | "recover"
    from_index: int
    to_index: int
    ratio: float | None

    def to_dict(self) -> dict[str, Any]:
        return {
            "sample": self.sample,
            "key": repr(self.key),
            "kind": self.kind,
            "from": self.from_index,
            "to": self.to_index,
            "ratio": None if self.ratio is None else round(self.ratio, 4),
        }


@dataclass
class _Key:
    candidates: list[Decision]
    baselines: list[float | None]
    windows: list[deque[float]]
    active: int = 0
    strikes: int = 0
    demoted: set[int] = field(default_factory=set)
    good_probes: int = 0
    since_probe: int = 0
    cooldown_left: int = 0
    samples: int = 0


OnChange = Callable[[Hashable, Decision, bool], None]


class Healer:
    """The self-healing state machine for many keys (thread-safe; not on the hot path).

    ``on_change(key, decision, is_original)`` is called, under the healer's lock, whenever a
    key's active choice changes; the hook turns it into a dispatcher override (cleared when
    ``is_original``).
    """

    def __init__(self, options: HealingOptions | None = None, on_change: OnChange | None = None):
        self.options = options or HealingOptions()
        self.on_change = on_change
        self._keys: dict[Hashable, _Key] = {}
        self._lock = threading.Lock()
        self.transitions: deque[Transition] = deque(maxlen=10_000)

    # -- registration -----------------------------------------------------------------

    def track(
        self,
        key: Hashable,
        candidates: Sequence[Decision],
        recorded_us: Sequence[float | None] = (),
    ) -> None:
        """Start watching ``key`` with ``candidates`` (best first) and their recorded medians."""
        if not candidates or any(c.config is None for c in candidates):
            raise UsageError("healing needs at least one dispatched (non-fallback) candidate")
        recorded = list(recorded_us) + [None] * (len(candidates) - len(recorded_us))
        mode = self.options.baseline
        baselines = [
            None if mode == "calibrate" or r is None or not r > 0 else float(r) for r in recorded
        ]
        win = self.options.window
        with self._lock:
            self._keys[key] = _Key(
                candidates=list(candidates),
                baselines=baselines,
                windows=[deque(maxlen=win) for _ in candidates],
            )

    def tracked(self, key: Hashable) -> bool:
        return key in self._keys

    def forget(self, key: Hashable) -> None:
        with self._lock:
            self._keys.pop(key, None)

    # -- per sampled call ------------------------------------------------------------------

    def plan(self, key: Hashable) -> tuple[int, Decision]:
        """The candidate a sampled call of ``key`` runs: the active one, or a due probe."""
        with self._lock:
            st = self._keys[key]
            better = [i for i in st.demoted if i < st.active]
            if better:
                st.since_probe += 1
                if st.since_probe >= self.options.probe_every:
                    st.since_probe = 0
                    i = min(better)
                    return i, st.candidates[i]
            return st.active, st.candidates[st.active]

    def record(self, key: Hashable, index: int, elapsed_us: float) -> None:
        """Feed one timing of candidate ``index`` of ``key`` and apply the rules."""
        opts = self.options
        with self._lock:
            st = self._keys.get(key)
            if st is None or not 0 <= index < len(st.candidates) or not elapsed_us > 0:
                return
            st.samples += 1
            window = st.windows[index]
            window.append(float(elapsed_us))
            base = st.baselines[index]
            if base is None:
                if opts.baseline != "recorded" and len(window) >= opts.window:
                    st.baselines[index] = statistics.median(window)
                    self._log(st, key, "calibrated", index, index, None)
                return
            if index in st.demoted:
                self._probe(st, key, index, elapsed_us / base)
                return
            if index != st.active:
                return
            if st.cooldown_left > 0:
                st.cooldown_left -= 1
                return
            if len(window) < (opts.window + 1) // 2:
                return
            ratio = statistics.median(window) / base
            st.strikes = st.strikes + 1 if ratio > opts.degrade_ratio else 0
            if st.strikes >= opts.degrade_samples:
                self._demote(st, key, index, ratio)

    # -- transitions -------------------------------------------------------------------

    def _demote(self, st: _Key, key: Hashable, index: int, ratio: float) -> None:
        st.demoted.add(index)
        nxt = next((i for i in range(len(st.candidates)) if i not in st.demoted), None)
        if nxt is None:
            st.demoted.clear()
            st.cooldown_left = self.options.cooldown
            self._switch(st, key, "exhausted", index, 0, ratio)
        else:
            self._switch(st, key, "demote", index, nxt, ratio)

    def _probe(self, st: _Key, key: Hashable, index: int, ratio: float) -> None:
        if ratio <= self.options.recover_ratio:
            st.good_probes += 1
        else:
            st.good_probes = 0
        if st.good_probes >= self.options.recover_samples:
            st.demoted.discard(index)
            st.good_probes = 0
            if index < st.active:
                self._switch(st, key, "recover", st.active, index, ratio)

    def _switch(
        self, st: _Key, key: Hashable, kind: str, old: int, new: int, ratio: float | None
    ) -> None:
        st.active = new
        st.strikes = 0
        st.since_probe = 0
        st.good_probes = 0
        # The new active choice is judged on fresh samples only.
        st.windows[new].clear()
        self._log(st, key, kind, old, new, ratio)
        if self.on_change is not None:
            self.on_change(key, st.candidates[new], new == 0)

    def _log(
        self, st: _Key, key: Hashable, kind: str, old: int, new: int, ratio: float | None
    ) -> None:
        self.transitions.append(Transition(st.samples, key, kind, old, new, ratio))

    # -- inspection --------------------------------------------------------------------

    def active(self, key: Hashable) -> int:
        """The index of the key's active candidate (0: the store's answer)."""
        with self._lock:
            return self._keys[key].active

    def state(self, key: Hashable) -> dict[str, Any]:
        """The key's state as plain data (for reports and tests)."""
        with self._lock:
            st = self._keys[key]
            return {
                "active": st.active,
                "demoted": sorted(st.demoted),
                "strikes": st.strikes,
                "cooldown_left": st.cooldown_left,
                "samples": st.samples,
                "baselines_us": list(st.baselines),
                "medians_us": [statistics.median(w) if w else None for w in st.windows],
                "config_hashes": [c.config.hash if c.config else None for c in st.candidates],
            }

    def keys(self) -> list[Hashable]:
        with self._lock:
            return list(self._keys)
