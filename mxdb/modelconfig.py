"""MoE shapes from a model's Hugging Face ``config.json``, per shard, the way vLLM computes them.

vLLM's tuner (``benchmarks/kernels/benchmark_moe.py``) reads the routed-expert count E, the
experts per token k, the per-expert intermediate size I and the hidden size H from the
model's config by architecture, then shards:

- tensor parallelism (``--tp N``): every rank holds every expert, with I split N ways, so
  the table's N (``w2.shape[2]``) is ``I / tp``;
- expert parallelism (``--ep N``, vLLM's ``--enable-expert-parallel`` with N ranks): every
  rank holds E / N whole experts, so E is ``E / ep`` and N is I.

Fields by architecture (the names in the public configs):

==========================================  ==================  =====================  ===================
architecture                                E                   k                      I
==========================================  ==================  =====================  ===================
MixtralForCausalLM, GptOssForCausalLM,      num_local_experts   num_experts_per_tok    intermediate_size
Llama4ForConditionalGeneration (text part)
Qwen2MoeForCausalLM, Qwen3MoeForCausalLM    num_experts         num_experts_per_tok    moe_intermediate_size
DeepseekV2/V3ForCausalLM                    n_routed_experts    num_experts_per_tok    moe_intermediate_size
OlmoeForCausalLM                            num_experts         num_experts_per_tok    intermediate_size
==========================================  ==================  =====================  ===================

Shared experts (DeepSeek, Qwen2-MoE) run outside the fused routed-expert kernel and are not
counted.  Only the JSON is read: no transformers, no download.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mxdb.errors import InvalidInputError, UsageError
from mxdb.shapes import MoEShape

#: architecture -> (experts field, intermediate field); k is ``num_experts_per_tok`` throughout
_FIELDS: dict[str, tuple[str, str]] = {
    "MixtralForCausalLM": ("num_local_experts", "intermediate_size"),
    "GptOssForCausalLM": ("num_local_experts", "intermediate_size"),
    "Llama4ForConditionalGeneration": ("num_local_experts", "intermediate_size"),
    "Llama4ForCausalLM": ("num_local_experts", "intermediate_size"),
    "Qwen2MoeForCausalLM": ("num_experts", "moe_intermediate_size"),
    "Qwen3MoeForCausalLM": ("num_experts", "moe_intermediate_size"),
    "DeepseekV2ForCausalLM": ("n_routed_experts", "moe_intermediate_size"),
    "DeepseekV3ForCausalLM": ("n_routed_experts", "moe_intermediate_size"),
    "OlmoeForCausalLM": ("num_experts", "intermediate_size"),
}


@dataclass(frozen=True)
class ModelMoE:
    """A model's routed-expert MoE layer, whole and per shard."""

    architecture: str
    experts: int
    hidden: int
    intermediate: int
    topk: int
    tp: int = 1
    ep: int = 1

    @property
    def shard_experts(self) -> int:
        return self.experts // self.ep

    @property
    def shard_intermediate(self) -> int:
        """vLLM's N: ``w2.shape[2]`` on one rank."""
        return self.intermediate if self.ep > 1 else self.intermediate // self.tp

    def dims(self) -> tuple[int, int, int, int]:
        """(E, H, N, k) of one shard."""
        return (self.shard_experts, self.hidden, self.shard_intermediate, self.topk)

    def shape(self, tokens: int, dtype: object = "bf16") -> MoEShape:
        e, h, n, k = self.dims()
        return MoEShape(e, h, n, min(k, e), tokens, dtype)

    def describe(self) -> str:
        e, _, n, _ = self.dims()
        return (
            f"{self.architecture}: E={self.experts} H={self.hidden} I={self.intermediate} "
            f"k={self.topk}; tp={self.tp} ep={self.ep} -> per shard E={e} N={n}"
        )


def _int(cfg: dict[str, Any], name: str, where: str) -> int:
    value = cfg.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidInputError(
            f"{where}: field {name!r} must be a positive integer, got {value!r}"
        )
    return value


def from_config(data: Any, *, tp: int = 1, ep: int = 1, source: str = "config") -> ModelMoE:
    """The MoE layer of a parsed ``config.json`` under ``tp``/``ep`` sharding."""
    if not isinstance(data, dict):
        raise InvalidInputError(f"{source}: a model config must be a JSON object")
    if tp < 1 or ep < 1:
        raise UsageError(f"--tp and --ep must be at least 1 (got tp={tp}, ep={ep})")
    archs = data.get("architectures") or []
    arch = archs[0] if isinstance(archs, list) and archs and isinstance(archs[0], str) else None
    if arch is None:
        raise InvalidInputError(f"{source}: no 'architectures' list naming the model class")
    fields = _FIELDS.get(arch)
    if fields is None:
        raise InvalidInputError(
            f"{source}: architecture {arch!r} is not a MoE model mxdb knows; known: "
            f"{', '.join(sorted(_FIELDS))}"
        )
    cfg = data
    if arch.startswith("Llama4") and isinstance(data.get("text_config"), dict):
        cfg = data["text_config"]
    where = f"{source} ({arch})"
    experts = _int(cfg, fields[0], where)
    intermediate = _int(cfg, fields[1], where)
    topk = _int(cfg, "num_experts_per_tok", where)
    hidden = _int(cfg, "hidden_size", where)
    model = ModelMoE(arch, experts, hidden, intermediate, topk, tp, ep)
    if ep > 1:
        if experts % ep:
            raise UsageError(f"{where}: {experts} experts cannot be split over --ep {ep}")
    elif intermediate % tp:
        raise UsageError(
            f"{where}: intermediate size {intermediate} cannot be split over --tp {tp}"
        )
    return model


def load(path: str | Path, *, tp: int = 1, ep: int = 1) -> ModelMoE:
    """Read a model's ``config.json`` (or a folder holding one)."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise InvalidInputError(f"model config {p} does not exist") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidInputError(f"model config {p} is not readable JSON: {exc}") from None
    return from_config(data, tp=tp, ep=ep, source=str(p))
