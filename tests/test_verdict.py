"""The one verdict rule (mxdb.verdict) and the point decision built on it (mxdb.pointverdict)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mxdb import pointverdict, verdict
from mxdb.pointverdict import Arm


def test_sign_rank_is_the_exact_binomial_order_statistic() -> None:
    assert verdict.sign_rank(5) is None  # 2 * (1/32) > 0.05: no 95% interval
    assert verdict.sign_rank(6) == 1  # P(X <= 0) = 1/64
    assert verdict.sign_rank(16) == 4  # P(X <= 3) = 0.0106, P(X <= 4) = 0.0384
    for n in (6, 10, 16, 30, 60):
        k = verdict.sign_rank(n)
        assert k is not None
        coverage = 1 - 2 * sum(math.comb(n, i) for i in range(k)) / 2**n
        assert coverage >= 0.95
        wider = 1 - 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2**n
        assert wider < 0.95  # k is the largest rank that keeps 95%


def _rounds(rng: np.random.Generator, n: int, base: float, noise: float) -> list[float]:
    return list(base * rng.lognormal(0.0, noise, n))


def test_paired_speedup_cancels_drift_shared_by_a_round() -> None:
    rng = np.random.default_rng(0)
    drift = rng.lognormal(0.0, 0.2, 32)  # a round-wide slowdown, the same for every arm
    base = [100.0 * d for d in drift]
    cand = [95.0 * d for d in drift]
    p = verdict.paired(base, cand)
    assert p is not None and p.speedup == pytest.approx(100 / 95)
    assert p.low == pytest.approx(100 / 95) and p.high == pytest.approx(100 / 95)


def test_compare_outcomes() -> None:
    rng = np.random.default_rng(1)
    copies = [_rounds(rng, 24, 100.0, 0.003) for _ in range(3)]
    faster = verdict.compare(copies, _rounds(rng, 24, 95.0, 0.003), margin=0.005)
    assert faster.outcome == "faster" and faster.low is not None and faster.low > 1.005
    slower = verdict.compare(copies, _rounds(rng, 24, 105.0, 0.003), margin=0.005)
    assert slower.outcome == "slower" and slower.high is not None and slower.high < 0.995
    same = verdict.compare(copies, _rounds(rng, 24, 100.0, 0.003), margin=0.005)
    assert same.outcome == "same"
    # a gain inside the margin is not a verification
    small = verdict.compare(copies, _rounds(rng, 24, 99.7, 0.0005), margin=0.005)
    assert small.outcome == "same"
    # fewer than two copies: the noise is unknown, nothing is decided
    one = verdict.compare(copies[:1], _rounds(rng, 24, 90.0, 0.003))
    assert one.outcome == "same" and "noise is unknown" in one.reason
    # rounds that do not pair (a failed arm lost samples) decide nothing either
    assert verdict.compare(copies, [90.0] * 23).outcome == "same"
    assert verdict.compare(copies, [90.0] * 23 + [math.nan]).outcome == "same"


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), noise=st.floats(0.0005, 0.05), n=st.integers(6, 40))
def test_a_same_config_comparison_is_never_called_faster_and_slower(
    seed: int, noise: float, n: int
) -> None:
    rng = np.random.default_rng(seed)
    copies = [_rounds(rng, n, 100.0, noise) for _ in range(3)]
    v = verdict.compare(copies, _rounds(rng, n, 100.0, noise))
    assert not (v.faster and v.slower)
    if v.speedup is not None and v.low is not None and v.high is not None:
        assert v.low <= v.speedup <= v.high


def test_false_verify_rate_on_simulated_aa_comparisons_is_low() -> None:
    rng = np.random.default_rng(2)
    groups = [[_rounds(rng, 16, 100.0, 0.01) for _ in range(3)] for _ in range(300)]
    hits, total = verdict.false_verify_rate(groups, margin=0.005)
    assert total == 900 and hits / total <= 0.01


def test_a_fixed_order_bias_fools_a_median_band_but_not_a_random_order() -> None:
    """A position bias (later arms slower) makes the first-timed copy look faster."""
    from mxdb import KernelConfig, MoEShape
    from mxdb.configs import GemmConfig
    from mxdb.tune.fake import FakeBackend

    shape = MoEShape(8, 4096, 14336, 2, 64, "bf16")
    cfg = KernelConfig.uniform(GemmConfig(block_m=16, block_n=64, block_k=64))
    ids = np.asarray([[i % 8, (i + 1) % 8] for i in range(64)], dtype=np.int64)
    fixed = random = 0
    for seed in range(40):
        be = FakeBackend(seed=seed, noise=0.002, position_bias=0.004)
        for order_seed, _ in ((None, "fixed"), (seed + 1000, "random")):
            t = be.time(shape, ids, [cfg] * 4, reps=16, seed=seed, order_seed=order_seed)
            cand, *copies = [list(x.samples_us) for x in t]
            v = verdict.compare(copies, cand, margin=0.0)
            if order_seed is None:
                fixed += v.faster
            else:
                random += v.faster
    assert fixed >= 30  # the first arm of every round gains 0.4-1.2%: "faster" almost always
    assert random <= 2


def _arm(rid: str, role: str, cfg: str, samples: list[float], comp: str = "replay",
         correct: bool | None = True, tokens: int = 64, cls: str = "uniform") -> Arm:  # fmt: skip
    return Arm(rid, role, cfg, "ok", tuple(samples), correct if role != "control" else None,
               comp, tokens, cls, "t" * 16, 0.005)  # fmt: skip


def _comparison(comp: str, arms: dict[str, tuple[str, str, float]], n: int = 16, seed: int = 0,
                tokens: int = 64) -> list[Arm]:  # fmt: skip
    rng = np.random.default_rng(seed)
    drift = rng.lognormal(0.0, 0.01, n)
    out = []
    for rid, (role, cfg, us) in arms.items():
        s = [us * d * x for d, x in zip(drift, rng.lognormal(0.0, 0.001, n), strict=True)]
        out.append(_arm(f"{comp}-{rid}", role, cfg, s, comp, tokens=tokens))
    return out


COPIES = {"base": ("baseline", "B", 100.0), "ctl-a": ("control", "B", 100.0),
          "ctl-b": ("control", "B", 100.0)}  # fmt: skip


def test_decide_verifies_only_what_wins_every_held_out_instance() -> None:
    replay = _comparison("replay", {**COPIES, "fin01": ("candidate", "W", 90.0)})
    held = [
        a
        for i in range(3)
        for a in _comparison(
            f"heldout-{i + 1}", {**COPIES, "cand": ("candidate", "W", 92.0)}, seed=i + 1
        )
    ]
    d = pointverdict.decide([*replay, *held])
    assert d.status == "verified" and d.config_hash == "W" and d.confidence == 1.0
    assert d.evidence == "replay-fin01" and d.speedup == pytest.approx(100 / 90, rel=0.01)
    assert [v["won"] for v in d.validation] == [True, True, True]
    # one held-out instance where it is not faster: FlagGems' choice stands at the key
    lost = _comparison("heldout-3", {**COPIES, "cand": ("candidate", "W", 100.0)}, seed=9)
    d2 = pointverdict.decide([*replay, *held[: 2 * 4], *lost])
    assert d2.status == "baseline" and d2.config_hash == "B"
    assert d2.confidence == pytest.approx(2 / 3) and "won 2 of 3" in d2.reason
    # fewer held-out instances than required: not verified
    d3 = pointverdict.decide([*replay, *held[:4]])
    assert d3.status == "baseline" and "at least 3" in d3.reason


def test_a_peer_row_that_beats_flaggems_sets_the_bar() -> None:
    def held(cfg: str, us: float, peer_us: float | None = None) -> list[Arm]:
        out: list[Arm] = []
        for i in range(3):
            arms = {**COPIES, "cand": ("candidate", cfg, us)}
            if peer_us is not None:
                arms["peer"] = ("peer", "P", peer_us)
            out += _comparison(f"heldout-{i + 1}", arms, seed=i + 5)
        return out

    # the candidate is 1% faster than vLLM's row, within what the paired interval resolves
    # at this noise: the entry is vLLM's row, verified as such
    replay = _comparison(
        "replay", {**COPIES, "fin01": ("candidate", "W", 89.9), "fin02": ("peer", "P", 90.0)}
    )
    d = pointverdict.decide([*replay, *held("P", 90.0)])
    assert d.status == "verified" and d.config_hash == "P"
    # clearly faster than vLLM's row too: the candidate, and held-out checks it against both
    replay2 = _comparison(
        "replay", {**COPIES, "fin01": ("candidate", "W", 80.0), "fin02": ("peer", "P", 90.0)}
    )
    d2 = pointverdict.decide([*replay2, *held("W", 80.0, 90.0)])
    assert d2.status == "verified" and d2.config_hash == "W"
    # on held-out routing it is slower than vLLM's row: not verified
    d3 = pointverdict.decide([*replay2, *held("W", 95.0, 90.0)])
    assert d3.status == "baseline"


def test_an_adjacent_class_instance_is_won_only_if_no_peer_row_is_faster_there() -> None:
    replay = _comparison(
        "replay", {**COPIES, "fin01": ("candidate", "W", 80.0), "fin02": ("peer", "P", 99.0)}
    )
    held = [
        a
        for i in range(3)
        for a in _comparison(
            f"heldout-{i + 1}", {**COPIES, "cand": ("candidate", "W", 80.0)}, seed=i + 11
        )
    ]

    def klass(peer_us: float | None) -> list[Arm]:
        arms = {**COPIES, "cand": ("candidate", "W", 95.0)}
        if peer_us is not None:
            arms["peer"] = ("peer", "P", peer_us)
        return _comparison("class-1", arms, seed=21)

    def class_won(arms: list[Arm]) -> bool:
        d = pointverdict.decide([*replay, *held, *arms], rule=2)
        assert d.status == "verified"
        (v,) = [v for v in d.validation if v["comparison"] == "class-1"]
        return bool(v["won"])

    # faster than FlagGems' choice on the other source's instance; no peer row timed there
    # (bundles before the peers' rows joined class-N comparisons): won
    assert class_won(klass(None))
    # vLLM's row is faster than the choice there: an adjacent-class answer must not rely on it
    assert not class_won(klass(90.0))
    # the choice is not slower than vLLM's row there: won
    assert class_won(klass(97.0))


def test_wrong_results_and_nothing_compared() -> None:
    wrong = [
        *_comparison("replay", COPIES),
        _arm("replay-fin01", "candidate", "W", [50.0] * 16, correct=False),
    ]
    d = pointverdict.decide(wrong)
    assert d.status == "none"  # nothing correct was compared with FlagGems' choice
    assert pointverdict.decide(_comparison("replay", COPIES)).status == "none"


def _parity_point(peer_us: list[float], replay_us: float = 99.9) -> list[Arm]:
    """A point whose candidates lose, with vLLM's row at ``replay_us`` on the replay and at
    ``peer_us[i]`` on held-out instance i (FlagGems' choice at 100)."""
    replay = _comparison(
        "replay", {**COPIES, "fin01": ("candidate", "W", 101.0), "fin02": ("peer", "P", replay_us)}
    )
    held = [
        a
        for i, us in enumerate(peer_us)
        for a in _comparison(f"heldout-{i + 1}", {**COPIES, "peer": ("peer", "P", us)}, seed=i + 7)
    ]
    return [*replay, *held]


def test_rule_2_answers_a_peer_row_at_parity() -> None:
    arms = _parity_point([99.8, 100.0, 99.9])
    # rule 1: nothing beat FlagGems' choice beyond the margin, so it stands
    assert pointverdict.decide(arms).status == "baseline"
    d = pointverdict.decide(arms, rule=2)
    assert d.status == "parity" and d.config_hash == "P" and d.evidence == "replay-fin02"
    assert d.speedup is not None and 1.0 < d.speedup < 1.005
    assert [v["comparison"] for v in d.validation] == ["heldout-1", "heldout-2", "heldout-3"]
    # won: at least as fast as FlagGems' choice on that instance (not slower on any of them)
    assert sum(v["won"] for v in d.validation) == 2 and d.confidence == pytest.approx(2 / 3)
    assert "held-out" in d.reason


def test_rule_2_keeps_flaggems_choice_where_the_peer_row_is_not_at_parity() -> None:
    # slower than FlagGems' choice on one held-out instance
    assert pointverdict.decide(_parity_point([99.8, 103.0, 99.9]), rule=2).status == "baseline"
    # never slower, but not faster pooled either
    assert pointverdict.decide(_parity_point([100.1, 100.2, 100.1], 100.1), rule=2).status == (
        "baseline"
    )
    # timed on fewer held-out instances than required
    assert pointverdict.decide(_parity_point([99.8, 99.9]), rule=2).status == "baseline"
    # slower on the replay: no parity row at all
    assert pointverdict.parity_row(_parity_point([99.0] * 3, 104.0)) is None
    # a verified point stays verified under rule 2
    replay = _comparison("replay", {**COPIES, "fin01": ("candidate", "W", 90.0)})
    held = [
        a
        for i in range(3)
        for a in _comparison(f"heldout-{i + 1}", {**COPIES, "cand": ("candidate", "W", 92.0)})
    ]
    assert pointverdict.decide([*replay, *held], rule=2).status == "verified"


def _choice_point(held_us: list[float], peer: tuple[float, list[float]] | None = None) -> list[Arm]:
    """A point whose replay chose W (97 against FlagGems' 100), timed at ``held_us[i]`` on
    held-out instance i; ``peer``: vLLM's row on the replay and on each instance."""
    arms = {**COPIES, "fin01": ("candidate", "W", 97.0)}
    if peer is not None:
        arms["fin02"] = ("peer", "P", peer[0])
    out = _comparison("replay", arms)
    for i, us in enumerate(held_us):
        inst = {**COPIES, "cand": ("candidate", "W", us)}
        if peer is not None:
            inst["peer"] = ("peer", "P", peer[1][i])
        out += _comparison(f"heldout-{i + 1}", inst, seed=i + 31)
    return out


def test_rule_3_answers_the_choice_that_lost_its_verification_to_a_tie() -> None:
    arms = _choice_point([97.0, 99.9, 97.5])  # even with FlagGems' choice on instance 2
    assert pointverdict.decide(arms, rule=2).status == "baseline"
    d = pointverdict.decide(arms, rule=3)
    assert d.status == "parity" and d.config_hash == "W" and d.evidence == "replay-fin01"
    # pooled over the held-out instances only: (97 + 99.9 + 97.5) / 3 against 100
    assert d.speedup == pytest.approx(100 / 98.1, rel=0.01)
    assert [v["comparison"] for v in d.validation] == ["heldout-1", "heldout-2", "heldout-3"]
    assert d.confidence == 1.0 and "held-out" in d.reason
    # a verified point is unchanged by rule 3
    assert pointverdict.decide(_choice_point([97.0, 97.5, 97.2]), rule=3).status == "verified"


def test_rule_3_keeps_flaggems_choice_where_the_choice_lost_an_instance() -> None:
    # slower than FlagGems' choice on one held-out instance
    assert pointverdict.decide(_choice_point([97.0, 103.0, 97.5]), rule=3).status == "baseline"
    # timed on fewer held-out instances than required
    assert pointverdict.decide(_choice_point([97.0, 99.9]), rule=3).status == "baseline"
    # slower than the peer row that set the bar on an instance (the row itself lost one to
    # FlagGems' choice, so it is no parity record either)
    bar = (99.0, [101.5, 95.0, 97.0])
    assert pointverdict.decide(_choice_point([97.0, 99.9, 97.5], bar), rule=3).status == (
        "baseline"
    )


def test_run_schema_names_the_rule() -> None:
    assert pointverdict.RUN_SCHEMA_OF_RULE[pointverdict.RULE] == "1.3"
    for rule, version in pointverdict.RUN_SCHEMA_OF_RULE.items():
        assert pointverdict.rule_of_run_schema(version) == rule
    assert pointverdict.rule_of_run_schema("1.0") == pointverdict.rule_of_run_schema(None) == 1
