"""The joint search space of a fused-MoE layer: GEMM1 config x GEMM2 config x alignment block.

Each GEMM draws from at least vLLM's 1,920-point grid (``mxdb.resources.vllm_grid``); the
alignment block is the smallest one both GEMMs accept (their larger BLOCK_SIZE_M, all sizes
being powers of two).  Seeds join the field: peer tables imported into the store (status
"imported", nearest token count) and FlagGems' own choice.  The resource proxy drops configs
that cannot fit the device before anything is compiled.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mxdb.configs import GemmConfig, KernelConfig
from mxdb.errors import ConfigError
from mxdb.resources import VLLM_GRID
from mxdb.shapes import MoEShape

if TYPE_CHECKING:
    from mxdb.profiles import DeviceProfile
    from mxdb.store import Store


def gemm_grid() -> list[GemmConfig]:
    """vLLM's grid of GEMM configs (1,920 points), in a stable order."""
    from mxdb.resources import vllm_grid

    return list(vllm_grid())


def flaggems_default(shape: MoEShape) -> KernelConfig:
    """FlagGems' own config for ``shape`` (its heuristics when it has no table): the baseline."""
    from mxdb.resources import flaggems_default_config

    return KernelConfig.uniform(flaggems_default_config(shape))


def fake_profile(device_name: str = "FAKE_H200") -> DeviceProfile:
    """The device profile of the fake backend: an H200's resources."""
    from mxdb.profiles import get_profile

    return get_profile("h200")


def proxy_check(config: KernelConfig, shape: MoEShape, profile: DeviceProfile) -> str | None:
    """None when ``config`` may fit the device, else the resource proxy's reasons."""
    from mxdb.resources import check

    result = check(config, shape, profile)
    if result.fits:
        return None
    reasons = [f"gemm{g.gemm_index}: {r}" for g in (result.gemm1, result.gemm2) for r in g.reasons]
    return "; ".join(reasons) or "rejected by the resource proxy"


def align_for(g1: GemmConfig, g2: GemmConfig) -> int:
    """The smallest alignment block both GEMMs accept (sizes are powers of two)."""
    return max(g1.block_m, g2.block_m)


def joint(g1: GemmConfig, g2: GemmConfig) -> KernelConfig:
    """A layer config from two GEMM configs with the smallest valid alignment block."""
    return KernelConfig(gemm1=g1, gemm2=g2, align_block=align_for(g1, g2))


#: The tiles ``fused_slice`` is searched over: (slice width, hidden step, output chunk, warps,
#: stages), block_m 16.  Chosen on an H200 (bf16, Mixtral-8x7B and Qwen3-30B-A3B shapes, M 1-32,
#: uniform routing, 81 tiles timed side by side, ``benchmarks/slice_sweep.py``): at each of the
#: 40 routing instances the fastest of the 81 was one of these 36.
SLICE_TILES: tuple[tuple[int, int, int, int, int], ...] = tuple(
    (bi, bk, bh, w, st)
    for bi in (64, 128)
    for bk in (64, 128, 256)
    for bh in (128, 256)
    for w, st in ((4, 3), (8, 3), (4, 4))
)


def slice_menu(shape: MoEShape) -> list[KernelConfig]:
    """The ``fused_slice`` configs the search times at ``shape`` (none past its batch limit)."""
    from mxdb.configs import FUSED_SLICE_MAX_SLOTS

    if shape.tokens * shape.topk > FUSED_SLICE_MAX_SLOTS:
        return []
    return slice_configs(shape, SLICE_TILES)


def slice_configs(
    shape: MoEShape, tiles: Iterable[tuple[int, int, int, int, int]]
) -> list[KernelConfig]:
    """``fused_slice`` configs of ``tiles`` (slice width, hidden step, output chunk, warps,
    stages; block_m 16) at ``shape``: tiles no larger than the dimensions they cover, rounded
    up to a power of two, without duplicates."""

    def cap(v: int, dim: int) -> int:
        return min(v, max(16, 1 << (dim - 1).bit_length()))

    h, i = shape.hidden, shape.intermediate
    out: dict[str, KernelConfig] = {}
    for bi, bk, bh, w, st in tiles:
        c = KernelConfig.fused_slice(
            block_m=16, block_i=cap(bi, i), block_k=cap(bk, h), block_h=cap(bh, h),
            num_warps=w, num_stages=st,
        )  # fmt: skip
        out.setdefault(c.hash, c)
    return list(out.values())


@dataclass(frozen=True)
class Pruned:
    """A config the resource proxy rejected, and why."""

    config: KernelConfig
    reason: str


class SearchSpace:
    """The candidates for one shape on one device profile."""

    def __init__(
        self,
        shape: MoEShape,
        profile: DeviceProfile,
        grid: Sequence[GemmConfig] | None = None,
    ) -> None:
        self.shape = shape
        self.profile = profile
        self.grid: list[GemmConfig] = list(grid) if grid is not None else gemm_grid()
        self._index = {g: i for i, g in enumerate(self.grid)}
        self._verdicts: dict[str, str | None] = {}

    def uniform(self) -> list[KernelConfig]:
        """Every grid config as the layer's single config (both GEMMs, aligned to block_m)."""
        return [KernelConfig.uniform(g) for g in self.grid]

    def verdict(self, config: KernelConfig) -> str | None:
        """The proxy's reason to reject ``config`` (memoized), None when it may fit."""
        h = config.hash
        if h not in self._verdicts:
            self._verdicts[h] = proxy_check(config, self.shape, self.profile)
        return self._verdicts[h]

    def prune(self, configs: Iterable[KernelConfig]) -> tuple[list[KernelConfig], list[Pruned]]:
        """Split configs into those that may fit and those the proxy rejects (with reasons)."""
        kept: list[KernelConfig] = []
        dropped: list[Pruned] = []
        for c in configs:
            reason = self.verdict(c)
            if reason is None:
                kept.append(c)
            else:
                dropped.append(Pruned(c, reason))
        return kept, dropped

    def neighbours(self, g: GemmConfig, *, line: bool = False) -> list[GemmConfig]:
        """Configs that differ from ``g`` in one field (the hill-climbing moves).

        One grid step up or down by default; with ``line``, every other grid value of the
        field (a line search along each coordinate: 16 moves on vLLM's grid).
        """
        out: list[GemmConfig] = []
        base = g.model_dump()
        for name, values in VLLM_GRID.items():
            cur = base[name]
            if line:
                steps = [v for v in values if v != cur]
            elif cur in values:
                i = values.index(cur)
                steps = [values[j] for j in (i - 1, i + 1) if 0 <= j < len(values)]
            else:  # an off-grid seed: move to the nearest grid values
                steps = sorted(values, key=lambda v: abs(v - cur))[:2]
            for v in steps:
                try:
                    out.append(GemmConfig(**{**base, name: v}))
                except ValueError:
                    continue
        return out

    def seeds(self, store: Store | None, baseline: KernelConfig) -> list[KernelConfig]:
        """Imported peer configs (nearest token count) and the baseline, deduplicated."""
        out = [baseline]
        if store is not None:
            out.extend(peer_seeds(store, self.shape))
        seen: set[str] = set()
        uniq = []
        for c in out:
            if c.hash not in seen:
                seen.add(c.hash)
                uniq.append(c)
        return uniq


def peer_seeds(store: Store, shape: MoEShape) -> list[KernelConfig]:
    """Configs of imported peer tables for this family and dtype at the nearest token count
    (not the tuner's own ``tune-single`` records, which are stored as imported too)."""
    entries = [
        e
        for e in store.entries(
            op=shape.op, dtype=shape.dtype, family=shape.family, status="imported"
        )
        if e.source != "tune-single"
    ]
    if not entries:
        return []
    best = min(abs(e.tokens - shape.tokens) for e in entries)
    out = []
    for e in sorted(entries, key=lambda e: (e.tokens, e.config_hash)):
        if abs(e.tokens - shape.tokens) != best:
            continue
        try:
            cfg = KernelConfig.parse(e.config)
        except ConfigError:
            continue  # an imported row this mxdb cannot read is no seed
        if cfg.gemm1.extra is not None or cfg.gemm2.extra is not None:
            # another backend's launch keys (kpack, waves_per_eu, ...): seed the tile config
            cfg = KernelConfig(
                gemm1=cfg.gemm1.without_extra(),
                gemm2=cfg.gemm2.without_extra(),
                align_block=cfg.align_block,
            )
        out.append(cfg)
    return out


def _as_gemm(g: Any) -> GemmConfig:
    if isinstance(g, KernelConfig):
        return g.gemm1
    if isinstance(g, dict):
        return GemmConfig.from_triton(g) if "BLOCK_SIZE_M" in g else GemmConfig(**g)
    raise ConfigError(f"cannot read grid point {g!r} as a GEMM config")
