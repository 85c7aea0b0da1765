"""The resource proxy: shared memory and register estimates, FlagGems' default, vLLM's grid."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

import mxdb.cli  # noqa: F401  (registers every command)
from mxdb.cli.app import cli
from mxdb.configs import GemmConfig, KernelConfig
from mxdb.profiles import get_profile
from mxdb.resources import (
    check,
    check_config,
    estimate,
    flaggems_default_config,
    smem_buffers,
    uses_wgmma,
    vllm_grid,
)
from mxdb.shapes import MoEShape

M0 = dict(experts=8, hidden=4096, intermediate=14336, topk=2, tokens=4)
ANCHOR = GemmConfig(block_m=16, block_n=128, block_k=64, group_m=1, num_warps=4, num_stages=2)
C500, H200 = get_profile("c500"), get_profile("h200")

#: (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) -> shared memory Triton 3.6.0
#: reported (or required, when out of resources) for a fused-MoE-style bf16 GEMM on an H200.
TRITON_36_H200_SMEM = {
    (16, 128, 128, 4, 3): 73728,
    (16, 128, 64, 4, 2): 18432,
    (16, 256, 128, 8, 4): 208896,
    (128, 256, 64, 8, 4): 196608,
    (16, 32, 64, 4, 2): 6144,
    (64, 128, 64, 4, 3): 73728,
    (64, 64, 64, 4, 1): 16384,
    (256, 128, 64, 8, 1): 49152,
    (16, 256, 256, 4, 2): 139264,
    (32, 128, 256, 8, 4): 245760,
    (256, 32, 256, 4, 2): 294912,
    (64, 64, 128, 4, 2): 65536,
}


def _gemm(bm: int, bn: int, bk: int, w: int, s: int) -> GemmConfig:
    return GemmConfig(block_m=bm, block_n=bn, block_k=bk, num_warps=w, num_stages=s)


@pytest.mark.parametrize(("key", "smem"), sorted(TRITON_36_H200_SMEM.items()))
def test_smem_formula_matches_triton_on_h200(key: tuple[int, ...], smem: int) -> None:
    est = estimate(_gemm(*key), dtype="bf16", profile=H200)
    assert est.smem_bytes == smem
    assert est.fits is (smem <= 232448)


def test_wgmma_and_buffer_rules() -> None:
    assert uses_wgmma(_gemm(64, 64, 64, 4, 3), H200)
    assert not uses_wgmma(_gemm(16, 64, 64, 4, 3), H200)
    assert not uses_wgmma(_gemm(64, 64, 64, 4, 3), get_profile("a100"))
    assert smem_buffers(_gemm(64, 64, 64, 4, 3), H200) == 3
    assert smem_buffers(_gemm(16, 64, 64, 4, 3), H200) == 2
    assert smem_buffers(_gemm(16, 64, 64, 4, 1), H200) == 1
    # mcTriton on the C500: num_stages - 1 (calibrated on the recorded failure), never 0
    assert smem_buffers(_gemm(16, 64, 64, 4, 3), C500) == 2
    assert smem_buffers(_gemm(64, 64, 64, 4, 3), C500) == 2
    assert smem_buffers(_gemm(16, 64, 64, 4, 1), C500) == 1
    # an unmeasured compiler keeps the upper bound
    unmeasured = C500.model_copy(update={"smem_buffer_rule": "num_stages"})
    assert smem_buffers(_gemm(16, 64, 64, 4, 3), unmeasured) == 3


def test_flaggems_default_for_c500_m0_shape() -> None:
    shape = MoEShape(**M0, dtype="fp16")
    default = flaggems_default_config(shape)
    assert default == GemmConfig(
        block_m=16, block_n=128, block_k=128, group_m=1, num_warps=4, num_stages=3
    )
    c500 = check(default, shape, C500)
    assert not c500.fits
    # what mcTriton asked for on the real C500 (C500 M0 milestone): 2 x (16x128 + 128x128) x 2 B
    assert c500.gemm1.smem_bytes == 73728 == 2 * (16 * 128 + 128 * 128) * 2
    assert "65,536" in c500.gemm1.reasons[0]
    h200 = check(default, shape, H200)
    assert h200.fits and h200.gemm1.smem_bytes == 73728


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_anchor_fits_both_devices(dtype: str) -> None:
    shape = MoEShape(**M0, dtype=dtype)
    for profile in (C500, H200):
        result = check(ANCHOR, shape, profile)
        assert result.fits, result
        assert result.gemm1.reasons == [] and result.gemm2.reasons == []
    assert check(ANCHOR, shape, C500).gemm1.smem_bytes == 18432
    best = GemmConfig(block_m=16, block_n=32, block_k=64, group_m=1, num_warps=4, num_stages=2)
    assert check(best, shape, C500).fits  # the C500 M0 milestone's best config


def test_flaggems_heuristic_branches() -> None:
    big = flaggems_default_config(MoEShape(8, 4096, 14336, 2, 4096))
    assert (big.block_m, big.block_n, big.block_k, big.group_m, big.num_warps) == (
        128,
        256,
        64,
        16,
        8,
    )
    assert big.num_stages == 3  # 3 x 49,152 B stays under FlagGems' 200,000 B cap
    qwen = flaggems_default_config(MoEShape(128, 2048, 768, 8, 64))
    assert (qwen.block_m, qwen.block_n, qwen.block_k, qwen.group_m) == (16, 64, 128, 1)
    mid = flaggems_default_config(MoEShape(64, 2048, 1408, 6, 512))
    assert (mid.block_m, mid.block_n, mid.group_m, mid.num_warps) == (64, 128, 1, 8)


def test_register_limits_and_threads() -> None:
    # measured: this config compiled on an H200 (Triton 3.6.0) with 255 registers and 796
    # spilled, so on NVIDIA the accumulator limit is a warning; the C500 keeps rejecting it
    huge = estimate(_gemm(256, 256, 64, 4, 2), dtype="bf16", profile=H200)
    assert huge.acc_regs_per_thread == 512 and huge.fits and not huge.reasons
    assert any("accumulator alone" in w for w in huge.warnings)
    huge_c500 = estimate(_gemm(256, 256, 64, 4, 1), dtype="bf16", profile=C500)
    assert huge_c500.acc_regs_per_thread == 256 and not huge_c500.fits
    assert any("accumulator alone" in r for r in huge_c500.reasons)
    wide = estimate(_gemm(16, 32, 64, 32, 2), dtype="bf16", profile=C500)
    assert wide.threads == 2048 and not wide.fits
    tiny = estimate(_gemm(8, 32, 64, 4, 2), dtype="bf16", profile=H200)
    assert not tiny.fits and "BLOCK_M=8" in tiny.reasons[0]
    spill = estimate(_gemm(64, 256, 128, 4, 2), dtype="bf16", profile=H200)
    # 163,840 B fits; 128 accumulator registers plus operands may spill: a warning only
    assert spill.warnings and spill.fits is True


def test_vllm_grid() -> None:
    grid = vllm_grid()
    assert len(grid) == 1920
    assert len({g.short() for g in grid}) == 1920
    assert grid[0] == GemmConfig(
        block_m=16, block_n=32, block_k=64, group_m=1, num_warps=4, num_stages=2
    )
    fits_h200 = [g for g in grid if estimate(g, dtype="bf16", profile=H200).fits]
    fits_c500 = [g for g in grid if estimate(g, dtype="bf16", profile=C500).fits]
    assert 0 < len(fits_c500) < len(fits_h200) < 1920


def test_check_accepts_split_configs() -> None:
    kc = KernelConfig(gemm1=ANCHOR, gemm2=_gemm(16, 32, 64, 4, 2), align_block=16)
    result = check_config(kc.model_dump(), MoEShape(**M0, dtype="bf16"), profile="c500")
    assert result.fits and result.gemm2.config == "M16/N32/K64/G1/w4/s2"
    assert result.to_dict()["shape"]["experts"] == 8


# ---------------------------------------------------------------- CLI

M0_ARGS = ["-E", "8", "-H", "4096", "-I", "14336", "-k", "2", "-M", "4"]
DEFAULT_JSON = json.dumps(flaggems_default_config(MoEShape(**M0)).to_triton())
ANCHOR_JSON = json.dumps(ANCHOR.to_triton())


@pytest.mark.parametrize(
    ("profile", "config", "dtype", "code"),
    [
        ("c500", DEFAULT_JSON, "fp16", 1),
        ("c500", DEFAULT_JSON, "bf16", 1),
        ("c500", ANCHOR_JSON, "fp16", 0),
        ("c500", ANCHOR_JSON, "bf16", 0),
        ("h200", DEFAULT_JSON, "bf16", 0),
        ("h200", ANCHOR_JSON, "bf16", 0),
        ("MetaX C500", ANCHOR_JSON, "bf16", 0),
    ],
)
def test_cli_check_config_exit_codes(profile: str, config: str, dtype: str, code: int) -> None:
    result = CliRunner().invoke(
        cli, ["check-config", "--profile", profile, *M0_ARGS, "--dtype", dtype, "--config", config]
    )
    assert result.exit_code == code, result.output
    assert ("does not fit" in result.output) is (code == 1)


def test_cli_check_config_json_and_file(tmp_path: Path) -> None:
    path = tmp_path / "cfg.json"
    path.write_text(DEFAULT_JSON)
    result = CliRunner().invoke(
        cli, ["check-config", "--profile", "c500", *M0_ARGS, "--config", str(path), "--json"]
    )
    assert result.exit_code == 1
    doc = json.loads(result.output)
    assert doc["fits"] is False and doc["gemm1"]["smem_bytes"] == 73728


@pytest.mark.parametrize(
    "args",
    [
        ["--profile", "mi300", *M0_ARGS, "--config", ANCHOR_JSON],
        ["--profile", "c500", *M0_ARGS, "--config", "{not json"],
        [
            "--profile",
            "c500",
            *M0_ARGS,
            "--config",
            '{"BLOCK_SIZE_M": 24, "BLOCK_SIZE_N": 32, "BLOCK_SIZE_K": 64}',
        ],
        ["--profile", "c500", *M0_ARGS, "--config", "/nonexistent.json"],
        [
            "--profile",
            "c500",
            "-E",
            "8",
            "-H",
            "4096",
            "-I",
            "14336",
            "-k",
            "9",
            "-M",
            "4",
            "--config",
            ANCHOR_JSON,
        ],
        ["--profile", "c500", *M0_ARGS, "--dtype", "int8", "--config", ANCHOR_JSON],
        ["--profile", "c500", *M0_ARGS],
    ],
)
def test_cli_check_config_bad_input_exits_2(args: list[str]) -> None:
    result = CliRunner().invoke(cli, ["check-config", *args])
    assert result.exit_code == 2, result.output


def test_cli_trace(tmp_path: Path) -> None:
    trace = Path(__file__).parent / "data" / "traces" / "small_object.json"
    runner = CliRunner()
    human = runner.invoke(cli, ["trace", str(trace), "--experts", "8"])
    assert human.exit_code == 0 and "routing class" in human.output
    doc = json.loads(
        runner.invoke(cli, ["trace", str(trace), "-E", "8", "--json", "--align-block", "4"]).output
    )
    assert doc["counts"] == [2, 1, 2, 2, 0, 1, 1, 1] and doc["align_block"] == 4
    bad = tmp_path / "bad.json"
    bad.write_text("[[0, 0]]")
    result = runner.invoke(cli, ["trace", str(bad), "-E", "8"])
    assert result.exit_code == 2 and "twice" in result.output


def test_smem_formula_matches_every_recorded_compile() -> None:
    data = json.loads((Path(__file__).parent / "data" / "triton36_h200_smem.json").read_text())
    assert data["device"]["triton"] == "3.6.0" and data["device"]["smem_optin"] == 232448
    assert len(data["results"]) == 97
    for r in data["results"]:
        gemm = _gemm(r["block_m"], r["block_n"], r["block_k"], r["num_warps"], r["num_stages"])
        est = estimate(gemm, dtype="bf16", profile=H200)
        assert est.smem_bytes == r["shared"], r
        assert est.fits is not r["out_of_resources"], r
        if r["wgmma"] is not None:
            assert uses_wgmma(gemm, H200) is r["wgmma"], r


@pytest.mark.parametrize("nk", [64, 128, 256])
@pytest.mark.parametrize("stages", [2, 3, 4, 5])
def test_known_triton36_compile_failure_is_rejected(nk: int, stages: int) -> None:
    # measured on an H200 (Triton 3.6.0, bf16, GEMM1): BLOCK_M 256, 4 warps, BLOCK_N == BLOCK_K
    gemm = _gemm(256, nk, nk, 4, stages)
    est = estimate(gemm, dtype="bf16", profile=H200)
    assert not est.fits and est.known_failure == "triton36-sm90-m256-w4-square"
    assert any("does not dominate" in r for r in est.reasons)
    assert estimate(gemm, dtype="bf16", profile=H200, triton="3.6.0").known_failure is not None


def test_known_compile_failure_stays_in_its_measured_scope() -> None:
    failing = _gemm(256, 64, 64, 4, 2)
    # another Triton release, another GEMM, dtype or architecture: not measured, not rejected
    assert estimate(failing, dtype="bf16", profile=H200, triton="3.5.1").fits
    assert estimate(failing, dtype="bf16", profile=H200, gemm_index=2).fits
    assert estimate(failing, dtype="fp16", profile=H200).fits
    assert estimate(failing, dtype="bf16", profile=get_profile("a100")).known_failure is None
    # neighbours in the grid that compiled on the H200
    for gemm in (_gemm(256, 64, 64, 8, 2), _gemm(256, 128, 64, 4, 2), _gemm(256, 32, 64, 4, 2)):
        est = estimate(gemm, dtype="bf16", profile=H200, triton="3.6.0")
        assert est.fits and est.known_failure is None, gemm
    layer = check(failing, MoEShape(8, 4096, 14336, 2, 64, "bf16"), H200, triton="3.6.0")
    assert not layer.fits and layer.gemm1.known_failure and layer.gemm2.known_failure is None
