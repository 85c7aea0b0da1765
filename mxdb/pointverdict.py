"""From a tuning point's timed comparisons to its store entry: one decision, made twice.

The tuner makes it from its measurements when it stores an entry; the audit makes it again
from the raw samples of a bundle's runs and compares the result with the bundle's store
export, so an entry that no runs support, or whose status, config or figures differ, is a
finding.  Every "faster" here is :func:`mxdb.verdict.compare`.

A point's comparisons (each timed in rounds of randomized order, :mod:`mxdb.verdict`):

- ``replay``: FlagGems' choice (role ``baseline``) with same-config copies (``control``), the
  finalists (``candidate``) and peers' table rows (``peer``), on the workload's trace.
- ``heldout-N``: FlagGems' choice and its copies, the chosen config, and the peer row that set
  the bar (if any), on a routing instance of the point's class the search never saw.
- ``tokens-M``: FlagGems' choice at a neighbouring token count ``M`` and its copies against the
  chosen config, on a held-out instance at ``M`` (what a neighbour answer of the dispatcher
  may rely on); ``class-N``: the same, with the peers' table rows where they were timed there,
  at the point's own token count on an instance of the workload's N-th other routing source
  (what an answer for an adjacent class may rely on: won only if the choice is not slower
  than any of those rows either).

The decision:

1. Among correct candidates and peer rows that are *faster* than FlagGems' choice on the
   replay, the one with the largest speedup (ties: the smaller run id).
2. Peers as baselines: where a peer row is faster than FlagGems' choice, the choice must also
   be faster than the best such row (that row's samples as the baseline, FlagGems' copies'
   noise band); otherwise the entry is that row.
3. ``verified`` when the choice is also faster than FlagGems' choice, correct, and not slower
   than the bar row on each of at least :data:`HELDOUT_MIN` held-out instances; its confidence
   is the fraction of held-out instances won.  A point whose choice lost a held-out instance,
   or that had candidates and none faster, is a ``baseline`` record: FlagGems' choice stands.
4. Rule 2 (bundles of run schema 1.2 and later; :data:`RULE`): before a point becomes a
   baseline record, the *parity row* is considered: of the peer rows not slower than FlagGems'
   choice on the replay, the one with the largest speedup.  It becomes a ``parity`` record (the
   dispatcher answers it at its own key) when it was timed on at least :data:`HELDOUT_MIN`
   held-out instances, is slower than FlagGems' choice on none of them, and its speedup over
   FlagGems' choice pooled over the replay and those instances (each arm's rounds concatenated
   in comparison order, so a pair stays within a round) is above 1.  A peer's table row that
   ties with FlagGems' choice everywhere and is the faster of the two overall is then the
   answer: neither slower than FlagGems' choice nor than the peer's own table.  Its confidence
   is the fraction of held-out instances on which its speedup is at least 1.
5. Rule 3 (run schema 1.3): a point that is still a baseline record gets a parity record for
   the replay's choice (a candidate faster than FlagGems' choice on the replay, not beaten by
   the bar row there) when it was timed on at least :data:`HELDOUT_MIN` held-out instances, is
   slower than FlagGems' choice, and than the bar row, on none of them, and is faster pooled
   over those instances (the replay, which chose it, is left out of the pool).  Such a choice
   lost its verification to ties, not to losses: a held-out instance where it ran even with
   FlagGems' choice (at a memory-bound batch both read the same bytes) while another trace of
   the key verified it.  Its confidence is the fraction of held-out instances on which its
   speedup is at least 1.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from mxdb import verdict

#: Held-out routing instances a verified entry must have won, at the least.
HELDOUT_MIN = 3

#: The decision rule new tunes use: 2 adds the parity record (item 4 of the module docstring),
#: 3 the replay choice's parity record (item 5).
RULE = 3

#: The run schema version that declares each rule in a bundle (the audit reads it back).
RUN_SCHEMA_OF_RULE: dict[int, str] = {1: "1.1", 2: "1.2", 3: "1.3"}


def rule_of_run_schema(version: str | None) -> int:
    """The decision rule a run schema version declares (versions before 1.1 and unknown
    ones: rule 1)."""
    for rule, v in RUN_SCHEMA_OF_RULE.items():
        if v == version:
            return rule
    return 1


DecisionStatus = Literal["verified", "baseline", "parity", "none"]


@dataclass(frozen=True, slots=True)
class Arm:
    """One timed arm of a comparison: a run document or a stored measurement."""

    run_id: str
    role: str
    config_hash: str
    status: str
    samples: tuple[float, ...]
    correct: bool | None
    comparison: str
    tokens: int
    routing_class: str
    trace_hash: str | None
    margin: float


@dataclass(frozen=True)
class PointDecision:
    """What a point's comparisons support, with the figures the store entry carries."""

    status: DecisionStatus
    config_hash: str | None
    evidence: str | None
    speedup: float | None
    low: float | None
    high: float | None
    noise_band: float | None
    median_us: float | None
    baseline_us: float | None
    confidence: float | None
    validation: list[dict[str, Any]] = field(default_factory=list)
    reason: str = ""


def arm_from_run(run: Mapping[str, Any], correct: bool | None) -> Arm:
    """An arm from an evidence run document (``runs/*.json``)."""
    timing = run.get("timing") or {}
    return Arm(
        run_id=str(run["run_id"]),
        role=str(run["role"]),
        config_hash=str(run["config_hash"]),
        status=str(run["status"]),
        samples=tuple(timing.get("samples_us") or ()),
        correct=correct,
        comparison=str(run.get("comparison") or "replay"),
        tokens=int(run["shape"]["tokens"]),
        routing_class=str(run["routing_class"]),
        trace_hash=run.get("trace_hash"),
        margin=float(run.get("margin") or 0.0),
    )


def arm_from_measurement(m: Any) -> Arm:
    """An arm from a stored :class:`mxdb.models.Measurement` of a comparison."""
    return Arm(
        run_id=m.run_id,
        role=m.role,
        config_hash=m.config_hash,
        status=m.status,
        samples=tuple(m.samples_us),
        correct=None
        if m.max_abs_err is None
        else verdict.passes(m.dtype, m.max_abs_err, m.rel_err),
        comparison=m.comparison or "replay",
        tokens=m.tokens,
        routing_class=m.routing_class,
        trace_hash=m.trace_hash,
        margin=float(m.margin or 0.0),
    )


def copies_of(arms: Sequence[Arm]) -> tuple[Arm | None, list[Arm]]:
    base = next((a for a in arms if a.role == "baseline"), None)
    if base is None:
        return None, []
    copies = [
        a
        for a in arms
        if a.role in ("baseline", "control")
        and a.config_hash == base.config_hash
        and a.status == "ok"
        and a.samples
    ]
    return base, sorted(copies, key=lambda a: a.run_id)


def usable(a: Arm) -> bool:
    return a.status == "ok" and bool(a.samples) and a.correct is True


def single_decision(
    arms: Sequence[Arm], single: Callable[[Arm], bool], baseline_us: float | None
) -> PointDecision | None:
    """The single-config record of a point: the fastest arm of its replayed comparison that
    ``single`` accepts (one FlagGems config for both GEMMs: what vLLM's and FlagGems' tables
    can hold) and that is faster than FlagGems' choice by the verdict rule, with its figures;
    None when there is none.  The tuner keeps it beside a winner those tables cannot express
    (``mxdb.tune.verify.single_record``) and the audit makes it again from the runs."""
    replay = [a for a in arms if a.comparison == "replay"]
    _, copies = copies_of(replay)
    if len(copies) < 2:
        return None
    samples = [list(a.samples) for a in copies]
    best: tuple[Arm, verdict.Verdict] | None = None
    for a in replay:
        if a.role not in ("candidate", "peer") or not usable(a) or not single(a):
            continue
        v = verdict.compare(samples, a.samples, margin=a.margin)
        if v.faster and (best is None or (v.speedup or 0.0) > (best[1].speedup or 0.0)):
            best = (a, v)
    if best is None:
        return None
    arm, v = best
    return PointDecision(
        "verified", arm.config_hash, arm.run_id, v.speedup, v.low, v.high, v.noise_band,
        verdict.median(arm.samples), baseline_us, None,
    )  # fmt: skip


def _record(name: str, arm: Arm, v: verdict.Verdict, won: bool) -> dict[str, Any]:
    return {
        "comparison": name,
        "tokens": arm.tokens,
        "routing_class": arm.routing_class,
        "trace_hash": arm.trace_hash,
        "outcome": v.outcome,
        "speedup": v.speedup,
        "low": v.low,
        "high": v.high,
        "noise_band": v.noise_band,
        "won": won,
    }


def choose(arms: Sequence[Arm]) -> tuple[Arm | None, Arm | None, dict[str, verdict.Verdict]]:
    """The replay comparison's choice, the peer row that set the bar, and every verdict."""
    base, copies = copies_of(arms)
    if base is None or not copies:
        return None, None, {}
    samples = [list(a.samples) for a in copies]
    verdicts: dict[str, verdict.Verdict] = {}
    faster: list[Arm] = []
    for a in sorted(arms, key=lambda x: x.run_id):
        if (
            a.role not in ("candidate", "peer")
            or a.config_hash == base.config_hash
            or not usable(a)
        ):
            continue
        v = verdict.compare(samples, a.samples, margin=a.margin)
        verdicts[a.run_id] = v
        if v.faster:
            faster.append(a)
    if not faster:
        return None, None, verdicts

    def speed(a: Arm) -> float:
        return verdicts[a.run_id].speedup or 0.0

    best = max(faster, key=speed)  # max keeps the first of equals: the smaller run id
    peers = [a for a in faster if a.role == "peer"]
    bar = max(peers, key=speed) if peers else None
    if bar is not None and bar.run_id != best.run_id:
        band = verdicts[best.run_id].noise_band
        over_bar = verdict.compare([list(bar.samples)], best.samples, margin=best.margin, band=band)
        verdicts[f"{best.run_id}>{bar.run_id}"] = over_bar
        if not over_bar.faster:
            best = bar
    return best, bar, verdicts


def parity_row(arms: Sequence[Arm]) -> Arm | None:
    """The replay's parity row: of the usable peer rows (another config than FlagGems' choice)
    not slower than FlagGems' choice, the one with the largest speedup (ties: smaller run id).
    Only the replay comparison's arms count."""
    arms = [a for a in arms if a.comparison == "replay"]
    base, copies = copies_of(arms)
    if base is None or not copies:
        return None
    samples = [list(a.samples) for a in copies]
    best: tuple[float, Arm] | None = None
    for a in sorted(arms, key=lambda x: x.run_id):
        if a.role != "peer" or a.config_hash == base.config_hash or not usable(a):
            continue
        v = verdict.compare(samples, a.samples, margin=a.margin)
        if v.slower or v.speedup is None:
            continue
        if best is None or v.speedup > best[0]:
            best = (v.speedup, a)
    return best[1] if best is not None else None


def _pooled(
    by_comp: Mapping[str, list[Arm]], names: Sequence[str], config_hash: str, bars: Sequence[str]
) -> tuple[verdict.Verdict, list[dict[str, Any]], int] | None:
    """``config_hash``'s arm in each comparison of ``names``, when it is slower than FlagGems'
    choice in none of them (nor than the arms of ``bars`` there): its verdict pooled over them
    (each arm's rounds concatenated in comparison order, so a pair stays within a round), the
    validation records of the held-out ones and how many of those it ran at least even on.
    None where an arm is missing or slower."""
    pooled_copies: list[list[float]] = []
    pooled_arm: list[float] = []
    validation: list[dict[str, Any]] = []
    even = 0
    margin = 0.0
    for name in names:
        comp = by_comp.get(name, [])
        _, copies = copies_of(comp)
        arm = next((a for a in comp if a.config_hash == config_hash and usable(a)), None)
        if arm is None or len(copies) < 2:
            return None
        if pooled_copies and len(copies) != len(pooled_copies):
            return None
        v = verdict.compare([list(c.samples) for c in copies], arm.samples, margin=arm.margin)
        if v.slower or v.speedup is None or _slower_than_peers(comp, arm, bars, v):
            return None
        if not pooled_copies:
            pooled_copies = [[] for _ in copies]
        for j, c in enumerate(copies):
            pooled_copies[j] += list(c.samples)
        pooled_arm += list(arm.samples)
        margin = arm.margin
        if name != "replay":
            even += v.speedup >= 1.0
            validation.append(_record(name, arm, v, v.speedup >= 1.0))
    if not pooled_arm:
        return None
    return verdict.compare(pooled_copies, pooled_arm, margin=margin), validation, even


def _parity(
    by_comp: Mapping[str, list[Arm]], heldout: Sequence[str], heldout_min: int
) -> PointDecision | None:
    """The parity record of rule 2, or None where the parity row does not hold (docstring 4)."""
    replay = by_comp.get("replay", [])
    row = parity_row(replay)
    if row is None or len(heldout) < heldout_min:
        return None
    held = _pooled(by_comp, ["replay", *heldout], row.config_hash, [])
    if held is None:
        return None
    return _parity_record(
        replay, row, held, len(heldout),
        f"the peer row is slower than FlagGems' choice on none of the replay and {len(heldout)} "
        "held-out routing instances, and faster pooled over them",
    )  # fmt: skip


def _choice_parity(
    by_comp: Mapping[str, list[Arm]], heldout: Sequence[str], heldout_min: int
) -> PointDecision | None:
    """The parity record of rule 3 for the replay's choice (docstring 5), or None."""
    replay = by_comp.get("replay", [])
    chosen, bar, _ = choose(replay)
    if chosen is None or chosen.role != "candidate" or len(heldout) < heldout_min:
        return None
    bars = [bar.config_hash] if bar is not None else []
    # the replay chose it (a biased sample): only the held-out instances are pooled
    held = _pooled(by_comp, heldout, chosen.config_hash, bars)
    if held is None:
        return None
    return _parity_record(
        replay, chosen, held, len(heldout),
        f"the replay's choice is slower than FlagGems' choice (and than the bar row) on none of "
        f"{len(heldout)} held-out routing instances, and faster pooled over them",
    )  # fmt: skip


def _parity_record(
    replay: Sequence[Arm],
    arm: Arm,
    held: tuple[verdict.Verdict, list[dict[str, Any]], int],
    n_heldout: int,
    why: str,
) -> PointDecision | None:
    """A parity record for ``arm`` from its pooled verdict (``_pooled``), if faster pooled."""
    pooled, validation, even = held
    if pooled.speedup is None or not pooled.speedup > 1.0:
        return None
    base, _ = copies_of(replay)
    assert base is not None
    base_us = verdict.median(base.samples) if base.samples else None
    return PointDecision(
        "parity", arm.config_hash, arm.run_id, pooled.speedup, pooled.low, pooled.high,
        pooled.noise_band, verdict.median(arm.samples), base_us, even / n_heldout, validation,
        reason=f"{why} ({pooled.speedup:.4f}x)",
    )  # fmt: skip


def decide(arms: Iterable[Arm], *, heldout_min: int = HELDOUT_MIN, rule: int = 1) -> PointDecision:
    """The decision of one point from all its arms (see the module docstring; ``rule`` 2
    adds the peer row's parity record, 3 the replay's choice's)."""
    by_comp: dict[str, list[Arm]] = {}
    for a in arms:
        by_comp.setdefault(a.comparison, []).append(a)
    first = _decide(by_comp, heldout_min)
    if rule < 2 or first.status != "baseline":
        return first
    heldout = sorted(n for n in by_comp if n.startswith("heldout-"))
    peer = _parity(by_comp, heldout, heldout_min)
    if peer is not None or rule < 3:
        return peer or first
    return _choice_parity(by_comp, heldout, heldout_min) or first


#: Prefix of the comparisons of a key reconciliation (``mxdb.tune.reconcile``): one per trace.
KEY_PREFIX = "key-"


def is_key_point(arms: Iterable[Arm]) -> bool:
    """Whether these arms are a key reconciliation's (every comparison ``key-N``)."""
    names = {a.comparison for a in arms}
    return bool(names) and all(n.startswith(KEY_PREFIX) for n in names)


def decide_key(arms: Iterable[Arm]) -> PointDecision:
    """The decision of a key reconciliation: one config for every trace of a routing class.

    Each comparison ``key-N`` times FlagGems' choice (and its copies), every config decided at
    the key and the peers' table rows on one trace of the key.  A config (candidate or peer
    row) is ``verified`` when it is correct and faster than FlagGems' choice on every trace,
    ``parity`` when it is slower on none and faster pooled over all of them (each arm's rounds
    concatenated, as rule 2 pools); either way it must be slower, on no trace, than a peer row
    that is itself faster than FlagGems' choice there.  Of the configs that hold, a verified one
    before a parity one, then the larger pooled speedup (ties: the smaller run id of its first
    comparison).  None holds: a ``baseline`` record.  Every config timed was already decided
    at the key by a point of its own, so the choice among them is a choice among few.
    Confidence: the fraction of traces on which the config was faster.
    """
    by_comp: dict[str, list[Arm]] = {}
    for a in arms:
        by_comp.setdefault(a.comparison, []).append(a)
    names = sorted(by_comp, key=lambda n: (len(n), n))
    if not names:
        return PointDecision(
            "none", None, None, None, None, None, None, None, None, None,
            reason="nothing was compared with FlagGems' choice",
        )  # fmt: skip
    first = by_comp[names[0]]
    base, first_copies = copies_of(first)
    base_us = verdict.median(base.samples) if base is not None and base.samples else None
    hashes = sorted(
        {a.config_hash for a in first if a.role in ("candidate", "peer")}
        - ({base.config_hash} if base is not None else set())
    )
    if base is None or len(first_copies) < 2 or not hashes:
        return PointDecision(
            "none", None, None, None, None, None, None, None, base_us, None,
            reason="nothing was compared with FlagGems' choice",
        )  # fmt: skip
    # per trace, the peer rows faster than FlagGems' choice there: bars for every config
    bars: dict[str, list[str]] = {}
    for n in names:
        _, copies = copies_of(by_comp[n])
        samples = [list(c.samples) for c in copies]
        bars[n] = [
            a.config_hash
            for a in by_comp[n]
            if a.role == "peer"
            and usable(a)
            and len(samples) >= 2
            and verdict.compare(samples, a.samples, margin=a.margin).faster
        ]
    held: list[tuple[int, float, str, PointDecision]] = []
    band = None
    for h in hashes:
        won = 0
        ok = True
        for n in names:
            comp = by_comp[n]
            _, copies = copies_of(comp)
            arm = next((a for a in comp if a.config_hash == h and usable(a)), None)
            if arm is None or len(copies) < 2:
                ok = False
                break
            v = verdict.compare([list(c.samples) for c in copies], arm.samples, margin=arm.margin)
            band = v.noise_band if band is None else band
            if v.slower or _slower_than_peers(comp, arm, bars[n], v):
                ok = False
                break
            won += v.faster
        if not ok:
            continue
        pooled = _pooled(by_comp, names, h, [])
        if pooled is None:
            continue
        pv, _, _ = pooled
        if pv.speedup is None or not (won == len(names) or pv.speedup > 1.0):
            continue
        status: DecisionStatus = "verified" if won == len(names) else "parity"
        records = []
        for n in names:
            comp = by_comp[n]
            _, copies = copies_of(comp)
            arm = next(a for a in comp if a.config_hash == h and usable(a))
            v = verdict.compare([list(c.samples) for c in copies], arm.samples, margin=arm.margin)
            records.append(_record(n, arm, v, v.faster))
        ev = next(a for a in first if a.config_hash == h)
        pooled_arm = [x for n in names for a in by_comp[n] if a.config_hash == h for x in a.samples]
        d = PointDecision(
            status, h, ev.run_id, pv.speedup, pv.low, pv.high, pv.noise_band,
            verdict.median(pooled_arm), base_us, won / len(names), records,
            reason=f"{'faster than' if status == 'verified' else 'at parity with'} FlagGems' "
            f"choice on every one of {len(names)} traces of the key ({won} faster), "
            f"{pv.speedup:.4f}x pooled",
        )  # fmt: skip
        held.append((status == "verified", pv.speedup, ev.run_id, d))
    if not held:
        return PointDecision(
            "baseline", base.config_hash, base.run_id, 1.0, None, None, band, base_us,
            base_us, None,
            reason=f"no config decided at the key holds on all {len(names)} of its traces",
        )  # fmt: skip
    # the verified first, then the larger pooled speedup, then the smaller run id
    held.sort(key=lambda t: (not t[0], -t[1], t[2]))
    return held[0][3]


def _slower_than_peers(
    comp: Sequence[Arm], cand: Arm, hashes: Iterable[str], against_base: verdict.Verdict
) -> bool:
    """Whether ``cand`` is slower than any arm of ``comp`` with a config in ``hashes`` (arms of
    the choice's own config and rows not timed there do not count), judged in FlagGems'
    copies' noise band."""
    for h in set(hashes) - {cand.config_hash}:
        peer = next((a for a in comp if a.config_hash == h and usable(a)), None)
        if peer is None:
            continue
        pv = verdict.compare(
            [list(peer.samples)], cand.samples, margin=cand.margin, band=against_base.noise_band
        )
        if pv.slower:
            return True
    return False


def _decide(by_comp: Mapping[str, list[Arm]], heldout_min: int) -> PointDecision:
    """Items 1-3 of the module docstring."""
    replay = by_comp.get("replay", [])
    base, _ = copies_of(replay)
    base_us = verdict.median(base.samples) if base is not None and base.samples else None
    chosen, bar, verdicts = choose(replay)
    timed = any(
        a.role in ("candidate", "peer") and a.status == "ok" and a.samples
        for a in replay
        if base is None or a.config_hash != base.config_hash
    )
    if chosen is None:
        band = next(iter(verdicts.values())).noise_band if verdicts else None
        if base is None or base_us is None or not timed or band is None:
            return PointDecision(
                "none", None, None, None, None, None, None, None, base_us, None,
                reason="nothing was compared with FlagGems' choice",
            )  # fmt: skip
        return PointDecision(
            "baseline", base.config_hash, base.run_id, 1.0, None, None, band, base_us, base_us,
            None, reason="no candidate was faster than FlagGems' choice beyond the noise",
        )  # fmt: skip
    v = verdicts[chosen.run_id]
    assert base is not None
    validation: list[dict[str, Any]] = []
    heldout = sorted(n for n in by_comp if n.startswith("heldout-"))
    won = 0
    for name in heldout:
        comp = by_comp[name]
        _, copies = copies_of(comp)
        cand = next((a for a in comp if a.config_hash == chosen.config_hash), None)
        if cand is None or not copies or not usable(cand):
            validation.append({"comparison": name, "outcome": "missing", "won": False})
            continue
        hv = verdict.compare([list(c.samples) for c in copies], cand.samples, margin=cand.margin)
        ok = hv.faster and not _slower_than_peers(
            comp, cand, [bar.config_hash] if bar is not None else [], hv
        )
        won += ok
        validation.append(_record(name, cand, hv, ok))
    for name in sorted(n for n in by_comp if n.startswith(("tokens-", "class-"))):
        comp = by_comp[name]
        _, copies = copies_of(comp)
        cand = next((a for a in comp if a.config_hash == chosen.config_hash), None)
        if cand is None or not copies or not usable(cand):
            continue
        nv = verdict.compare([list(c.samples) for c in copies], cand.samples, margin=cand.margin)
        # a class-N instance timed with the peers' rows (bundles since they joined them) is
        # won only if the choice is not slower than any of them either
        peers = (
            [a.config_hash for a in comp if a.role == "peer"] if name.startswith("class-") else []
        )
        ok = nv.faster and not _slower_than_peers(comp, cand, peers, nv)
        validation.append(_record(name, cand, nv, ok))
    confidence = won / len(heldout) if heldout else 0.0
    figures = dict(
        speedup=v.speedup, low=v.low, high=v.high, noise_band=v.noise_band,
        median_us=verdict.median(chosen.samples), baseline_us=base_us,
    )  # fmt: skip
    if len(heldout) >= heldout_min and won == len(heldout):
        return PointDecision(
            "verified", chosen.config_hash, chosen.run_id, confidence=confidence,
            validation=validation,
            reason=f"faster on the replay ({v.reason}) and on {won} of {len(heldout)} "
            "held-out routing instances",
            **figures,
        )  # fmt: skip
    why = (
        f"only {len(heldout)} held-out instances (at least {heldout_min} needed)"
        if len(heldout) < heldout_min
        else f"won {won} of {len(heldout)} held-out routing instances"
    )
    return PointDecision(
        "baseline", base.config_hash, base.run_id, 1.0, None, None, v.noise_band, base_us,
        base_us, confidence, validation,
        reason=f"the replay's choice was not confirmed: {why}",
    )  # fmt: skip
