"""Dispatch decisions: the answer ``mxdb.dispatch`` gives, and why.

A decision is a frozen slots dataclass (cheap to build and pass on the hot
path).  ``config`` is ``None`` for a fallback: the caller then uses FlagGems'
own choice.  Levels, from the most to the least measured: ``exact`` and
``neighbour`` (a stored entry answered), ``predicted`` (the learned performance
model answered a shape family the store has not measured here; ``entry_id`` is
None), ``incumbent`` (nothing measured answers: the row of the table the user's
engine runs today, see :mod:`mxdb.incumbent`; ``reason`` says why nothing measured
answered and ``source`` names the table and row) and ``fallback`` (no table either:
FlagGems' default).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mxdb.ops import config_to_json

#: The level that answered.
EXACT = "exact"
NEIGHBOUR = "neighbour"
PREDICTED = "predicted"
INCUMBENT = "incumbent"
FALLBACK = "fallback"
LEVELS = (EXACT, NEIGHBOUR, PREDICTED, INCUMBENT, FALLBACK)

#: Machine-readable reasons.
REASONS: dict[str, str] = {
    "exact_match": "a verified entry for this exact key and routing class",
    "neighbour_tokens": "a verified entry of the same family at a nearby token count",
    "adjacent_routing": "a verified entry for an adjacent routing class",
    "neighbour_tokens_adjacent_routing": "a verified entry at a nearby token count and adjacent routing class",
    "no_entry": "no stored entry for this op, dtype and shape family",
    "no_verified_entry": "entries exist but none is verified (imported or rejected only)",
    "fingerprint_mismatch": "verified entries exist, but for another environment fingerprint",
    "stale": "the matching entries are stale (their environment changed); re-tune",
    "tokens_out_of_range": "verified entries exist, but none within the measured token neighbourhood",
    "routing_class_far": "verified entries exist, but only for non-adjacent routing classes",
    "unknown_routing_class": "the routing class given is not one mxdb knows",
    "neighbour_not_validated": "a verified entry is near, but its held-out validation does not "
    "cover this token count or routing class",
    "invalid_entry": "the matching stored entry cannot be read (an invalid config): not answered",
    "baseline_measured": "measured here (or nearest): nothing beat FlagGems' own choice beyond noise",
    "parity": "a parity record at this exact key (a peer table's row, or the search's choice "
    "that lost its verification to ties): slower than FlagGems' own choice on none of the "
    "routing instances measured, and faster pooled over them",
    "peer_parity": "(the name of `parity` in records of earlier versions, which held peer "
    "table rows only)",
    "predicted": "the store has not measured this shape family here; the performance model's "
    "choice, which its gate admits (calibrated confidence and predicted speedup over FlagGems' "
    "own choice at or above the gate's thresholds)",
    "prediction_not_confident": "the store has not measured this shape family here and the "
    "performance model's gate refused its choice (confidence or predicted speedup below the "
    "gate, or nothing predicted faster than FlagGems' own choice)",
    "prediction_not_over_incumbent": "the store has not measured this shape family here and "
    "the performance model's choice is not predicted at least the gate's speedup over the "
    "incumbent (the vLLM table row for this device, which answers instead)",
    "model_error": "the store has not measured this shape family here and the performance model "
    "failed while answering: not answered",
    "model_unavailable": "the store has not measured this shape family here and the performance "
    "model named by $MXDB_MODEL could not be loaded (a warning names the path and the problem): "
    "not answered",
    "store_error": "the store could not be read (a file that is no longer a database, a table "
    "dropped, a database unreachable): not answered; read again at the next refresh",
    "healing_fallback": "self-healing moved this key to FlagGems' own choice: every config the "
    "store offers for it measured slower than its baseline here",
}


@dataclass(frozen=True, slots=True)
class Decision:
    """What to run for one call, the level that answered, and why."""

    #: The op's config: a ``KernelConfig`` for the fused-MoE layer; None for a fallback.
    config: Any
    level: str
    confidence: float
    reason: str
    entry_id: int | None = None
    tokens: int | None = None
    routing_class: str | None = None
    #: level ``incumbent``: the table and row answered (``Incumbent.describe``)
    source: str | None = None

    @property
    def is_fallback(self) -> bool:
        """Whether nothing mxdb measured or predicted answered: the incumbent's table row
        (level ``incumbent``) or FlagGems' default (level ``fallback``, no config)."""
        return self.level in (INCUMBENT, FALLBACK)

    def to_dict(self) -> dict[str, Any]:
        return {
            "config": config_to_json(self.config) if self.config is not None else None,
            "config_hash": getattr(self.config, "hash", None),
            "triton_config": (
                {"gemm1": self.config.gemm1.to_triton(), "gemm2": self.config.gemm2.to_triton()}
                if hasattr(self.config, "gemm1")
                else None
            ),
            "level": self.level,
            "confidence": self.confidence,
            "reason": self.reason,
            "reason_text": REASONS.get(self.reason, self.reason),
            "entry_id": self.entry_id,
            "entry_tokens": self.tokens,
            "entry_routing_class": self.routing_class,
            "source": self.source,
        }


def fallback(reason: str) -> Decision:
    return Decision(config=None, level=FALLBACK, confidence=0.0, reason=reason)
