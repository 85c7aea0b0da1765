"""The feature vector of one (key, config) pair, as the model sees it.

A key is what the dispatcher knows of a call: the shape (E, H, I, k), the token count and the
routing class.  A config contributes its implementation and tiles, and quantities the tiles
imply at that key (how many programs the GEMMs launch per SM, how much of each expert's block
of tokens is padding under uniform load).  FlagGems' own choice at the key (a function of the
shape, restated on the CPU by ``mxdb.resources.flaggems_default_config``) is described too,
since the model predicts time relative to it.  Everything is computed on the CPU, from the key
alone.

The vector has versions (:data:`FEATURE_SETS`): a model file records its inputs by name, and a
forest's input count names its version (:func:`version_of`), so a model trained on an earlier
set keeps answering and auditing as it was trained.  Version 2 adds how many waves of programs
FlagGems' own choice launches for each GEMM: its distance from the memory floor depends on it
(one wave or two leave the weight stream short of bytes in flight, five or more do not), and
with it how much any other config can gain.
"""

from __future__ import annotations

import math

from mxdb.configs import IMPLS, KernelConfig
from mxdb.errors import UsageError
from mxdb.models import ROUTING_CLASSES
from mxdb.shapes import MoEShape

#: Version 1's names, one per entry of :func:`features`' vector, in order.
_V1: tuple[str, ...] = (
    "log2_experts",
    "log2_hidden",
    "log2_intermediate",
    "topk",
    "log2_tokens",
    "log2_slots_per_expert",
    "log2_active_experts",
    *(f"class_{c}" for c in ROUTING_CLASSES),
    *(f"impl_{i}" for i in IMPLS),
    "log2_block_m",
    "log2_block_n1",
    "log2_block_k1",
    "log2_block_n2",
    "log2_block_k2",
    "log2_group_m",
    "num_warps",
    "num_stages",
    "log2_align",
    "pad_fraction",
    "log2_waves_gemm1",
    "log2_waves_gemm2",
    "log2_base_block_m",
    "log2_base_block_n",
    "log2_base_block_k",
    "base_num_warps",
    "base_num_stages",
    "d_block_m",
    "d_block_n",
    "d_block_k",
    "d_num_warps",
    "d_num_stages",
    "log2_expert_weights",
)
#: feature-set version -> its names, in order; each version's count differs from the others'
FEATURE_SETS: dict[int, tuple[str, ...]] = {
    1: _V1,
    2: (
        *_V1,
        "log2_base_waves_gemm1",
        "log2_base_waves_gemm2",
        "log2_base_waves_min",
        "d_log2_waves_min",
    ),
}
#: the version :func:`features` computes unless told otherwise (what training writes)
CURRENT = 2
#: the current version's names
FEATURE_NAMES: tuple[str, ...] = FEATURE_SETS[CURRENT]

#: The streaming multiprocessors the wave counts divide by (an H200's; the features are
#: relative, so another device with a model of its own keeps the same scale).
SMS = 132


def _l2(x: float) -> float:
    return math.log2(max(x, 1e-9))


def active_experts(shape: MoEShape) -> float:
    """Experts a uniform routing of the key touches, in expectation."""
    e, m, k = shape.experts, shape.tokens, shape.topk
    return float(e * (1.0 - (1.0 - k / e) ** m))


def version_of(n_features: object) -> int:
    """The feature-set version whose vector has ``n_features`` entries."""
    for v, names in FEATURE_SETS.items():
        if n_features == len(names):
            return v
    known = ", ".join(f"{len(n)} (version {v})" for v, n in FEATURE_SETS.items())
    raise UsageError(
        f"a model taking {n_features!r} features matches no feature set of this version of "
        f"mxdb (known: {known}): train it again with this version (mxdb model train)"
    )


def _waves(
    shape: MoEShape, config: KernelConfig, act: float, per_expert: float
) -> tuple[float, float, float]:
    """(padding share of an expert's block, waves of GEMM1's programs, waves of GEMM2's) of
    ``config`` under uniform load (one program per tile of slots and output block), with
    ``act`` active experts of ``per_expert`` token slots each."""
    h, i = shape.hidden, shape.intermediate
    g1, g2 = config.gemm1, config.gemm2
    padded = math.ceil(per_expert / config.align_block) * config.align_block
    pad = (padded - per_expert) / padded
    blocks = act * padded / g1.block_m
    if config.impl == "fused_slice":
        # one program per tile of slots and slice of the intermediate dimension
        waves1 = blocks * math.ceil(i / g1.block_n) / SMS
        return pad, waves1, waves1
    return (
        pad,
        blocks * math.ceil(2 * i / g1.block_n) / SMS,
        blocks * math.ceil(h / g2.block_n) / SMS,
    )


def features(
    shape: MoEShape, routing_class: str, config: KernelConfig, version: int = CURRENT
) -> list[float]:
    """The vector ``FEATURE_SETS[version]`` names, for ``config`` at this key."""
    from mxdb.resources import flaggems_default_config

    e, h, i, k, m = shape.experts, shape.hidden, shape.intermediate, shape.topk, shape.tokens
    act = active_experts(shape)
    per_expert = m * k / max(act, 1e-9)
    g1, g2 = config.gemm1, config.gemm2
    align = config.align_block
    pad, waves1, waves2 = _waves(shape, config, act, per_expert)
    base = flaggems_default_config(shape)
    # differences from FlagGems' choice: the model predicts time relative to it
    diffs = [
        _l2(g1.block_m) - _l2(base.block_m),
        _l2(g1.block_n) - _l2(base.block_n),
        _l2(g1.block_k) - _l2(base.block_k),
        float(g1.num_warps - base.num_warps),
        float(g1.num_stages - base.num_stages),
        _l2(h * i),
    ]
    out = [
        _l2(e),
        _l2(h),
        _l2(i),
        float(k),
        _l2(m),
        _l2(per_expert),
        _l2(act),
        *(1.0 if routing_class == c else 0.0 for c in ROUTING_CLASSES),
        *(1.0 if config.impl == x else 0.0 for x in IMPLS),
        _l2(g1.block_m),
        _l2(g1.block_n),
        _l2(g1.block_k),
        _l2(g2.block_n),
        _l2(g2.block_k),
        _l2(g1.group_m),
        float(g1.num_warps),
        float(g1.num_stages),
        _l2(align),
        pad,
        _l2(waves1),
        _l2(waves2),
        _l2(base.block_m),
        _l2(base.block_n),
        _l2(base.block_k),
        float(base.num_warps),
        float(base.num_stages),
        *diffs,
    ]
    if version >= 2:
        _, b1, b2 = _waves(shape, KernelConfig.uniform(base), act, per_expert)
        out += [_l2(b1), _l2(b2), _l2(min(b1, b2)), _l2(min(waves1, waves2)) - _l2(min(b1, b2))]
    return out
