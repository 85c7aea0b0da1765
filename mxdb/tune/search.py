"""The multi-fidelity search of one tuning point (DESIGN section 7), on an injected backend.

Ladder, cheapest first:

1. **proxy**: the resource proxy drops configs that cannot fit the device; nothing is compiled.
2. **compile**: the survivors are compiled (the backend parallelizes); failures are recorded.
3. **synthetic**: successive halving of the uniform configs (one config for both GEMMs) on
   generated routing of the point's kind (a different seed than the replayed trace), ``eta``
   = 3 by default: each rung keeps the best third and times it with ``eta`` times the samples.
   Rung 0 always holds the seeds' line neighbourhood (every uniform config one field away from
   FlagGems' choice or a peer seed), whatever ``max_candidates`` draws.  Given a learned
   performance model (``mxdb.costmodel``), the search ranks every uniform config the proxy
   lets through by the model's predicted speedup at the point's key (shape, M, routing class:
   one batched prediction on the CPU, no GPU) and only the best ``model_keep`` enter rung 0,
   in place of ``max_candidates``' random draw, beside FlagGems' choice, the peer seeds and
   their line neighbourhood, which always enter (:func:`model_ranking`).
   Then a joint refinement: per-GEMM screens, then coordinate descent on GEMM1 with GEMM2
   fixed, then GEMM2 with GEMM1 fixed, moving one field to any other grid value (and
   BLOCK_SIZE_M of both GEMMs at once, since the alignment block couples them), with the
   alignment block the smallest both accept (and its double as a move), every move timed
   interleaved with the incumbent.  Every timing of a point uses the point's seed, so a GPU
   backend builds the point's inputs once.
4. **replay**: the finalists (and the peer tables' configs, always), each also under the other
   layer implementations (``SearchOptions.impls``: the same tiles, and GEMM1 at half the
   ``block_n``), and at batches of at most ``FUSED_SLICE_MAX_SLOTS`` token slots the best
   ``fused_slice`` configs of its own menu (``space.slice_menu``, ranked on the synthetic
   routing), FlagGems' baseline and a same-config control pair (baseline vs baseline) are
   timed interleaved on the workload's stored trace, ``replicates`` times.
5. **layer**: the finalists run the whole layer against the float32 reference; the fastest
   correct one wins.

The budget (seconds on the backend's clock) is checked between batches; when it runs out the
current stage stops with what it measured and the search goes on to the replay and layer
stages, which keep a reserve of the budget.  Every measurement, failures included, is returned.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from mxdb import pointverdict
from mxdb.configs import DEFAULT_IMPL, GemmConfig, KernelConfig
from mxdb.evidence import stats
from mxdb.models import Measurement
from mxdb.resources import VLLM_GRID
from mxdb.results import Correctness, Timing
from mxdb.shapes import MoEShape
from mxdb.tune.backend import Backend
from mxdb.tune.space import SearchSpace, align_for, slice_menu
from mxdb.tune.workload import SearchOptions

if TYPE_CHECKING:
    from mxdb.costmodel.model import PerfModel

#: Configs per backend.time() call in the synthetic rungs (the budget is checked in between).
BATCH = 96
#: Share of the budget kept for the replay and layer stages.
RESERVE = 0.25


@dataclass(frozen=True)
class RoutingInput:
    """A routing to time on: top-k ids, their hash and the class they fall in."""

    ids: np.ndarray
    trace_hash: str
    routing_class: str


@dataclass(frozen=True)
class PointInput:
    """Everything the search of one point needs besides the backend."""

    shape: MoEShape
    replay: RoutingInput
    synthetic: RoutingInput
    seed: int
    run_prefix: str
    fingerprint_hash: str | None = None
    peer_seeds: tuple[KernelConfig, ...] = ()
    #: the peers' table rows among the seeds: FlagGems' choice is not the only bar to clear
    peer_rows: tuple[KernelConfig, ...] = ()
    #: routing instances of the point's class the search never saw (held-out validation)
    heldout: tuple[RoutingInput, ...] = ()
    #: held-out instances at neighbouring token counts (what a neighbour answer relies on)
    neighbours: tuple[RoutingInput, ...] = ()
    #: instances of the workload's other routing sources at the point's token count (what an
    #: answer for an adjacent routing class relies on)
    classes: tuple[RoutingInput, ...] = ()


@dataclass
class SearchResult:
    """The outcome of one point's search: every measurement and the winner (if any)."""

    shape: MoEShape
    measurements: list[Measurement]
    baseline: KernelConfig
    winner: KernelConfig | None
    winner_samples: list[float]
    baseline_samples: list[float]
    control_samples: tuple[list[float], list[float]]
    correctness: Correctness | None
    budget_exhausted: bool
    spent_s: float
    stages: dict[str, int] = field(default_factory=dict)
    winner_run_id: str | None = None
    #: uniform configs by synthetic median (best first), for benchmarks and diagnostics
    ranking: list[tuple[KernelConfig, float]] = field(default_factory=list)
    #: the peer table row that beat FlagGems' choice and so sets the bar (mxdb.pointverdict)
    peer_bar: KernelConfig | None = None
    #: the replay's parity row (``mxdb.pointverdict.parity_row``): timed on the held-out
    #: instances too, so that a point nothing beats can still answer the peer's row
    parity_peer: KernelConfig | None = None
    #: with a performance model: the uniform configs it let into rung 0 (best first), each
    #: with its predicted speedup over FlagGems' choice
    model_kept: list[tuple[KernelConfig, float]] = field(default_factory=list)
    #: host seconds the model's ranking took (CPU; no GPU time)
    model_s: float = 0.0


class _Recorder:
    """Builds Measurements with unique run ids and the point's common fields."""

    def __init__(self, point: PointInput, method: str) -> None:
        self.point = point
        self.method = method
        self.items: list[Measurement] = []
        self._n = 0

    def next_id(self, tag: str) -> str:
        self._n += 1
        return f"{self.point.run_prefix}-{tag}{self._n:05d}"

    def add(
        self,
        config: KernelConfig,
        *,
        fidelity: str,
        status: str,
        role: str = "candidate",
        samples: Sequence[float] = (),
        error: str | None = None,
        routing: RoutingInput | None = None,
        correctness: Correctness | None = None,
        run_id: str | None = None,
        shape: MoEShape | None = None,
        comparison: str | None = None,
        margin: float | None = None,
        order_seed: int | None = None,
    ) -> Measurement:
        s = shape or self.point.shape
        samples = [float(x) for x in samples]
        timed = bool(samples)
        m = Measurement(
            run_id=run_id or self.next_id(fidelity[0]),
            op=s.op,
            dtype=s.dtype,
            family=s.family,
            dims=s.dims(),
            tokens=s.tokens,
            routing_class=(routing or self.point.replay).routing_class,
            trace_hash=routing.trace_hash if routing is not None else None,
            seed=self.point.seed,
            config=config.model_dump(),
            config_hash=config.hash,
            role=role,  # type: ignore[arg-type,unused-ignore]
            fidelity=fidelity,
            status=status,  # type: ignore[arg-type,unused-ignore]
            error=error,
            samples_us=samples,
            median_us=stats.median(samples) if timed else None,
            p90_us=stats.p90(samples) if timed else None,
            max_abs_err=correctness.max_abs_err if correctness is not None else None,
            rel_err=correctness.rel_err if correctness is not None else None,
            timing_method=self.method if timed else None,
            fingerprint_hash=self.point.fingerprint_hash,
            point=self.point.run_prefix if comparison is not None else None,
            comparison=comparison,
            margin=margin,
            order_seed=order_seed,
            decision_rule=pointverdict.RULE if comparison is not None else None,
        )
        self.items.append(m)
        return m


class _Budget:
    def __init__(self, budget_s: float | None, clock: Callable[[], float]) -> None:
        self.budget_s = budget_s
        self.clock = clock
        self.t0 = clock()
        self.exhausted = False

    def spent(self) -> float:
        return self.clock() - self.t0

    def left(self, reserve: float = 0.0) -> bool:
        """Whether there is budget left beyond ``reserve`` (a share of the whole budget)."""
        if self.budget_s is None:
            return True
        ok = self.spent() < self.budget_s * (1.0 - reserve)
        if not ok:
            self.exhausted = True
        return ok


def search(
    backend: Backend,
    point: PointInput,
    options: SearchOptions,
    *,
    space: SearchSpace,
    budget_s: float | None = None,
    clock: Callable[[], float] | None = None,
    method: str = "graph",
    model: PerfModel | None = None,
) -> SearchResult:
    """Search one point; see the module docstring for the ladder.

    ``model``: a learned performance model that orders and prunes rung 0 (the module
    docstring, :func:`model_ranking`); without one the first rung is drawn as always.
    """
    clk = clock or getattr(backend, "clock", None) or time.monotonic
    budget = _Budget(budget_s, clk)
    rec = _Recorder(point, method)
    shape = point.shape
    stages: dict[str, int] = {}
    baseline = backend.baseline_config(shape)

    # 1. resource proxy over the uniform grid and the seeds
    seeds = [c for c in (*point.peer_seeds,) if c.hash != baseline.hash]
    # FlagGems' choice enters rung 0 too: it is often near the optimum, and when it ranks
    # first the joint refinement hill-climbs from it (it never wins itself: the finalists
    # exclude it, being the baseline they are compared with)
    # so does the seeds' neighbourhood: every uniform config one field away from FlagGems'
    # choice or a peer seed (a line search along each field), kept whatever max_candidates
    # draws: at decode sizes the optimum is usually a few fields away from the seeds
    near = _dedup(
        [KernelConfig.uniform(g) for c in (baseline, *seeds) for g in _line(space, c.gemm1)]
        if options.seed_lines
        else []
    )
    model_kept: list[tuple[KernelConfig, float]] = []
    model_s = 0.0
    if model is not None:
        # the model's best uniform configs take the random draw's place; FlagGems' choice, the
        # peer seeds and their line neighbourhood enter whatever the model predicts for them
        t_model = time.monotonic()
        ranked = model_ranking(model, space, shape, point.replay.routing_class)
        model_s = time.monotonic() - t_model
        model_kept = ranked[: options.model_keep]
        pool = _dedup([*(c for c, _ in model_kept), *seeds, baseline, *near])
        stages["model_ranked"] = len(ranked)
        stages["model_kept"] = len(model_kept)
    else:
        pool = _dedup([*space.uniform(), *seeds, baseline])
        if options.max_candidates is not None and len(pool) > options.max_candidates:
            rng = np.random.default_rng(point.seed)
            keep = set(rng.choice(len(pool), size=options.max_candidates, replace=False).tolist())
            seed_hashes = {c.hash for c in (*seeds, *near)} | {baseline.hash}
            pool = [c for i, c in enumerate(pool) if i in keep or c.hash in seed_hashes]
        pool = _dedup([*pool, *near])
    kept, dropped = space.prune(pool)
    for p in dropped:
        rec.add(p.config, fidelity="proxy", status="oor", error=p.reason)
    stages["proxy_rejected"] = len(dropped)

    # 2. compile
    compiled = _compile(backend, shape, kept, rec)
    stages["compiled"] = len(kept)
    stages["compile_failed"] = len(kept) - len(compiled)

    # 3a. successive halving of uniform configs on synthetic routing
    samples: dict[str, list[float]] = {}
    by_hash = {c.hash: c for c in compiled}
    ranked_hashes, rung0 = _halving(
        backend, point, options, compiled, rec, budget, samples, method, seed=point.seed
    )
    stages["synthetic_timed"] = sum(1 for m in rec.items if m.fidelity == "synthetic")
    stages["halving_timed"] = sum(1 for m in rec.items if m.fidelity in ("synthetic", "replay"))
    ranking = [(by_hash[h], stats.median(samples[h])) for h in ranked_hashes]
    ranking_cfgs = [c for c, _ in ranking]

    # 3b. joint refinement: each GEMM on its own, then hill-climbing
    refined: list[KernelConfig] = []
    if options.joint and ranking_cfgs and budget.left(RESERVE):
        # GEMM1 carries most of the layer's time, so the uniform ranking already screens it:
        # its pool is the best 1/eta of rung 0; GEMM2's pool is every config that ran
        n_top = max(options.finalists, len(rung0) // options.eta)
        top = [by_hash[h].gemm1 for h in rung0[:n_top]]
        n_pool2 = len(rung0) if options.gemm2_pool is None else max(n_top, options.gemm2_pool)
        pools = {"gemm2": [by_hash[h].gemm1 for h in rung0[:n_pool2]], "gemm1": top}
        refined = _per_gemm(
            backend, space, point, options, ranking_cfgs[0], pools, rec, budget, method
        )
        refined = (
            _refine(
                backend,
                space,
                point,
                options,
                [*refined, *ranking_cfgs],
                rec,
                budget,
                samples,
                method,
            )
            + refined
        )
    stages["refine_timed"] = (
        sum(1 for m in rec.items if m.fidelity in ("synthetic", "replay")) - stages["halving_timed"]
    )

    # 4. finalists on the replayed routing, with the baseline and a control pair
    finalists = _dedup([*refined, *ranking_cfgs])
    finalists = [c for c in finalists if c.hash != baseline.hash][: options.finalists]
    # the peer tables' configs that compiled always reach the replayed comparison too (even
    # when the budget ran out before the synthetic rungs), so that a verified answer is never
    # one a peer's table beats on the point's own routing
    ok = {c.hash for c in compiled}
    chosen = {c.hash for c in finalists}
    finalists += [c for c in seeds if c.hash in ok and c.hash not in chosen]
    # 4a. the same tiles under the other layer implementations the backend runs
    impls = implementations(backend, options)
    variants = impl_variants(finalists, impls)
    kept_v, dropped_v = space.prune(variants)
    for p in dropped_v:
        rec.add(p.config, fidelity="proxy", status="oor", error=p.reason)
    finalists += _compile(backend, shape, kept_v, rec)
    stages["impl_variants"] = len(variants)
    # 4b. small batches: the one-kernel layer, on tiles of its own (FlagGems' tiles do not
    # carry over), ranked on the synthetic routing; its best few join the finalists
    if "fused_slice" in impls:
        finalists += _slice_finalists(backend, point, options, space, rec, budget, method)
    result = SearchResult(
        shape=shape,
        measurements=rec.items,
        baseline=baseline,
        winner=None,
        winner_samples=[],
        baseline_samples=[],
        control_samples=([], []),
        correctness=None,
        budget_exhausted=False,
        spent_s=0.0,
        stages=stages,
        ranking=ranking,
        model_kept=model_kept,
        model_s=model_s,
    )
    peer_hashes = frozenset(c.hash for c in point.peer_rows)
    _replay_and_check(
        backend, point, options, baseline, finalists, rec, budget, result, method, peer_hashes
    )
    validate(backend, point, options, result, rec, method)
    result.budget_exhausted = budget.exhausted
    result.spent_s = budget.spent()
    return result


def model_ranking(
    model: PerfModel, space: SearchSpace, shape: MoEShape, routing_class: str
) -> list[tuple[KernelConfig, float]]:
    """Every uniform config of ``space`` that the resource proxy lets through, ranked by
    ``model``'s predicted speedup over FlagGems' choice at (``shape``, ``routing_class``),
    best first (ties in grid order), each with that speedup.

    One batched prediction on the CPU: the feature rows of the whole grid
    (``mxdb.costmodel.features``) through the model's trees (``mxdb.costmodel.trees``; the
    ensemble's mean predicted log speedup).
    """
    from mxdb.costmodel.features import features, version_of
    from mxdb.costmodel.trees import predict

    fits = [c for c in space.uniform() if space.verdict(c) is None]
    if not fits:
        return []
    version = version_of(model.forest.get("n_features"))
    logs = predict(model.forest, [features(shape, routing_class, c, version) for c in fits])
    order = sorted(range(len(fits)), key=lambda j: (-logs[j], j))
    return [(fits[j], math.exp(logs[j])) for j in order]


def implementations(backend: Backend, options: SearchOptions) -> list[str]:
    """The layer implementations besides FlagGems' that the search times: those the workload
    asks for (``SearchOptions.impls``) that the backend runs (its ``impls`` attribute; a
    backend without one runs FlagGems' kernels only)."""
    runs = getattr(backend, "impls", (DEFAULT_IMPL,))
    return [i for i in options.impls if i != DEFAULT_IMPL and i in runs]


#: Implementations that run FlagGems' GEMM tiles (``fused_slice`` has tiles of its own:
#: ``mxdb.tune.space.slice_menu``).
TILE_IMPLS = ("fused_act",)

#: ``fused_slice`` configs that reach the replayed comparison.
SLICE_FINALISTS = 3


def impl_variants(configs: Sequence[KernelConfig], impls: Sequence[str]) -> list[KernelConfig]:
    """Each FlagGems config under every implementation of ``impls`` that runs FlagGems' tiles,
    and with GEMM1's ``block_n`` halved: ``fused_act``'s GEMM1 program reads a gate and an up
    tile, twice the weight rows of the same ``block_n``."""
    out: list[KernelConfig] = []
    tiled = [i for i in impls if i in TILE_IMPLS]
    for c in configs:
        if c.impl != DEFAULT_IMPL:
            continue
        for impl in tiled:
            out.append(c.with_impl(impl))
            g1 = c.gemm1
            if g1.block_n >= 32:
                half = g1.model_copy(update={"block_n": g1.block_n // 2})
                out.append(c.model_copy(update={"gemm1": half, "impl": impl}))
    seen = {c.hash for c in configs}
    return [c for c in _dedup(out) if c.hash not in seen]


def _slice_finalists(
    backend: Backend,
    point: PointInput,
    options: SearchOptions,
    space: SearchSpace,
    rec: _Recorder,
    budget: _Budget,
    method: str,
) -> list[KernelConfig]:
    """The best :data:`SLICE_FINALISTS` of ``slice_menu`` on the synthetic routing (none past
    its batch limit)."""
    menu = slice_menu(point.shape)
    if not menu or not budget.left(RESERVE):
        return []
    kept, dropped = space.prune(menu)
    for p in dropped:
        rec.add(p.config, fidelity="proxy", status="oor", error=p.reason)
    compiled = _compile(backend, point.shape, kept, rec)
    local: dict[str, list[float]] = {}
    timed = _time_batches(
        backend,
        point.shape,
        point.synthetic,
        compiled,
        options.refine_reps,
        point.seed,
        rec,
        budget,
        local,
        method,
    )
    by_hash = {c.hash: c for c in compiled}
    return [by_hash[h] for h in _rank(timed, local)[:SLICE_FINALISTS]]


def _line(space: SearchSpace, g: GemmConfig) -> list[GemmConfig]:
    return space.neighbours(g, line=True)


def _dedup(configs: Sequence[KernelConfig]) -> list[KernelConfig]:
    seen: set[str] = set()
    out = []
    for c in configs:
        h = c.hash
        if h not in seen:
            seen.add(h)
            out.append(c)
    return out


def _compile(
    backend: Backend, shape: MoEShape, configs: Sequence[KernelConfig], rec: _Recorder
) -> list[KernelConfig]:
    if not configs:
        return []
    results = backend.compile(shape, list(configs))
    ok = []
    for cfg, res in zip(configs, results, strict=True):
        if res.status == "ok":
            ok.append(cfg)
        else:
            rec.add(cfg, fidelity="compile", status=res.status, error=res.error)
    return ok


def _time_batches(
    backend: Backend,
    shape: MoEShape,
    routing: RoutingInput,
    configs: Sequence[KernelConfig],
    reps: int,
    seed: int,
    rec: _Recorder,
    budget: _Budget,
    samples: dict[str, list[float]],
    method: str,
    *,
    reserve: float = RESERVE,
    fidelity: str = "synthetic",
) -> list[str]:
    """Time configs in batches; record every result; return the hashes timed successfully."""
    ok: list[str] = []
    for start in range(0, len(configs), BATCH):
        if start and not budget.left(reserve):
            break
        batch = list(configs[start : start + BATCH])
        timings = backend.time(shape, routing.ids, batch, reps=reps, seed=seed, method=method)
        for cfg, t in zip(batch, timings, strict=True):
            _record_timing(rec, cfg, t, routing, fidelity)
            if t.status == "ok" and t.samples_us:
                samples.setdefault(cfg.hash, []).extend(t.samples_us)
                ok.append(cfg.hash)
    return ok


def _record_timing(
    rec: _Recorder, cfg: KernelConfig, t: Timing, routing: RoutingInput, fidelity: str
) -> None:
    if t.status == "ok" and t.samples_us:
        rec.add(cfg, fidelity=fidelity, status="ok", samples=t.samples_us, routing=routing)
    else:
        status = t.status if t.status != "ok" else "timeout"
        rec.add(
            cfg, fidelity=fidelity, status=status, error=t.error or "no samples", routing=routing
        )


def _rank(hashes: Sequence[str], samples: dict[str, list[float]]) -> list[str]:
    return sorted(hashes, key=lambda h: (stats.median(samples[h]), h))


def _halving(
    backend: Backend,
    point: PointInput,
    options: SearchOptions,
    configs: Sequence[KernelConfig],
    rec: _Recorder,
    budget: _Budget,
    samples: dict[str, list[float]],
    method: str,
    *,
    seed: int,
) -> tuple[list[str], list[str]]:
    """Successive halving; returns (final ranking of the last rung's field, rung 0's ranking)."""
    by_hash = {c.hash: c for c in configs}
    field_ = list(configs)
    reps = options.synthetic_reps
    ranked: list[str] = []
    rung0: list[str] = []
    for rung in range(options.halving_rounds + 1):
        if not field_ or not budget.left(RESERVE):
            break
        # rung 0 cuts the field on synthetic routing; the survivors are timed on the replayed
        # trace, whose exact per-expert counts decide padding and so the best tiles
        routing, fid = (point.synthetic, "synthetic") if rung == 0 else (point.replay, "replay")
        if rung == 1:
            for c in field_:
                samples.pop(c.hash, None)  # rank on replayed samples only from here on
        local: dict[str, list[float]] = {}
        _time_batches(
            backend,
            point.shape,
            routing,
            field_,
            reps,
            seed,
            rec,
            budget,
            local,
            method,
            fidelity=fid,
        )
        for h, s in local.items():
            samples.setdefault(h, []).extend(s)
        # rank on every sample so far of the configs still in the field
        ranked = _rank([c.hash for c in field_ if c.hash in local], samples)
        if rung == 0:
            rung0 = ranked
        if rung == options.halving_rounds or len(ranked) <= options.finalists:
            break
        n_keep = max(options.finalists, math.ceil(len(ranked) / options.eta))
        field_ = [by_hash[h] for h in ranked[:n_keep]]
        reps = min(reps * 2, 64)
    return ranked, rung0


def _per_gemm(
    backend: Backend,
    space: SearchSpace,
    point: PointInput,
    options: SearchOptions,
    start: KernelConfig,
    pools: dict[str, list[GemmConfig]],
    rec: _Recorder,
    budget: _Budget,
    method: str,
) -> list[KernelConfig]:
    """Screen ``pools["gemm2"]`` as GEMM2 (GEMM1 fixed), then ``pools["gemm1"]`` as GEMM1."""
    g1, g2 = start.gemm1, start.gemm2
    found: list[KernelConfig] = []
    for which in ("gemm2", "gemm1"):
        if not budget.left(RESERVE):
            break
        pool = pools[which]
        cands = _dedup([_pair(g, g2) if which == "gemm1" else _pair(g1, g) for g in pool])
        kept, dropped = space.prune(cands)
        for p in dropped:
            rec.add(p.config, fidelity="proxy", status="oor", error=p.reason)
        compiled = _compile(backend, point.shape, kept, rec)
        if not compiled:
            continue
        local: dict[str, list[float]] = {}
        ranked, _ = _halving(
            backend,
            point,
            options,
            compiled,
            rec,
            budget,
            local,
            method,
            seed=point.seed,
        )
        if not ranked:
            continue
        best = next(c for c in compiled if c.hash == ranked[0])
        g1, g2 = best.gemm1, best.gemm2
        found.append(best)
    return found[::-1]


def _with_bm(g: GemmConfig, bm: int) -> GemmConfig | None:
    try:
        return GemmConfig(**{**g.model_dump(), "block_m": bm})
    except ValueError:
        return None


def _pair(g1: GemmConfig, g2: GemmConfig) -> KernelConfig:
    return KernelConfig(gemm1=g1, gemm2=g2, align_block=align_for(g1, g2))


def _refine(
    backend: Backend,
    space: SearchSpace,
    point: PointInput,
    options: SearchOptions,
    ranking: Sequence[KernelConfig],
    rec: _Recorder,
    budget: _Budget,
    samples: dict[str, list[float]],
    method: str,
) -> list[KernelConfig]:
    """Hill-climb GEMM1, then GEMM2, from the best uniform config; return the incumbents."""
    shape = point.shape
    syn = point.replay
    top = ranking[0]
    g1, g2, align = top.gemm1, top.gemm2, top.align_block
    incumbent = top
    history = [incumbent]
    tried: set[str] = set()
    # the GEMM configs of the next few uniform survivors are moves too: a good tile for the
    # whole layer is often a good tile for one GEMM
    extra: list[GemmConfig] = [c.gemm1 for c in ranking[1 : 1 + options.eta]]
    for _ in range(options.refine_steps):
        moved = False
        for which in ("gemm1", "gemm2"):
            if not budget.left(RESERVE):
                return _dedup(history[::-1])
            cur = g1 if which == "gemm1" else g2
            moves = [*_line(space, cur), *extra]
            cands = []
            if which == "gemm1":
                # the alignment block couples the GEMMs: a larger BLOCK_SIZE_M pads the other
                # GEMM's experts too, so block_m also moves for both GEMMs at once
                for bm in VLLM_GRID["block_m"]:
                    if bm != g1.block_m or bm != g2.block_m:
                        j1, j2 = _with_bm(g1, bm), _with_bm(g2, bm)
                        if j1 is not None and j2 is not None:
                            c = KernelConfig(gemm1=j1, gemm2=j2, align_block=bm)
                            if c.hash not in tried and c.hash != incumbent.hash:
                                tried.add(c.hash)
                                cands.append(c)
            for g in moves:
                a1, a2 = (g, g2) if which == "gemm1" else (g1, g)
                base_align = align_for(a1, a2)
                for al in (base_align, base_align * 2) if options.align_moves else (base_align,):
                    if al > 256:
                        continue
                    c = KernelConfig(gemm1=a1, gemm2=a2, align_block=al)
                    if c.hash not in tried and c.hash != incumbent.hash:
                        tried.add(c.hash)
                        cands.append(c)
            kept, dropped = space.prune(cands)
            for p in dropped:
                rec.add(p.config, fidelity="proxy", status="oor", error=p.reason)
            compiled = _compile(backend, shape, kept, rec)
            if not compiled:
                continue
            local: dict[str, list[float]] = {}
            ok = _time_batches(
                backend,
                shape,
                syn,
                [incumbent, *compiled],
                options.refine_reps,
                point.seed,
                rec,
                budget,
                local,
                method,
                fidelity="replay",
            )
            for h, s in local.items():
                samples.setdefault(h, []).extend(s)
            if incumbent.hash not in local:
                continue
            best_h = _rank(ok, local)[0]
            # move only on a clear win within the same interleaved call
            if best_h != incumbent.hash and stats.median(local[best_h]) < stats.median(
                local[incumbent.hash]
            ):
                incumbent = next(c for c in compiled if c.hash == best_h)
                g1, g2, align = incumbent.gemm1, incumbent.gemm2, incumbent.align_block
                history.append(incumbent)
                moved = True
        if not moved:
            break
    del align
    return _dedup(history[::-1])


def order_seed(point_seed: int, comparison: str, replicate: int) -> int:
    """The seed of one replicate's randomized interleaving order (recorded with its runs)."""
    text = f"{point_seed}|{comparison}|{replicate}"
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:4], "big")


def timed_comparison(
    backend: Backend,
    shape: MoEShape,
    routing: RoutingInput,
    lineup: Sequence[KernelConfig],
    *,
    comparison: str,
    replicates: int,
    reps: int,
    seed: int,
    method: str,
    budget: _Budget | None = None,
) -> tuple[list[list[float]], dict[int, Timing], int]:
    """Time ``lineup`` interleaved, each replicate in its own random order per round.

    Returns each arm's samples (index ``r`` of every arm is round ``r``), the first failure of
    each arm that failed, and the order seed of the first replicate.  An arm that fails in one
    replicate loses its samples: its rounds would no longer pair with the others'.
    """
    acc: list[list[float]] = [[] for _ in lineup]
    failure: dict[int, Timing] = {}
    first_seed = order_seed(seed, comparison, 0)
    for r in range(replicates):
        # at least two replicates even on an exhausted budget: a claim needs repeated samples
        if r >= 2 and budget is not None and not budget.left(0.0):
            break
        timings = backend.time(
            shape,
            routing.ids,
            list(lineup),
            reps=reps,
            seed=seed,
            method=method,
            order_seed=order_seed(seed, comparison, r),
        )
        for j, t in enumerate(timings):
            if t.status == "ok" and t.samples_us and len(t.samples_us) == reps:
                acc[j].extend(t.samples_us)
            elif j not in failure:
                failure[j] = t
    for j in failure:
        acc[j] = []
    return acc, failure, first_seed


#: Same-config copies of FlagGems' choice in every comparison: the baseline and two controls.
COPIES = 3


def _replay_and_check(
    backend: Backend,
    point: PointInput,
    options: SearchOptions,
    baseline: KernelConfig,
    finalists: Sequence[KernelConfig],
    rec: _Recorder,
    budget: _Budget,
    result: SearchResult,
    method: str,
    peers: frozenset[str] = frozenset(),
) -> None:
    shape = point.shape
    routing = point.replay
    lineup = [*([baseline] * COPIES), *finalists]
    acc, failure, oseed = timed_comparison(
        backend,
        shape,
        routing,
        lineup,
        comparison="replay",
        replicates=options.replicates,
        reps=options.replay_reps,
        seed=point.seed,
        method=method,
        budget=budget,
    )
    result.stages["replicates"] = max(1, len(acc[0]) // options.replay_reps)

    # 5. layer check of the finalists (fastest first), then of the baseline
    finals = [(j, c) for j, c in enumerate(lineup) if j >= COPIES and acc[j]]
    finals.sort(key=lambda jc: stats.median(acc[jc[0]]))
    checks: dict[int, Correctness] = {}
    for j, cfg in finals:
        checks[j] = backend.check(shape, routing.ids, cfg, seed=options.check_seed)
    base_check = backend.check(shape, routing.ids, baseline, seed=options.check_seed)

    prefix = point.run_prefix
    common: dict[str, Any] = {
        "comparison": "replay",
        "margin": options.verify_margin,
        "order_seed": oseed,
    }
    ids = [f"{prefix}-base", f"{prefix}-ctl-a", f"{prefix}-ctl-b"]
    for j, rid in enumerate(ids):
        role = "baseline" if j == 0 else "control"
        corr = base_check if j == 0 else None
        _record_final(
            rec, baseline, role, acc[j], failure.get(j), routing, corr, rid, "replay", **common
        )
    index: dict[str, int] = {}  # finalist run id -> its place in the lineup
    for j in range(COPIES, len(lineup)):
        cfg = lineup[j]
        corr = checks.get(j)
        status_override = "wrong" if corr is not None and not corr.passed else None
        rid = f"{prefix}-fin{j - COPIES + 1:02d}"
        index[rid] = j
        _record_final(
            rec,
            cfg,
            "peer" if cfg.hash in peers else "candidate",
            acc[j],
            failure.get(j),
            routing,
            corr,
            rid,
            "layer",
            status_override=status_override,
            **common,
        )
    result.baseline_samples = acc[0]
    result.control_samples = (acc[1], acc[2])
    arms = [pointverdict.arm_from_measurement(m) for m in rec.items if m.comparison == "replay"]
    chosen, bar, _ = pointverdict.choose(arms)
    if chosen is not None:
        j = index[chosen.run_id]
        result.winner = lineup[j]
        result.winner_samples = acc[j]
        result.correctness = checks[j]
        result.winner_run_id = chosen.run_id
    if bar is not None:
        result.peer_bar = lineup[index[bar.run_id]]
    parity = pointverdict.parity_row(arms)
    if parity is not None:
        result.parity_peer = lineup[index[parity.run_id]]


def validate(
    backend: Backend,
    point: PointInput,
    options: SearchOptions,
    result: SearchResult,
    rec: _Recorder,
    method: str,
) -> None:
    """Time the replay's choice on the point's held-out routings (see ``PointInput``).

    Each held-out instance of the point's class is one comparison (``heldout-N``): FlagGems'
    choice and its copies, the choice, and the peer row that set the bar; each neighbouring
    token count's instance (``tokens-M``) compares the choice with FlagGems' choice there, and
    each other routing source's (``class-N``) with FlagGems' choice and the point's peer rows.
    The choice is checked against the reference on every instance.  The replay's parity row
    (``result.parity_peer``), where it is another config, is timed on the held-out instances
    too; where the replay chose nothing, the held-out instances time the parity row alone.
    """
    parity = result.parity_peer
    chosen = result.winner
    comps: list[tuple[str, MoEShape, RoutingInput]] = [
        (f"heldout-{i + 1}", point.shape, r) for i, r in enumerate(point.heldout)
    ]
    if chosen is None:
        if parity is None:
            return
        _validate_parity(backend, point, options, parity, rec, comps, method)
        return
    for r in point.neighbours:
        n = r.ids.shape[0]
        comps.append((f"tokens-{n}", point.shape.with_tokens(n), r))
    comps += [(f"class-{i + 1}", point.shape, r) for i, r in enumerate(point.classes)]
    for name, shape, routing in comps:
        extra = []
        bar = result.peer_bar
        if name.startswith("heldout-"):
            # the bar row and the parity row (usually one config), where not the choice
            extra = [c for c in {c.hash: c for c in (bar, parity) if c is not None}.values()
                     if c.hash != chosen.hash]  # fmt: skip
        elif name.startswith("class-"):
            # a peer's table row does not change with the routing: an answer for an adjacent
            # class must not be slower than the rows of this token count there either
            extra = [c for c in point.peer_rows if c.hash != chosen.hash]
        acc, failure, tag, common = _validation_comparison(
            backend, point, options, rec, name, shape, routing, [chosen, *extra], method
        )
        corr = backend.check(shape, routing.ids, chosen, seed=options.check_seed)
        _record_final(
            rec,
            chosen,
            "candidate",
            acc[COPIES],
            failure.get(COPIES),
            routing,
            corr,
            f"{tag}-cand",
            "layer",
            status_override="wrong" if not corr.passed else None,
            shape=shape,
            **common,
        )
        _record_peers(rec, backend, options, shape, routing, extra, acc, failure, tag, common)


def _validation_comparison(
    backend: Backend,
    point: PointInput,
    options: SearchOptions,
    rec: _Recorder,
    name: str,
    shape: MoEShape,
    routing: RoutingInput,
    arms: Sequence[KernelConfig],
    method: str,
) -> tuple[list[list[float]], dict[int, Timing], str, dict[str, Any]]:
    """Time FlagGems' choice, its two copies and ``arms`` interleaved on one validation
    instance and record the three copies; returns the samples, failures, run-id tag and the
    common fields for the caller to record ``arms`` (lineup positions from ``COPIES`` on)."""
    base = backend.baseline_config(shape)
    acc, failure, oseed = timed_comparison(
        backend,
        shape,
        routing,
        [*([base] * COPIES), *arms],
        comparison=name,
        replicates=options.heldout_replicates,
        reps=options.replay_reps,
        seed=point.seed,
        method=method,
    )
    common: dict[str, Any] = {
        "comparison": name,
        "margin": options.verify_margin,
        "order_seed": oseed,
    }
    tag = f"{point.run_prefix}-{name}"
    for j, rid in enumerate([f"{tag}-base", f"{tag}-ctl-a", f"{tag}-ctl-b"]):
        _record_final(
            rec, base, "baseline" if j == 0 else "control", acc[j], failure.get(j), routing,
            None, rid, "replay", shape=shape, **common,
        )  # fmt: skip
    return acc, failure, tag, common


def _record_peers(
    rec: _Recorder,
    backend: Backend,
    options: SearchOptions,
    shape: MoEShape,
    routing: RoutingInput,
    peers: Sequence[KernelConfig],
    acc: list[list[float]],
    failure: dict[int, Timing],
    tag: str,
    common: dict[str, Any],
    first: int = COPIES + 1,
) -> None:
    """Record the peer rows of a held-out comparison (lineup positions from ``first`` on)."""
    for k, cfg in enumerate(peers):
        pcorr = backend.check(shape, routing.ids, cfg, seed=options.check_seed)
        _record_final(
            rec,
            cfg,
            "peer",
            acc[first + k],
            failure.get(first + k),
            routing,
            pcorr,
            f"{tag}-peer" if k == 0 else f"{tag}-peer{k + 1}",
            "layer",
            status_override="wrong" if not pcorr.passed else None,
            shape=shape,
            **common,
        )


def _validate_parity(
    backend: Backend,
    point: PointInput,
    options: SearchOptions,
    parity: KernelConfig,
    rec: _Recorder,
    comps: Sequence[tuple[str, MoEShape, RoutingInput]],
    method: str,
) -> None:
    """The held-out comparisons of a point whose replay chose nothing: FlagGems' choice and its
    copies against the parity row (``mxdb.pointverdict`` rule 2)."""
    for name, shape, routing in comps:
        acc, failure, tag, common = _validation_comparison(
            backend, point, options, rec, name, shape, routing, [parity], method
        )
        _record_peers(
            rec, backend, options, shape, routing, [parity], acc, failure, tag, common, COPIES
        )


def _record_final(
    rec: _Recorder,
    cfg: KernelConfig,
    role: str,
    samples: list[float],
    failure: Timing | None,
    routing: RoutingInput,
    corr: Correctness | None,
    run_id: str,
    fidelity: str,
    *,
    status_override: str | None = None,
    shape: MoEShape | None = None,
    comparison: str | None = None,
    margin: float | None = None,
    order_seed: int | None = None,
) -> None:
    extra: dict[str, Any] = {
        "shape": shape,
        "comparison": comparison,
        "margin": margin,
        "order_seed": order_seed,
    }
    if failure is not None or not samples:
        fstatus: str = failure.status if failure is not None else "timeout"
        error = failure.error if failure is not None else "no samples"
        rec.add(
            cfg,
            fidelity=fidelity,
            status=fstatus,
            role=role,
            error=error,
            routing=routing,
            correctness=corr,
            run_id=run_id,
            **extra,
        )
        return
    status: str = status_override or "ok"
    error = None
    if status == "wrong" and corr is not None:
        error = (
            f"layer check failed: max_abs_err {corr.max_abs_err:.3g} "
            f"(limit {corr.threshold_abs:g}), rel_err {corr.rel_err:.3g} "
            f"(limit {corr.threshold_rel:g})"
        )
    rec.add(
        cfg,
        fidelity=fidelity,
        status=status,
        role=role,
        samples=samples,
        error=error,
        routing=routing,
        correctness=corr,
        run_id=run_id,
        **extra,
    )
