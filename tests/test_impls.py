"""The layer implementation as a dimension of a config: identity, search, resources, exports.

The kernels themselves are tested on the GPU (``test_fused_act_gpu.py``); here everything that
does not need one: a config's ``impl`` round-trips and keeps old identities, the search times
every finalist under each implementation the backend runs, the resource proxy counts the
fused GEMM1's two weight tiles, and tables never receive an implementation they cannot
express (the runtime hook's handling is in ``test_runtime_hook.py``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner
from hypothesis import given
from hypothesis import strategies as st

from mxdb.cli.app import cli
from mxdb.configs import DEFAULT_IMPL, FUSED_SLICE_MAX_SLOTS, IMPLS, GemmConfig, KernelConfig
from mxdb.errors import ConfigError, WorkloadError
from mxdb.evidence.files import trace_hash
from mxdb.models import Entry, Fingerprint
from mxdb.profiles import resolve_profile
from mxdb.resources import check, flaggems_default_config
from mxdb.shapes import MoEShape, preset_shape
from mxdb.store import Store
from mxdb.tune.fake import FakeBackend
from mxdb.tune.search import (
    SLICE_FINALISTS,
    PointInput,
    RoutingInput,
    impl_variants,
    implementations,
    search,
)
from mxdb.tune.space import SLICE_TILES, SearchSpace, slice_menu
from mxdb.tune.verify import SINGLE_SOURCE
from mxdb.tune.workload import SearchOptions


def _g(bm: int, bn: int, bk: int, gm: int = 1, w: int = 4, s: int = 3) -> GemmConfig:
    return GemmConfig(block_m=bm, block_n=bn, block_k=bk, group_m=gm, num_warps=w, num_stages=s)


BASE = KernelConfig.uniform(_g(16, 64, 128))
FUSED = BASE.with_impl("fused_act")


# -- identity -----------------------------------------------------------------------------


def test_default_implementation_keeps_the_identity_configs_had_before_it_existed() -> None:
    # the hash of this config was stored by every earlier version of mxdb
    assert BASE.model_dump() == {
        "gemm1": _g(16, 64, 128).model_dump(),
        "gemm2": _g(16, 64, 128).model_dump(),
        "align_block": 16,
    }
    assert BASE.hash == KernelConfig.parse(json.dumps(BASE.model_dump())).hash
    assert FUSED.model_dump()["impl"] == "fused_act"
    assert FUSED.hash != BASE.hash
    assert KernelConfig.parse(FUSED.model_dump()) == FUSED
    assert FUSED.short().endswith("| fused_act") and "fused_act" not in BASE.short()


def test_single_means_what_flaggems_and_tables_can_express() -> None:
    assert BASE.single
    assert not FUSED.single
    assert not KernelConfig(gemm1=_g(16, 64, 128), gemm2=_g(16, 128, 64), align_block=16).single
    assert not KernelConfig(gemm1=_g(16, 64, 128), gemm2=_g(16, 64, 128), align_block=32).single


def test_unknown_implementation_is_refused_by_name() -> None:
    with pytest.raises(ConfigError, match=r"unknown implementation 'triton_tma'.*flaggems"):
        KernelConfig.parse({**BASE.model_dump(), "impl": "triton_tma"})
    with pytest.raises(ConfigError, match="valid: gemm1, gemm2, align_block, impl"):
        KernelConfig.parse({**BASE.model_dump(), "implementation": "fused_act"})


@given(st.sampled_from(IMPLS), st.sampled_from([16, 32, 64]), st.sampled_from([32, 64, 128]))
def test_config_round_trips_through_json(impl: str, bm: int, bn: int) -> None:
    c = KernelConfig.uniform(_g(bm, bn, 64)).with_impl(impl)
    back = KernelConfig.parse(c.canonical_json())
    assert back == c and back.hash == c.hash and back.impl == impl


def test_workload_implementations_are_validated() -> None:
    assert SearchOptions().impls == list(IMPLS)
    with pytest.raises(ValueError, match=r"unknown implementations \['cutlass'\]"):
        SearchOptions(impls=["flaggems", "cutlass"])


def test_workload_file_with_an_unknown_implementation_is_a_usage_error(tmp_path: Path) -> None:
    from mxdb.tune.workload import load_workload

    path = tmp_path / "w.yaml"
    path.write_text(
        "name: w\nmodels: [qwen3-30b-a3b]\ntokens: [8]\ndtypes: [bf16]\n"
        "routings: [{kind: uniform}]\nsearch: {impls: [flaggems, cutlass]}\n"
    )
    with pytest.raises(WorkloadError, match="cutlass"):
        load_workload(path)


# -- search -------------------------------------------------------------------------------


def test_variants_are_the_same_tiles_and_half_gemm1_width() -> None:
    split = KernelConfig(gemm1=_g(32, 128, 64), gemm2=_g(32, 64, 64), align_block=32)
    out = impl_variants([BASE, split, FUSED], ["fused_act"])
    assert all(c.impl == "fused_act" for c in out)
    assert FUSED not in out  # already a candidate
    assert BASE.model_copy(update={"gemm1": _g(16, 32, 128), "impl": "fused_act"}) in out
    assert split.with_impl("fused_act") in out
    halves = [c for c in out if c.gemm2 == split.gemm2 and c.gemm1.block_n == 64]
    assert len(halves) == 1 and halves[0].gemm1.block_m == 32
    assert impl_variants([BASE], []) == []


class _FlagGemsOnly(FakeBackend):
    impls = (DEFAULT_IMPL,)


def test_variants_leave_fused_slice_to_its_own_menu() -> None:
    assert {c.impl for c in impl_variants([BASE], ["fused_act", "fused_slice"])} == {"fused_act"}


def test_implementations_are_those_asked_for_that_the_backend_runs() -> None:
    assert implementations(FakeBackend(), SearchOptions()) == ["fused_act", "fused_slice"]
    assert implementations(FakeBackend(), SearchOptions(impls=["flaggems"])) == []
    assert implementations(_FlagGemsOnly(), SearchOptions()) == []


def _point(m: int = 16) -> PointInput:
    shape = preset_shape("qwen3-30b-a3b", m)
    rng = np.random.default_rng(0)
    ids = np.argsort(rng.random((m, shape.experts)), axis=1)[:, : shape.topk]
    return PointInput(
        shape=shape,
        replay=RoutingInput(ids, trace_hash(shape.experts, ids.tolist()), "uniform"),
        synthetic=RoutingInput(ids, trace_hash(shape.experts, ids.tolist()), "uniform"),
        seed=0,
        run_prefix="t",
    )


def _search(fb: FakeBackend, **opts: Any) -> Any:
    point = _point()
    options = SearchOptions(max_candidates=8, halving_rounds=1, refine_steps=0, **opts)
    return search(fb, point, options, space=SearchSpace(point.shape, fb.profile()))


def test_search_times_each_finalist_under_the_other_implementation_and_can_pick_it() -> None:
    res = _search(FakeBackend(seed=1, noise=0.002))
    replayed = {
        KernelConfig.parse(m.config).impl for m in res.measurements if m.comparison == "replay"
    }
    assert replayed == {"flaggems", "fused_act", "fused_slice"}
    assert res.stages["impl_variants"] > 0
    # the model gives fused_act the activation pass and most of the alignment, and fused_slice
    # one launch streaming the weights: one of mxdb's kernels wins
    assert res.winner is not None and res.winner.impl in ("fused_act", "fused_slice")
    assert res.correctness is not None and res.correctness.passed


def test_search_times_fused_slice_at_small_batches_only() -> None:
    fb = FakeBackend(seed=1, noise=0.002)
    options = SearchOptions(max_candidates=8, halving_rounds=1, refine_steps=0)
    for m, expect in ((4, True), (FUSED_SLICE_MAX_SLOTS // 8 + 1, False)):
        point = _point(m)
        res = search(fb, point, options, space=SearchSpace(point.shape, fb.profile()))
        replayed = [
            KernelConfig.parse(x.config)
            for x in res.measurements
            if x.comparison == "replay" and x.role == "candidate"
        ]
        sliced = [c for c in replayed if c.impl == "fused_slice"]
        assert bool(sliced) is expect, m
        if expect:
            # the best few of its menu, ranked on the synthetic routing
            assert 0 < len({c.hash for c in sliced}) <= SLICE_FINALISTS
            assert {c.hash for c in sliced} <= {c.hash for c in slice_menu(point.shape)}
            ranked = [x for x in res.measurements if x.fidelity == "synthetic"]
            assert {KernelConfig.parse(x.config).impl for x in ranked} >= {"fused_slice"}


def test_search_without_the_implementation_keeps_flaggems_kernels() -> None:
    for fb, opts in ((FakeBackend(seed=1), {"impls": ["flaggems"]}), (_FlagGemsOnly(seed=1), {})):
        res = _search(fb, **opts)
        assert {KernelConfig.parse(m.config).impl for m in res.measurements} == {"flaggems"}
        assert res.stages["impl_variants"] == 0


# -- resources ----------------------------------------------------------------------------


def test_fused_slice_config_has_one_form() -> None:
    c = KernelConfig.fused_slice(block_m=16, block_i=128, block_k=128, block_h=256, num_warps=8)
    assert c.impl == "fused_slice" and c.align_block == 16
    assert c.gemm2 == _g(16, 256, 128, w=8) and not c.single
    assert KernelConfig.parse(c.canonical_json()) == c
    assert BASE.with_impl("fused_slice") == KernelConfig.fused_slice(
        block_m=16, block_i=64, block_k=128, block_h=64
    )
    # the same kernel under a second spelling is refused, naming the one form
    with pytest.raises(ConfigError, match=r"gemm2 must be M16/N256/K128/G1/w8/s3"):
        KernelConfig.parse({**c.model_dump(), "gemm2": _g(16, 256, 64, w=8).model_dump()})
    with pytest.raises(ConfigError, match="gemm1.group_m 1"):
        KernelConfig.parse({**c.model_dump(), "gemm1": _g(16, 128, 128, gm=8, w=8).model_dump()})


def test_slice_menu_caps_tiles_at_the_dimensions_and_stops_past_its_batch_limit() -> None:
    small = MoEShape(128, 2048, 96, 8, 4, "bf16")
    menu = slice_menu(small)
    assert menu and all(c.impl == "fused_slice" for c in menu)
    assert max(c.gemm1.block_n for c in menu) == 128  # 96 rounds up to 128, no further
    assert len({c.hash for c in menu}) == len(menu)
    assert len(slice_menu(MoEShape(8, 4096, 14336, 2, 4, "bf16"))) == len(SLICE_TILES)
    assert slice_menu(small.with_tokens(FUSED_SLICE_MAX_SLOTS // 8 + 1)) == []


def test_proxy_counts_both_weight_tiles_of_fused_slice() -> None:
    shape = MoEShape(8, 4096, 14336, 2, 4, "bf16")
    c = KernelConfig.fused_slice(block_m=16, block_i=128, block_k=128, block_h=256)
    r = check(c, shape, resolve_profile("h200"))
    assert r.gemm1.smem_bytes == 2 * (16 * 128 + 128 * 256) * 2  # gate and up tiles
    assert r.gemm2.smem_bytes == 2 * (16 * 128 + 128 * 256) * 2  # [16,128] x [128,256]


def test_proxy_counts_the_gate_and_up_tiles_of_the_fused_gemm1() -> None:
    shape = MoEShape(8, 4096, 14336, 2, 64, "bf16")
    profile = resolve_profile("h200")
    big = KernelConfig.uniform(_g(64, 128, 128, s=3))
    plain, fused = check(big, shape, profile), check(big.with_impl("fused_act"), shape, profile)
    assert plain.fits
    assert fused.gemm1.smem_bytes == 3 * (64 * 128 + 128 * 256) * 2
    assert not fused.fits and "shared memory" in fused.gemm1.reasons[0]
    # GEMM2 is FlagGems' kernel either way
    assert fused.gemm2.smem_bytes == plain.gemm2.smem_bytes


# -- exports and the hook -----------------------------------------------------------------


def _entry(fp: Fingerprint, shape: MoEShape, cfg: KernelConfig, **kw: Any) -> Entry:
    return Entry(
        dtype=shape.dtype, family=shape.family, dims=shape.dims(), tokens=shape.tokens,
        routing_class="uniform", config=cfg.model_dump(), config_hash=cfg.hash,
        fingerprint_hash=fp.hash, device_name=fp.device_name, speedup=kw.pop("speedup", 1.08),
        status=kw.pop("status", "verified"), source=kw.pop("source", "tune"), **kw,
    )  # fmt: skip


def test_vllm_table_never_holds_a_fused_act_config(tmp_path: Path) -> None:
    db = f"sqlite:///{tmp_path / 'db.sqlite'}"
    fp = Fingerprint(vendor="nvidia", device_name="NVIDIA H200", triton="3.6.0")
    store = Store.open(db)
    store.put_fingerprint(fp)
    shape = MoEShape(8, 4096, 14336, 2, 4, "bf16")
    single = KernelConfig.uniform(_g(16, 128, 64))
    store.add_entries([
        _entry(fp, shape, FUSED, speedup=1.2),
        _entry(fp, shape, single, status="imported", source=SINGLE_SOURCE, speedup=1.05),
        _entry(fp, shape.with_tokens(64), KernelConfig.uniform(_g(64, 64, 64)).with_impl("fused_act")),
    ])  # fmt: skip
    store.close()
    out = tmp_path / "out"
    out.mkdir()
    res = CliRunner().invoke(
        cli, ["export", "--format", "vllm", "--fingerprint", fp.hash, "--out", str(out), "--db", db]
    )
    assert res.exit_code == 0, res.output
    (table,) = out.glob("E=8,N=14336,*.json")
    rows = json.loads(table.read_text())
    assert all("impl" not in row for row in rows.values())
    # M=4: the single config measured beside the fused winner; M=64: the baseline it beat
    assert rows["4"] == single.gemm1.to_triton()
    assert rows["64"] == flaggems_default_config(shape.with_tokens(64)).to_triton()
