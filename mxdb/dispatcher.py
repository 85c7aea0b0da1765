"""Confidence dispatch: the verified config for a call, or the safe fallback and why.

The hot path is one dict lookup keyed by ``(shape, routing_class)``.  A miss
resolves the key from an in-memory copy of the shape family's store rows (one
query per family, then cached).  Store refreshes happen off the call path: a
background thread polls the store's generation counter every
``refresh_interval`` seconds and, when it changed, re-reads the families and
re-resolves the keys already cached, then swaps the new caches in at once; a
call never waits for the store.  (``refresh_interval=0`` asks for the old
behaviour: a synchronous check on every call, for tests and tools.)

The rule (DESIGN section 6): an entry may answer only when it is verified, its
environment fingerprint matches the current one under the policy, it has the
same op, dtype and shape family, its token count is within ``neighbour_ratio``
of the call's, and its routing class is the same or adjacent.  A ``baseline``
entry (the tuner measured that key and nothing beat FlagGems' own choice) takes
part in that choice like a verified one, and outranks verified entries of the
same key (traces of one routing class that disagree); when it is the closest,
the answer is the fallback (FlagGems' choice, measured there against every candidate, the
incumbent's table row among them) with reason ``baseline_measured``.  A
``parity`` entry (a peer's table row, or the search's choice, at parity with FlagGems' choice on
every routing instance measured, and faster pooled over them) answers its own key only, with
reason ``parity``;
it ranks below a baseline record and above verified entries of the same key.

With a performance model (``DispatchOptions(model=)``: a ``model.json`` written by ``mxdb model
train``, or ``$MXDB_MODEL`` for the dispatcher ``configure`` builds), a key the store cannot
answer is asked of the model only where the store has not measured the shape family here (no
row of any status for the family and dtype whose fingerprint matches the current one under the
policy), the dtype is bf16 (what the model was trained on) and the model's fingerprint matches
the current one under the same policy.  The model's answer, when its gate admits it, is level
``predicted`` (reason ``predicted``, confidence the model's calibrated one, no entry); a refused
choice is the fallback ``prediction_not_confident`` and a model that fails while answering the
fallback ``model_error`` (never an exception).  The model is asked once per key: its decision is
cached like every other one, and kept across store refreshes (a model's answer depends on the
key alone).  The model's choice answers only where it is also predicted at least the gate's
speedup over the incumbent's table row (else ``prediction_not_over_incumbent``).

What neither the store nor the model answers (other than a baseline record's answer) is
answered by the incumbent (:mod:`mxdb.incumbent`):
the row of vLLM's table for this device and shape (imported into the store, else shipped with
mxdb), at level ``incumbent`` with the reason the store gave and ``source`` naming the table
and row; only where no table covers the device and shape is the answer the fallback (no
config: FlagGems' default).  ``DispatchOptions(incumbent=False)`` answers the fallback instead.

Nothing a store or a model file holds makes a call raise or hang.  A model file is checked once,
when it is loaded (:class:`~mxdb.costmodel.model.PerfModel`: trees acyclic, of bounded depth and
size, of the right shape), so that asking it is bounded.  A store that cannot be read (a file
overwritten, a table dropped, a database gone) answers the fallback ``store_error``, retried at
the next refresh; a stored row that cannot be read (a token count that is not an integer, a
config that does not parse) is never answered (``invalid_entry``).  The process-wide dispatcher
whose ``$MXDB_MODEL`` cannot be loaded logs a warning and answers the keys the model would have
been asked with the fallback ``model_unavailable``; one whose default store cannot be opened
answers ``store_error``.
"""

from __future__ import annotations

import bisect
import json
import logging
import math
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from mxdb.decision import EXACT, INCUMBENT, NEIGHBOUR, PREDICTED, Decision, fallback
from mxdb.errors import MxdbError, UsageError
from mxdb.models import ADJACENT_CLASSES, DECIDED_STATUSES, ROUTING_CLASSES, Fingerprint
from mxdb.ops import parse_config
from mxdb.shapes import MOE_OP, MoEShape

if TYPE_CHECKING:
    from mxdb.configs import KernelConfig
    from mxdb.costmodel.model import PerfModel
    from mxdb.incumbent import Incumbent
    from mxdb.store import DispatchRow, Store


#: Confidence of an entry recorded before held-out validation, at its own key; every other
#: answer's confidence is a measured fraction of held-out routing instances won.
CONFIDENCE_EXACT = 1.0
#: The dtype a performance model answers for (the dtype its sweeps timed).
MODEL_DTYPE = "bf16"
#: The environment variable naming the performance model of the default options.
MODEL_ENV = "MXDB_MODEL"

log = logging.getLogger(__name__)
_T = TypeVar("_T")


class _StoreFailed(Exception):
    """A store read failed while resolving a key: the key's answer is ``store_error``."""


def _row_ok(row: DispatchRow) -> bool:
    """Whether a stored row's fields have the types the rule compares (a row edited behind
    mxdb's back may hold any SQLite value)."""
    return (
        type(row.tokens) is int
        and row.tokens >= 1
        and type(row.id) is int
        and isinstance(row.routing_class, str)
        and (row.speedup is None or type(row.speedup) in (int, float))
    )


@dataclass(frozen=True)
class DispatchOptions:
    """How strict the dispatcher is, how often it looks for store changes, and the performance
    model (if any) that answers shape families the store has not measured.

    ``model`` is a path to a ``model.json`` (or the bundle folder holding it) or a loaded
    :class:`mxdb.costmodel.model.PerfModel`; a path is loaded here, and a model that cannot be
    loaded is a :class:`~mxdb.errors.UsageError` naming the path and the problem.  After
    construction ``model`` is the loaded model (or None).
    """

    policy: str = "strict"
    neighbour_ratio: float = 2.0
    refresh_interval: float = 1.0
    default_routing_class: str = "uniform"
    model: str | os.PathLike[str] | PerfModel | None = field(default=None, hash=False, repr=False)
    #: answer what nothing measured answers with the incumbent's table row (level
    #: ``incumbent``); False: with FlagGems' default (a fallback), as before the incumbent
    incumbent: bool = True

    def __post_init__(self) -> None:
        if self.model is not None:
            object.__setattr__(self, "model", load_model(self.model))
        if self.policy not in ("strict", "device"):
            raise UsageError(f"fingerprint policy {self.policy!r} unknown; use strict or device")
        if not self.neighbour_ratio >= 1.0:
            raise UsageError(f"neighbour_ratio must be >= 1, got {self.neighbour_ratio}")
        if self.refresh_interval < 0:
            raise UsageError(f"refresh_interval must be >= 0, got {self.refresh_interval}")
        if self.default_routing_class not in ROUTING_CLASSES:
            raise UsageError(
                f"default routing class {self.default_routing_class!r} unknown; "
                f"use one of {', '.join(ROUTING_CLASSES)}"
            )

    @property
    def perf_model(self) -> PerfModel | None:
        """The loaded performance model, or None."""
        if self.model is None:
            return None  # without importing the model's code (and numpy)
        from mxdb.costmodel.model import PerfModel

        return self.model if isinstance(self.model, PerfModel) else None


def load_model(model: str | os.PathLike[str] | PerfModel) -> PerfModel:
    """A performance model from a ``model.json`` path (or its bundle folder), checked for what
    the dispatcher needs; a loaded :class:`~mxdb.costmodel.model.PerfModel` is checked as is.

    Raises :class:`~mxdb.errors.UsageError` naming the path and what is wrong (the checks:
    :class:`~mxdb.costmodel.model.PerfModel`).
    """
    from mxdb.costmodel.model import PerfModel

    if isinstance(model, PerfModel):
        loaded = model
    elif isinstance(model, (str, os.PathLike)):
        path = Path(model)
        if path.is_dir() and (path / "model.json").is_file():
            path = path / "model.json"
        loaded = PerfModel.load(path)  # checked once, here: answering is then bounded
    else:
        raise UsageError(
            "DispatchOptions(model=) takes a path to a performance model's model.json or a "
            f"loaded mxdb.costmodel.model.PerfModel; got {type(model).__name__}"
        )
    kind = loaded.forest.get("kind")
    if kind != "forest":  # the confidence is the spread over a forest's trees
        raise UsageError(
            f"performance model {loaded.path or '(given loaded)'}: its model is of kind "
            f"{kind!r}; answering needs a 'forest'"
        )
    return loaded


@dataclass
class _Family:
    """The store rows of one (op, dtype, family), parsed once."""

    rows: list[DispatchRow]
    #: routing class -> (sorted token counts, the best eligible row at each); None until built
    index: dict[str, tuple[list[int], list[DispatchRow]]] | None = None
    empty_reason: str = "no_verified_entry"
    #: whether a row of any status matches the current fingerprint; None until worked out
    measured_here: bool | None = None


#: ``Dispatcher._model_fp`` before the model bundle's fingerprint was looked for
_UNREAD: Any = object()


class Dispatcher:
    """Answers ``dispatch(shape, routing)`` from a store for one environment fingerprint."""

    def __init__(
        self,
        store: Store | None,
        fingerprint: Fingerprint | None,
        options: DispatchOptions | None = None,
    ) -> None:
        self.store = store
        self.fingerprint = fingerprint
        self.options = options or DispatchOptions()
        self._lock = threading.RLock()
        self._cache: dict[tuple[Any, Any], Decision] = {}
        self._families: dict[tuple[str, str, str], _Family] = {}
        self._configs: dict[tuple[str, str], Any] = {}
        self._fingerprints: dict[str, Fingerprint] | None = None
        self._match_cache: dict[str, bool] = {}
        #: entry id -> (confidence, held-out validation record), read on misses only
        self._validations: dict[int, tuple[float | None, list[dict[str, Any]] | None]] = {}
        #: (shape, routing class) -> decision put in front of the store's answer (self-healing);
        #: kept in the per-key cache itself, so a call with no override costs nothing more.
        self._overrides: dict[tuple[Any, Any], Decision] = {}
        #: the performance model, and its decision per (shape, routing class): asked once a key,
        #: kept across refreshes and invalidations (its answer depends on the key alone)
        self._model = self.options.perf_model
        self._predictions: dict[tuple[Any, str], Decision] = {}
        #: (dtype, device name) -> the vLLM tables imported into the store for it
        self._imported: dict[tuple[str, str | None], Any] = {}
        #: the components of the model's fingerprint, from its bundle's fingerprint.json
        self._model_fp: Fingerprint | None = _UNREAD
        #: why the store or the model could not be opened (default_dispatcher), else None:
        #: the keys they would answer are the fallbacks store_error and model_unavailable
        self._unavailable: str | None = None
        self._model_unavailable: str | None = None
        #: keys answered ``store_error``: dropped at the next refresh, so they are retried
        self._errored: set[tuple[Any, Any]] = set()
        self._generation = self._read_generation()
        #: refresh_interval == 0: check the generation synchronously on every call
        self._sync = self.options.refresh_interval == 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if store is not None and not self._sync:
            self._start_refresher()

    # -- hot path -----------------------------------------------------------------

    def dispatch(self, shape: Any, routing: Any = None) -> Decision:
        """The decision for ``shape`` under ``routing`` (a routing class name, features, or None)."""
        if self._sync:
            self._poll()
        try:
            decision = self._cache.get((shape, routing))
        except TypeError:  # an unhashable routing (e.g. a dict): answer without caching
            return self.resolve(shape, routing)
        if decision is None:
            decision = self._miss(shape, routing)
        return decision

    __call__ = dispatch

    # -- cache maintenance ------------------------------------------------------------

    def _poll(self) -> None:
        """Synchronous check (``refresh_interval=0`` only): drop the caches on a change."""
        with self._lock:
            if self.store is None:
                return
            self._retry_errored()
            generation = self._read_generation()
            if generation != self._generation:
                self._generation = generation
                self._invalidate()

    def _read_generation(self) -> int:
        """The store's generation, or -1 when it cannot be read (the keys resolved meanwhile
        answer ``store_error``; a store readable again differs, and drops them)."""
        try:
            return self.store.generation() if self.store is not None else 0
        except Exception:
            return -1

    def _retry_errored(self) -> None:
        """Drop the cached ``store_error`` decisions, so that their keys read the store again."""
        if self._errored:
            for key in self._errored:
                if key not in self._overrides:
                    self._cache.pop(key, None)
            self._errored = set()

    def _start_refresher(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(
            target=_refresh_loop,
            args=(weakref.ref(self), self._stop, self.options.refresh_interval),
            name="mxdb-dispatch-refresh",
            daemon=True,
        )
        self._thread.start()
        _live.add(self)

    def close(self) -> None:
        """Stop the background refresher (the dispatcher keeps answering from its caches)."""
        self._stop.set()

    def refresh_now(self) -> bool:
        """One background refresh step; returns whether the store had changed.

        Runs on the refresher thread: every query and every re-resolution happens here,
        into new caches that are swapped in under the lock at the end, so calls keep
        being answered from the old caches meanwhile.
        """
        if self.store is None:
            return False
        if self._errored:
            with self._lock:
                self._retry_errored()
        generation = self.store.generation()
        if generation == self._generation:
            return False
        store = self.store
        with self._lock:
            families = dict(self._families)
            old_fps = self._fingerprints
            cache = {k: v for k, v in self._cache.items() if k not in self._overrides}
        fps = store.fingerprints() if old_fps is not None else None
        shadow = Dispatcher(None, self.fingerprint, replace(self.options, refresh_interval=0))
        shadow.store = store
        shadow._configs = self._configs  # keyed by config hash: never change
        shadow._predictions = self._predictions  # keyed by (shape, class): never change
        shadow._model_fp = self._model_fp
        shadow._fingerprints = fps
        unchanged: set[tuple[str, str, str]] = set()
        for key, fam in families.items():
            rows = store.family_rows(*key)
            if rows == fam.rows:
                shadow._families[key] = fam  # its index and decisions stand
                unchanged.add(key)
            else:
                shadow._families[key] = _Family(rows=rows)
            time.sleep(0)  # let calls in other threads run between queries
        if fps != old_fps:
            unchanged = set()
            shadow._families = {k: _Family(rows=f.rows) for k, f in shadow._families.items()}
        else:
            shadow._match_cache = dict(self._match_cache)
        for n, ((shape, routing), decision) in enumerate(cache.items()):
            if (shape.op, shape.dtype, shape.family) in unchanged:
                shadow._cache[(shape, routing)] = decision
            else:
                shadow._miss(shape, routing)
                if n % 16 == 15:
                    time.sleep(0)
        with self._lock:
            self._cache = {**shadow._cache, **self._overrides}
            self._families = shadow._families
            self._fingerprints = shadow._fingerprints
            self._match_cache = shadow._match_cache
            self._validations = shadow._validations
            self._imported = shadow._imported
            self._errored |= shadow._errored
            self._generation = generation
        return True

    def _invalidate(self) -> None:
        self._cache = dict(self._overrides)
        self._families = {}
        self._fingerprints = None
        self._match_cache = {}
        self._validations = {}
        self._imported = {}

    def refresh(self) -> None:
        """Drop every cached decision now (the next calls re-read the store)."""
        with self._lock:
            self._generation = self._read_generation()
            self._errored = set()
            self._invalidate()

    # -- overrides and ranked alternatives (online self-healing) ---------------------------

    def set_override(self, shape: Any, routing: Any, decision: Decision | None) -> None:
        """Answer ``dispatch(shape, routing)`` with ``decision`` until cleared (``None`` clears).

        ``routing`` is the exact key callers pass (a routing class name or None).  The
        override lives in the per-key cache, so the hot path is unchanged; it survives
        refreshes and store changes until cleared.
        """
        key = (shape, routing)
        with self._lock:
            if decision is None:
                if self._overrides.pop(key, None) is not None:
                    self._cache.pop(key, None)
            else:
                self._overrides[key] = decision
                self._cache[key] = decision

    def overrides(self) -> dict[tuple[Any, Any], Decision]:
        """The overrides in force, by ``(shape, routing)``."""
        with self._lock:
            return dict(self._overrides)

    def alternatives(self, shape: Any, routing: Any = None, limit: int = 8) -> list[Decision]:
        """Dispatchable decisions for the key, best first, one per distinct config.

        The first is what ``resolve`` answers; the rest are the other verified entries that
        the same rule admits (matching fingerprint, token count within the neighbourhood,
        same or adjacent routing class), ranked by confidence, then recorded speedup.
        Empty when the store has no confident answer (the caller uses FlagGems' choice).
        """
        first = self.resolve(shape, routing)
        if first.config is None:
            return []
        if first.level == PREDICTED:
            return [first]  # no stored row of this family matches here
        try:
            return self._alternatives(first, shape, routing, limit)
        except _StoreFailed:  # the store cannot be read now: the first answer alone
            return [first]

    def _alternatives(
        self, first: Decision, shape: Any, routing: Any, limit: int
    ) -> list[Decision]:
        with self._lock:
            fam = self._family(shape.op, shape.dtype, shape.family)
            assert fam is not None
            routing_class = self._routing_class(routing)
            near = {routing_class, *ADJACENT_CLASSES[routing_class]}
            ranked: dict[str, tuple[float, float, int, DispatchRow]] = {}
            for r in fam.rows:
                if r.routing_class not in near or r.status != "verified" or not _row_ok(r):
                    continue
                if r.config_hash == first.config.hash:
                    continue
                ratio = max(r.tokens, shape.tokens) / min(r.tokens, shape.tokens)
                if ratio > self.options.neighbour_ratio or not self._fingerprint_ok(
                    r.fingerprint_hash
                ):
                    continue
                same = r.routing_class == routing_class
                if r.tokens == shape.tokens:
                    why = "exact_match" if same else "adjacent_routing"
                else:
                    why = "neighbour_tokens" if same else "neighbour_tokens_adjacent_routing"
                conf = self._support(r, shape.tokens, routing_class, why, shape.op)
                if conf is None:
                    continue
                cand = (round(conf, 4), r.speedup or 0.0, r.id, r)
                old = ranked.get(r.config_hash)
                if old is None or cand[:3] > old[:3]:
                    ranked[r.config_hash] = cand
            out = [first]
            for conf, _, _, r in sorted(ranked.values(), key=lambda c: c[:3], reverse=True):
                if len(out) >= limit:
                    break
                config = self._config(shape.op, r)
                same = r.routing_class == routing_class
                if r.tokens == shape.tokens:
                    reason = "exact_match" if same else "adjacent_routing"
                else:
                    reason = "neighbour_tokens" if same else "neighbour_tokens_adjacent_routing"
                out.append(
                    Decision(
                        config=config,
                        level=EXACT if reason == "exact_match" else NEIGHBOUR,
                        confidence=conf,
                        reason=reason,
                        entry_id=r.id,
                        tokens=r.tokens,
                        routing_class=r.routing_class,
                    )
                )
            return out

    # -- slow path --------------------------------------------------------------------

    def _miss(self, shape: Any, routing: Any) -> Decision:
        with self._lock:
            decision = self.resolve(shape, routing)
            # Only hashable, immutable keys are cached (strings, None, frozen features).
            self._cache[(shape, routing)] = decision
            if decision.reason == "store_error":
                self._errored.add((shape, routing))
            return decision

    def resolve(self, shape: Any, routing: Any = None) -> Decision:
        """Work out the decision without the per-key cache (the family rows are still cached).

        What the store and the model do not answer (a fallback) is answered by the incumbent's
        table row where one exists for this device and shape (:meth:`_incumbent`); a store
        that cannot be read answers ``store_error`` (never an exception).
        """
        try:
            decision = self._resolve(shape, routing)
        except _StoreFailed as exc:
            log.debug("store_error: %s", exc.__cause__ or exc)
            decision = fallback("store_error")
        # a baseline record measured FlagGems' choice against every candidate there, the
        # incumbent's row among them (the tuner times it as a peer row): its answer stands
        if (
            decision.config is None
            and self.options.incumbent
            and decision.reason != "baseline_measured"
        ):
            return self._incumbent(shape, decision)
        return decision

    def _incumbent(self, shape: Any, decision: Decision) -> Decision:
        """The incumbent's table row for ``shape`` in place of the fallback ``decision``
        (same reason, level ``incumbent``, ``source`` naming the table and row); the fallback
        itself where there is no table row (the incumbent is then FlagGems' default)."""
        if not isinstance(shape, MoEShape) or decision.reason == "unknown_routing_class":
            return decision
        try:
            inc = self._incumbent_of(shape)
        except (MxdbError, ValueError, OSError):
            return decision  # a shipped table that cannot be read: FlagGems' default
        if not inc.is_table_row:
            return decision
        return Decision(
            config=inc.config,
            level=INCUMBENT,
            confidence=0.0,
            reason=decision.reason,
            source=inc.describe(),
        )

    def _incumbent_of(self, shape: MoEShape) -> Incumbent:
        """The incumbent for ``shape`` on this dispatcher's device: the store's imported
        tables (read once per dtype, kept until the next refresh), then the shipped ones."""
        from mxdb.incumbent import imported_tables, incumbent

        device = self.fingerprint.device_name if self.fingerprint is not None else None
        key = (shape.dtype, device)
        tables = self._imported.get(key)
        if tables is None:
            tables = {}
            if self.store is not None:
                try:
                    tables = imported_tables(self.store, shape.dtype, device)
                except Exception:  # a store that cannot be read: the shipped tables answer
                    tables = {}
            self._imported[key] = tables
        return incumbent(shape, device, tables)

    def _resolve(self, shape: Any, routing: Any) -> Decision:
        if not all(hasattr(shape, a) for a in ("op", "dtype", "family", "tokens")):
            raise UsageError(
                f"dispatch needs a shape such as mxdb.MoEShape(experts=, hidden=, intermediate=, "
                f"topk=, tokens=, dtype=); got {type(shape).__name__}"
            )
        routing_class = self._routing_class(routing)
        if routing_class not in ROUTING_CLASSES:
            return fallback("unknown_routing_class")
        fam = self._family(shape.op, shape.dtype, shape.family)
        if fam is None or not fam.rows:
            decision = fallback("no_entry")
            return self._predict(shape, routing_class, fam, decision)
        if fam.index is None:
            self._index(fam)
        assert fam.index is not None
        if not fam.index:
            decision = fallback(fam.empty_reason)
            return self._predict(shape, routing_class, fam, decision)
        return self._choose(fam, shape.op, shape.tokens, routing_class)

    def _predict(
        self, shape: Any, routing_class: str, fam: _Family | None, store_decision: Decision
    ) -> Decision:
        """The performance model's decision where the store's is ``store_decision`` (a
        fallback): asked only where the store has not measured the family here, for bf16 and a
        model whose fingerprint matches; otherwise the store's decision stands."""
        model = self._model
        if model is None and self._model_unavailable is None:
            return store_decision
        if not isinstance(shape, MoEShape) or shape.dtype != MODEL_DTYPE:
            return store_decision
        if fam is not None and fam.rows:
            if fam.measured_here is None:
                fam.measured_here = any(self._fingerprint_ok(r.fingerprint_hash) for r in fam.rows)
            if fam.measured_here:
                return store_decision
        if model is None:
            return fallback("model_unavailable")
        if not self._fingerprint_ok(model.fingerprint_hash):
            return store_decision
        key = (shape, routing_class)
        decision = self._predictions.get(key)
        if decision is None:
            decision = self._ask_model(model, shape, routing_class)
            if decision.config is not None and self.options.incumbent:
                decision = self._over_incumbent(model, shape, routing_class, decision)
            self._predictions[key] = decision
        return decision

    def _over_incumbent(
        self, model: PerfModel, shape: MoEShape, routing_class: str, decision: Decision
    ) -> Decision:
        """The model's answer where it is predicted at least the gate's speedup over the
        incumbent's table row too (the model is a prior: where it is unsure it beats what the
        user runs today, the key answers that); else the fallback
        ``prediction_not_over_incumbent``, which the incumbent's row then answers."""
        try:
            inc = self._incumbent_of(shape)
            if not inc.is_table_row or inc.config.hash == decision.config.hash:
                return decision
            from mxdb.costmodel.train import predicted_over

            over = predicted_over(model.forest, shape, routing_class, decision.config, inc.config)
        except Exception:  # a model that fails here answers nothing, never raises
            return fallback("model_error")
        if over >= model.gate.min_speedup:
            return decision
        return fallback("prediction_not_over_incumbent")

    @staticmethod
    def _ask_model(model: PerfModel, shape: MoEShape, routing_class: str) -> Decision:
        """The model's answer at the key as a decision; never raises."""
        try:
            choice = model.answer(shape, routing_class)
            if choice is None:
                return fallback("prediction_not_confident")
            confidence = float(choice.confidence) if choice.confidence is not None else math.nan
            if choice.config is None or not 0.0 <= confidence <= 1.0:
                return fallback("model_error")
            return Decision(
                config=choice.config,
                level=PREDICTED,
                confidence=round(confidence, 4),
                reason="predicted",
            )
        except Exception:  # a model that fails is a fallback, never an error in the caller
            return fallback("model_error")

    def _index(self, fam: _Family) -> None:
        """Group the dispatchable rows by routing class, sorted by tokens, best row per token count."""
        # One pass with tuple unpacking: this runs on a family's first lookup, whose budget
        # is a few hundred microseconds for families of a hundred rows.
        ok_of: dict[str | None, bool] = {}
        best: dict[str, dict[int, DispatchRow]] = {}
        any_verified = False
        invalid = False
        for row in fam.rows:
            row_id, tokens, routing_class, _, fp_hash, status, speedup = row
            if status not in DECIDED_STATUSES:
                continue
            if not _row_ok(row):  # never answered, and never compared with the others
                invalid = True
                continue
            any_verified = True
            ok = ok_of.get(fp_hash)
            if ok is None:
                ok = ok_of[fp_hash] = self._fingerprint_ok(fp_hash)
            if not ok:
                continue
            by_tokens = best.get(routing_class)
            if by_tokens is None:
                by_tokens = best[routing_class] = {}
            old = by_tokens.get(tokens)
            # A baseline record outranks verified configs at the same key: routings of one
            # class (several traces) measured there disagree, and on one of them nothing beat
            # FlagGems' choice, so FlagGems' choice is the answer no measurement contradicts.
            # A parity record (a peer's row or a choice at parity with it) ranks between the two.
            if old is None or _rank(status, speedup, row_id) > _rank(old[5], old[6], old[0]):
                by_tokens[tokens] = row
        if not best:
            stale_here = any(
                r.status == "stale" and self._fingerprint_ok(r.fingerprint_hash) for r in fam.rows
            )
            if not any_verified:
                stale_here = stale_here or any(r.status == "stale" for r in fam.rows)
                fam.empty_reason = "stale" if stale_here else "no_verified_entry"
            else:
                fam.empty_reason = "stale" if stale_here else "fingerprint_mismatch"
            if invalid and not stale_here:
                fam.empty_reason = "invalid_entry"
        index: dict[str, tuple[list[int], list[DispatchRow]]] = {}
        for routing_class, by_tokens in best.items():
            toks = sorted(by_tokens)
            index[routing_class] = (toks, [by_tokens[t] for t in toks])
        fam.index = index

    def _choose(self, fam: _Family, op: str, tokens: int, routing_class: str) -> Decision:
        """The best supported row for (tokens, class); see ``_support`` for what supports it."""
        assert fam.index is not None
        ratio_limit = self.options.neighbour_ratio
        best: tuple[float, bool, float, float, int, DispatchRow, str] | None = None
        any_class_ok = False
        unsupported = False
        classes = [(routing_class, True)]
        classes += [(c, False) for c in ADJACENT_CLASSES[routing_class]]
        for cls, same in classes:
            slot = fam.index.get(cls)
            if slot is None:
                continue
            any_class_ok = True
            toks, rows = slot
            i = bisect.bisect_left(toks, tokens)
            for j in (i - 1, i):
                if not 0 <= j < len(toks):
                    continue
                row = rows[j]
                ratio = max(row.tokens, tokens) / min(row.tokens, tokens)
                if ratio > ratio_limit:
                    continue
                if ratio == 1.0:
                    reason = "exact_match" if same else "adjacent_routing"
                else:
                    reason = "neighbour_tokens" if same else "neighbour_tokens_adjacent_routing"
                conf = self._support(row, tokens, routing_class, reason, op)
                if conf is None:
                    unsupported = True
                    continue
                # the nearest measurement first, then the call's own class over an adjacent
                # one (an adjacent class's entry was chosen on other routings), then
                # confidence, then speedup
                cand = (-abs(math.log(ratio)), same, conf, row.speedup or 0.0, row.id, row, reason)
                if best is None or cand[:5] > best[:5]:
                    best = cand
        if best is None:
            if unsupported:
                return fallback("neighbour_not_validated")
            return fallback("tokens_out_of_range" if any_class_ok else "routing_class_far")
        _, _, confidence, _, _, row, reason = best
        if row.status == "baseline":
            # the nearest measurement found FlagGems' own choice best: answer with it
            return fallback("baseline_measured")
        if row.status == "parity":
            reason = "parity"
        try:
            config = self._config(op, row)
        except (MxdbError, ValueError, TypeError, KeyError, AttributeError):
            # a stored row that does not parse is never answered, and never raises
            return fallback("invalid_entry")
        return Decision(
            config=config,
            level=EXACT if reason in ("exact_match", "parity") else NEIGHBOUR,
            confidence=round(confidence, 4),
            reason=reason,
            entry_id=row.id,
            tokens=row.tokens,
            routing_class=row.routing_class,
        )

    def _support(
        self, row: DispatchRow, tokens: int, routing_class: str, reason: str, op: str = MOE_OP
    ) -> float | None:
        """The confidence with which ``row`` answers (tokens, class), or None if unsupported.

        The row's own key answers with its measured confidence (the fraction of held-out
        routing instances it won; entries recorded before held-out validation: 1.0).  A
        neighbouring token count or an adjacent routing class is answered only where the
        entry's held-out validation supports it: a won instance of that class at a token
        count on the far side of the call's (the call lies between the entry's key and the
        instance), and then with the fraction won among the class's instances on that side.
        A baseline record answers its neighbourhood without validation: it only ever sends
        the call to FlagGems' own choice.  Ops other than the fused-MoE layer (the decode ops,
        whose choice of implementation does not depend on routing) answer a neighbouring token
        count within the ratio limit, with confidence falling to half at the limit.
        """
        if row.status == "baseline" or self.store is None:
            return CONFIDENCE_EXACT
        if row.status == "parity":
            # validated at its own key only: elsewhere the answer is a fallback
            if reason != "exact_match":
                return None
            confidence, _ = self._validation(row.id)
            return confidence if confidence is not None else CONFIDENCE_EXACT
        if op != MOE_OP:
            ratio = max(row.tokens, tokens) / min(row.tokens, tokens)
            span = math.log2(self.options.neighbour_ratio) or 1.0
            return CONFIDENCE_EXACT * (1.0 - 0.5 * math.log2(ratio) / span)
        confidence, record = self._validation(row.id)
        if reason == "exact_match":
            return confidence if confidence is not None else CONFIDENCE_EXACT
        if not record:
            return None
        lo, hi = sorted((row.tokens, tokens))
        side = [
            v
            for v in record
            if v.get("routing_class") == routing_class
            and isinstance(v.get("tokens"), int)
            and (v["tokens"] - row.tokens) * (tokens - row.tokens) >= 0
        ]
        covering = [v for v in side if v.get("won") and min(v["tokens"], row.tokens) <= lo
                    and max(v["tokens"], row.tokens) >= hi]  # fmt: skip
        if not covering:
            return None
        return sum(1 for v in side if v.get("won")) / len(side)

    def _validation(self, row_id: int) -> tuple[float | None, list[dict[str, Any]] | None]:
        cached = self._validations.get(row_id)
        if cached is None:
            assert self.store is not None
            cached = self._read(self.store.entry_validation, row_id)
            self._validations[row_id] = cached
        return cached

    def _config(self, op: str, row: DispatchRow) -> Any:
        """The parsed config of ``row``; a config hash names one config, so parses are shared."""
        key = (op, row.config_hash)
        config = self._configs.get(key)
        if config is None:
            assert self.store is not None
            config = parse_config(op, json.loads(self._read(self.store.entry_config, row.id)))
            self._configs[key] = config
        return config

    def _routing_class(self, routing: Any) -> str:
        if routing is None:
            return self.options.default_routing_class
        if isinstance(routing, str):
            return routing
        cls = getattr(routing, "routing_class", None)
        if isinstance(cls, str):
            return cls
        raise UsageError(
            f"routing must be a routing class name ({', '.join(ROUTING_CLASSES)}), "
            f"RoutingFeatures or None; got {type(routing).__name__}"
        )

    def _family(self, op: str, dtype: str, family: str) -> _Family | None:
        key = (op, dtype, family)
        fam = self._families.get(key)
        if fam is None:
            if self.store is None:
                if self._unavailable is not None:
                    raise _StoreFailed(self._unavailable)
                return None
            fam = _Family(rows=self._read(self.store.family_rows, op, dtype, family))
            self._families[key] = fam
        return fam

    def _read(self, fn: Callable[..., _T], *args: Any) -> _T:
        """``fn(*args)``, a store read; any failure (a StoreError, or a raw driver error such
        as sqlite3's on a file that is no longer a database) is a :class:`_StoreFailed`."""
        try:
            return fn(*args)
        except Exception as exc:
            raise _StoreFailed(str(exc)) from exc

    def _fingerprint_ok(self, fingerprint_hash: str | None) -> bool:
        if fingerprint_hash is None or self.fingerprint is None:
            return False
        ok = self._match_cache.get(fingerprint_hash)
        if ok is None:
            if fingerprint_hash == self.fingerprint.hash:
                ok = True
            else:
                from mxdb.fingerprint import matches

                other = self._recorded_fingerprint(fingerprint_hash)
                ok = other is not None and matches(other, self.fingerprint, self.options.policy)
            self._match_cache[fingerprint_hash] = ok
        return ok

    def _recorded_fingerprint(self, fingerprint_hash: str) -> Fingerprint | None:
        """The components of a fingerprint hash: from the store's fingerprints, else (the
        model's own) from the model bundle's ``fingerprint.json``."""
        if self.store is not None:
            if self._fingerprints is None:
                self._fingerprints = self._read(self.store.fingerprints)
            other = self._fingerprints.get(fingerprint_hash)
            if other is not None:
                return other
        model = self._model
        if model is None or fingerprint_hash != model.fingerprint_hash:
            return None
        if self._model_fp is _UNREAD:
            self._model_fp = _bundle_fingerprint(model)
        return self._model_fp


def _bundle_fingerprint(model: PerfModel) -> Fingerprint | None:
    """The fingerprint recorded beside the model file (its bundle's), when its hash is the
    model's; None when there is none or it cannot be read."""
    if not model.path:
        return None
    path = Path(model.path).parent / "fingerprint.json"
    if not path.is_file():
        return None
    from mxdb.fingerprint import load_fingerprint

    try:
        fp = load_fingerprint(path)
    except (MxdbError, OSError, ValueError):
        return None
    return fp if fp.hash == model.fingerprint_hash else None


# -- the background refresher ----------------------------------------------------------

#: Dispatchers with a refresher thread, so that a forked child restarts theirs.
_live: weakref.WeakSet[Dispatcher] = weakref.WeakSet()


def _rank(status: str, speedup: float | None, row_id: int) -> tuple[bool, bool, float, int]:
    """The order of rows at one key: a baseline record first, then a parity record, then the
    verified entries by speedup (ties: the newer row)."""
    return (status == "baseline", status == "parity", speedup or 0.0, row_id)


def _refresh_loop(
    ref: weakref.ReferenceType[Dispatcher], stop: threading.Event, interval: float
) -> None:
    """Poll the store every ``interval`` seconds while the dispatcher lives; never raise."""
    while not stop.wait(interval):
        d = ref()
        if d is None:
            return
        try:
            d.refresh_now()
        except Exception:  # a store that went away: keep the caches, try again later
            pass
        del d


def _restart_after_fork() -> None:
    """A forked child has no refresher threads: start fresh ones (with fresh events)."""
    for d in list(_live):
        if d._thread is not None and not d._stop.is_set():
            d._stop = threading.Event()
            d._start_refresher()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_restart_after_fork)


# -- the process-wide default ----------------------------------------------------------

_default: Dispatcher | None = None
_default_lock = threading.Lock()


def current_fingerprint() -> Fingerprint:
    """This process's environment fingerprint.

    ``$MXDB_FINGERPRINT`` (a JSON file) overrides it.  When torch is already
    imported and a GPU is visible, the GPU layer adds the live device facts;
    otherwise only what is knowable without a GPU is filled in.
    """
    from mxdb.fingerprint import collect, load_fingerprint

    path = os.environ.get("MXDB_FINGERPRINT")
    if path:
        return load_fingerprint(path)
    live: Mapping[str, Any] | None = None
    if "torch" in sys.modules:
        try:
            from mxdb.kernels.live import live_fingerprint_components

            live = live_fingerprint_components()
        except Exception:  # no GPU, or the GPU layer is not installed: CPU facts only
            live = None
    return collect(live)


def default_options() -> DispatchOptions:
    """The options of the process-wide dispatcher when none are given: the defaults, with the
    performance model ``$MXDB_MODEL`` names (a ``model.json``; unset or empty: none)."""
    path = os.environ.get(MODEL_ENV, "")
    if not path:
        return DispatchOptions()
    try:
        return DispatchOptions(model=path)
    except UsageError as exc:
        raise UsageError(f"${MODEL_ENV}: {exc}") from None


def configure(
    store: Store | str | None = None,
    *,
    fingerprint: Fingerprint | None = None,
    options: DispatchOptions | None = None,
) -> Dispatcher:
    """Set up the process-wide dispatcher used by ``mxdb.dispatch`` and return it.

    Without ``options``, :func:`default_options`: ``$MXDB_MODEL`` names a performance model
    that answers shape families the store has not measured (level ``predicted``).
    """
    from mxdb.store import Store

    global _default
    if options is None:
        options = default_options()
    opened = store if isinstance(store, Store) else Store.open(store)
    dispatcher = Dispatcher(opened, fingerprint or current_fingerprint(), options)
    with _default_lock:
        _default = dispatcher
    return dispatcher


def default_dispatcher() -> Dispatcher:
    """The process-wide dispatcher, opened on first use on the default store."""
    global _default
    if _default is None:
        with _default_lock:
            if _default is None:
                _default = _open_default()
    return _default


def _open_default() -> Dispatcher:
    """The dispatcher on the default store with :func:`default_options`; a store or a
    ``$MXDB_MODEL`` that cannot be opened is a warning, and its keys answer fallbacks
    (``store_error``, ``model_unavailable``) rather than the first call raising."""
    from mxdb.store import Store

    model_problem = store_problem = None
    try:
        options = default_options()
    except UsageError as exc:
        model_problem = str(exc)
        log.warning("%s; mxdb.dispatch answers without it (fallback model_unavailable)", exc)
        options = DispatchOptions()
    store: Store | None = None
    try:
        store = Store.open(None)
    except Exception as exc:  # a raw driver error too: the first call must not raise
        store_problem = str(exc)
        log.warning("%s; mxdb.dispatch answers the fallback store_error", exc)
    d = Dispatcher(store, current_fingerprint(), options)
    d._model_unavailable = model_problem
    d._unavailable = store_problem
    return d


def dispatch(shape: Any, routing: Any = None) -> Decision:
    """The verified config for ``shape`` under ``routing``, or the fallback with its reason.

    ``shape`` is an :class:`mxdb.MoEShape`; ``routing`` is a routing class
    (``"uniform"``, ``"skewed"``, ``"hot"``, ``"sparse"``), a ``RoutingFeatures``,
    or ``None`` (treated as uniform).
    """
    d = _default
    if d is None:
        d = default_dispatcher()
    return d.dispatch(shape, routing)


def dispatch_config_for(
    family_shape: MoEShape, dispatcher: Any = None, routing: Any = None
) -> Callable[[int], KernelConfig | None]:
    """``config_for`` answering from ``dispatcher`` (default: ``mxdb.dispatch``) per token count.

    What :class:`mxdb.kernels.layer.MoELayer` asks once per token count.  A fallback decision
    (no verified entry) answers ``None``: the layer then uses FlagGems' own choice for that
    token count.
    """
    ask = dispatch if dispatcher is None else dispatcher.dispatch

    def config_for(tokens: int) -> KernelConfig | None:
        config: KernelConfig | None = ask(family_shape.with_tokens(tokens), routing).config
        return config

    return config_for
