"""Verification: the store entry a tuning point's decision supports.

The decision itself (:func:`mxdb.pointverdict.decide`) is made from the point's comparisons
with the one verdict rule (:mod:`mxdb.verdict`): a config is ``verified`` only when it is
correct, faster than FlagGems' own choice on the replayed trace by a paired confidence
interval that clears the workload's margin and the noise band of FlagGems' same-config
copies, not beaten by a peer table's row that also beat FlagGems' choice, and faster again on
every held-out routing instance of its class.  A point that compared candidates with FlagGems'
choice and confirmed none is stored as a ``baseline`` record: FlagGems' choice stands there.
The audit re-makes the same decision from a bundle's raw samples.
"""

from __future__ import annotations

from mxdb import pointverdict
from mxdb.configs import KernelConfig
from mxdb.models import SINGLE_SOURCE, Entry, EntryStatus
from mxdb.pointverdict import PointDecision
from mxdb.tune.search import SearchResult


def point_entry(
    result: SearchResult,
    decision: PointDecision,
    *,
    routing_class: str,
    fingerprint_hash: str | None,
    device_name: str | None,
) -> Entry | None:
    """The entry (``verified``, ``parity`` or ``baseline``) the decision supports, else None."""
    if decision.status == "none":
        return None
    if decision.status in ("verified", "parity"):
        cands = [
            result.winner,
            result.peer_bar,
            result.parity_peer,
            *(c for c, _ in result.ranking),
        ]
        config = next((c for c in cands if c is not None and c.hash == decision.config_hash), None)
        if config is None:
            config = next(
                (
                    KernelConfig.parse(m.config)
                    for m in result.measurements
                    if m.config_hash == decision.config_hash
                ),
                None,
            )
        if config is None:  # pragma: no cover - the decision names a config it was given
            return None
    else:
        config = result.baseline
    return entry_for(
        result,
        config,
        decision.status,
        decision,
        routing_class=routing_class,
        fingerprint_hash=fingerprint_hash,
        device_name=device_name,
    )


def single_record(
    result: SearchResult,
    decision: PointDecision,
    *,
    routing_class: str,
    fingerprint_hash: str | None,
    device_name: str | None,
) -> Entry | None:
    """The best *single* config measured at a point whose verified winner is split.

    vLLM's and FlagGems' tables hold one config of FlagGems' kernels for both GEMMs, aligned
    to its BLOCK_SIZE_M; a split winner (two GEMM configs, another alignment block or another
    implementation) cannot be written there, and neither half of it was measured alone.  The fastest uniform config of the point's replay
    comparison that is itself faster than FlagGems' choice (``mxdb.verdict``) is kept as an
    entry of status ``imported`` and source ``tune-single``: never dispatched, read by the
    table exports (``mxdb.interop.tables``).  None otherwise: the export then writes the
    baseline's config at that key.
    """
    if decision.status != "verified" or result.winner is None:
        return None
    if result.winner.single:
        return None  # the verified entry is itself a single config
    replay = {m.run_id: m for m in result.measurements if m.comparison == "replay"}
    single = pointverdict.single_decision(
        [pointverdict.arm_from_measurement(m) for m in replay.values()],
        lambda a: KernelConfig.parse(replay[a.run_id].config).single,
        decision.baseline_us,
    )
    if single is None:
        return None
    m = replay[str(single.evidence)]
    entry = entry_for(
        result,
        KernelConfig.parse(m.config),
        "imported",
        single,
        routing_class=routing_class,
        fingerprint_hash=fingerprint_hash,
        device_name=device_name,
    )
    return entry.model_copy(update={"source": SINGLE_SOURCE})


def entry_for(
    result: SearchResult,
    config: KernelConfig,
    status: EntryStatus,
    decision: PointDecision,
    *,
    routing_class: str,
    fingerprint_hash: str | None,
    device_name: str | None,
) -> Entry:
    s = result.shape
    return Entry(
        op=s.op,
        dtype=s.dtype,
        family=s.family,
        dims=s.dims(),
        tokens=s.tokens,
        routing_class=routing_class,
        config=config.model_dump(),
        config_hash=config.hash,
        fingerprint_hash=fingerprint_hash,
        device_name=device_name,
        status=status,
        source="tune",
        speedup=decision.speedup,
        noise_band=decision.noise_band,
        median_us=decision.median_us,
        baseline_us=decision.baseline_us,
        evidence=decision.evidence,
        confidence=decision.confidence,
        validation=decision.validation or None,
    )
