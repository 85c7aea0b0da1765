"""vLLM and FlagGems tables as those programs read them: real stores, real files, the real CLI.

The lookups below restate vLLM 0.33's and FlagGems 5.0.2's documented rules independently of
mxdb's code: vLLM builds ``E={E},N={N},device_name={name}.json`` with the device name's runs
of whitespace and ``/`` as ``_`` and any H200 variant as ``NVIDIA_H200``, reads
``$VLLM_TUNED_CONFIG_FOLDER`` first (that file replaces its whole table), pops
``triton_version`` and takes the row with the nearest M; FlagGems reads one YAML document
(``data.get("_FALLBACK", {})`` first, so the document must be a mapping) keyed by device
(spaces as ``_``, H200 variants as ``NVIDIA_H200``) and ``"E,N,None,0,0"``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner

from mxdb.cli.app import cli
from mxdb.configs import GemmConfig, KernelConfig
from mxdb.fingerprint import kernel_source_hash, moe_table_hash
from mxdb.interop import flaggems, vllm
from mxdb.interop.export import import_vllm
from mxdb.models import Entry, Fingerprint
from mxdb.resources import flaggems_default_config
from mxdb.shapes import MoEShape
from mxdb.store import Store
from mxdb.tune.verify import SINGLE_SOURCE

REPO = Path(__file__).resolve().parents[1]
VLLM_CONFIGS = REPO / "mxdb" / "data" / "vllm"
MODELS = REPO / "tests" / "data" / "model_configs"
SHIPPED = REPO / "evidence" / "store-export.json"
SHIPPED_FP = "6f0a9d03427b6eb8"
MIXTRAL_H200 = "E=8,N=14336,device_name=NVIDIA_H200.json"
NVL = Fingerprint(vendor="nvidia", device_name="NVIDIA H200 NVL", triton="3.6.0")


# -- vLLM's and FlagGems' lookups, restated -----------------------------------------------


def vllm_file_name(device: str, experts: int, n: int) -> str:
    name = re.sub(r"[\s/]+", "_", device)
    if "H200" in name.split("_"):
        name = "NVIDIA_H200"
    return f"E={experts},N={n},device_name={name}.json"


def vllm_lookup(folder: Path, device: str, experts: int, n: int, m: int) -> dict[str, Any]:
    with open(folder / vllm_file_name(device, experts, n)) as f:
        tuned = json.load(f)
    tuned.pop("triton_version", None)
    configs = {int(k): v for k, v in tuned.items()}
    return dict(configs[min(configs.keys(), key=lambda x: abs(x - m))])


def flaggems_lookup(text: str, device: str, experts: int, n: int, m: int) -> dict[str, Any]:
    data = yaml.safe_load(text)
    fallback = data.get("_FALLBACK", {})
    name = device.replace(" ", "_")
    if "H200" in name.split("_"):
        name = "NVIDIA_H200"
    if name not in data and fallback.get(name) in data:
        name = fallback[name]
    rows = {int(k): v for k, v in data[name][f"{experts},{n},None,0,0"].items()}
    v = rows[min(rows.keys(), key=lambda x: abs(x - m))]
    order = ["BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K", "GROUP_SIZE_M"]
    return dict(zip([*order, "num_warps", "num_stages"], v, strict=True))


# -- fixtures -------------------------------------------------------------------------------


@pytest.fixture()
def db(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'mxdb.sqlite'}"


def _run(args: list[str]) -> Any:
    result = CliRunner().invoke(cli, args, catch_exceptions=False)
    return result


def _entry(
    fp: Fingerprint,
    shape: MoEShape,
    config: KernelConfig,
    status: str = "verified",
    *,
    speedup: float = 1.05,
    source: str = "tune",
    routing_class: str = "uniform",
) -> Entry:
    return Entry(
        dtype=shape.dtype,
        family=shape.family,
        dims=shape.dims(),
        tokens=shape.tokens,
        routing_class=routing_class,
        config=config.model_dump(),
        config_hash=config.hash,
        fingerprint_hash=fp.hash,
        device_name=fp.device_name,
        status=status,  # type: ignore[arg-type]
        source=source,
        speedup=speedup,
    )


def _g(bm: int, bn: int, bk: int, gm: int = 1, w: int = 4, s: int = 3) -> GemmConfig:
    return GemmConfig(block_m=bm, block_n=bn, block_k=bk, group_m=gm, num_warps=w, num_stages=s)


# -- vLLM export ------------------------------------------------------------------------------


def test_device_name_rule_is_vllms() -> None:
    cases = {
        "NVIDIA H200": "NVIDIA_H200",
        "NVIDIA H200 NVL": "NVIDIA_H200",
        "NVIDIA H200 141GB HBM3e": "NVIDIA_H200",
        "NVIDIA H100 80GB HBM3": "NVIDIA_H100_80GB_HBM3",
        "NVIDIA  A100 80GB\tPCIe": "NVIDIA_A100_80GB_PCIe",
        "NVIDIA A100-SXM4-80GB": "NVIDIA_A100-SXM4-80GB",
        "AMD Instinct MI300X": "AMD_Instinct_MI300X",
        "Intel(R) Arc(TM) Pro B70 Graphics": "Intel(R)_Arc(TM)_Pro_B70_Graphics",
        "Vendor GPU a/b": "Vendor_GPU_a_b",
        "NVIDIA H20": "NVIDIA_H20",
        "NVIDIA H20-3e": "NVIDIA_H20-3e",
    }
    for raw, expected in cases.items():
        assert vllm.device_key(raw) == expected, raw
        assert vllm_file_name(raw, 8, 14336) == f"E=8,N=14336,device_name={expected}.json"
    # every device name of vLLM 0.33's own table files is a fixed point of the rule
    for path in VLLM_CONFIGS.glob("E=*.json"):
        device = vllm.parse_table_name(path.name).device_name
        assert vllm.device_key(device) == device
    assert flaggems.device_key("NVIDIA H200 NVL") == "NVIDIA_H200"
    assert flaggems.device_key("NVIDIA A100-SXM4-80GB") == "NVIDIA_A100-SXM4-80GB"
    assert flaggems.device_key("MetaX C500") == "MetaX_C500"


def test_shipped_store_exports_dense_measured_tables(db: str, tmp_path: Path) -> None:
    assert _run(["import", "mxdb", str(SHIPPED), "--db", db]).exit_code == 0
    out = tmp_path / "vllm"
    res = _run(
        ["export", "--format", "vllm", "--fingerprint", SHIPPED_FP, "--out", str(out),
         "--db", db, "--json"]
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    assert report["fingerprint"] == SHIPPED_FP and report["device_name"] == "NVIDIA H200"
    path = out / MIXTRAL_H200
    table = json.loads(path.read_text())
    own = json.loads((VLLM_CONFIGS / MIXTRAL_H200).read_text())
    assert next(iter(table)) == "triton_version" and table["triton_version"] == "3.6.0"
    rows = {int(k): v for k, v in table.items() if k != "triton_version"}
    assert sorted(rows) == list(vllm.TUNER_BATCH_SIZES)  # 18 rows, 1 ... 4096
    assert len(rows) == 18
    store = Store.open(db)
    try:
        entries = [
            e
            for e in store.entries(fingerprint_hash=SHIPPED_FP, dtype="bf16")
            if e.family == "E8-H4096-I14336-k2" and e.routing_class == "uniform"
        ]
    finally:
        store.close()
    shape = MoEShape(8, 4096, 14336, 2, 1, "bf16")
    for m in (1024, 2048, 4096):
        # measured: nothing beat FlagGems' choice, and vLLM's row was at parity with it (a
        # parity record) or not (a baseline record): the row is the record's config
        (rec,) = [e for e in entries if e.tokens == m and e.status in ("baseline", "parity")]
        expected = KernelConfig.parse(rec.config).gemm1.to_triton()
        assert vllm_lookup(out, "NVIDIA H200", 8, 14336, m) == expected
    assert {e.status for e in entries if e.tokens in (1024, 2048, 4096)} == {"parity"}
    # every other measured M follows the rule of mxdb.interop.tables
    by_m: dict[int, list[Entry]] = {}
    for e in entries:
        by_m.setdefault(e.tokens, []).append(e)
    kinds = set()
    for m, at in sorted(by_m.items()):
        cfgs = {e.id: KernelConfig.parse(e.config) for e in at}
        decided = [e for e in at if e.status in ("baseline", "parity")]
        singles = [e for e in at if e.status == "verified" and cfgs[e.id].single]
        others = [e for e in at if e.status == "verified" and not cfgs[e.id].single]
        if decided or not (singles or others):
            continue
        if singles:
            best = max(singles, key=lambda e: (e.speedup or 0.0, e.id or 0))
            expected, kind = cfgs[best.id].gemm1.to_triton(), "single"
        else:
            beside = [e for e in at if e.source == SINGLE_SOURCE and cfgs[e.id].single]
            if beside:
                best = max(beside, key=lambda e: (e.speedup or 0.0, e.id or 0))
                expected, kind = cfgs[best.id].gemm1.to_triton(), "tune-single"
            else:
                expected = flaggems_default_config(shape.with_tokens(m)).to_triton()
                kind = "baseline-config"
            # a split or fused_act entry's tiles never reach the table as its own row
            assert all(cfgs[e.id].impl != "flaggems" or cfgs[e.id].gemm1 != cfgs[e.id].gemm2
                       for e in others)  # fmt: skip
        assert rows[m] == expected, (m, kind)
        kinds.add(kind)
    # the shipped store has keys with a FlagGems config verified, and keys whose verified
    # entry is fused_act, written with the best FlagGems config measured beside it
    assert {"single", "tune-single"} <= kinds, kinds
    # unmeasured Ms without an imported vLLM table: the incumbent's row, from vLLM's H200
    # table shipped with mxdb, and no row repeats a measured one
    for m in (24, 48, 96, 1536, 3072):
        assert rows[m] == own[str(m)], m
    assert not any("repeat the nearest" in n for n in report["notes"])


def test_unmeasured_rows_come_from_vllms_own_table(db: str, tmp_path: Path) -> None:
    assert _run(["import", "mxdb", str(SHIPPED), "--db", db]).exit_code == 0
    res = _run(["import", "vllm", str(VLLM_CONFIGS / MIXTRAL_H200), "--db", db])
    assert res.exit_code == 0, res.output
    out = tmp_path / "vllm"
    res = _run(
        ["export", "--format", "vllm", "--fingerprint", SHIPPED_FP, "--out", str(out),
         "--db", db, "--json"]
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    own = json.loads((VLLM_CONFIGS / MIXTRAL_H200).read_text())
    for m in (24, 48, 96, 1536, 3072):
        assert vllm_lookup(out, "NVIDIA H200", 8, 14336, m) == own[str(m)]
    # the 5 unmeasured Ms of each table: Mixtral-8x7B's from the imported table, Qwen3's
    # from vLLM's H200 table shipped with mxdb (the incumbent's rows, as dispatch answers)
    sources = json.loads(res.stdout)["row_sources"]
    assert sources["vllm"] == 10 and "nearest" not in sources, sources


def test_export_for_an_h200_nvl_host_is_read_by_vllm(db: str, tmp_path: Path) -> None:
    store = Store.open(db)
    store.put_fingerprint(NVL)
    shape = MoEShape(8, 4096, 14336, 2, 64, "bf16")
    best = _g(32, 128, 128, 64)
    single = _g(32, 64, 128, 1)
    split = KernelConfig(gemm1=_g(16, 64, 128), gemm2=_g(16, 128, 64), align_block=16)
    other = Fingerprint(vendor="nvidia", device_name="NVIDIA H200 NVL", triton="3.5.0")
    store.put_fingerprint(other)
    store.add_entries(
        [
            _entry(NVL, shape, KernelConfig.uniform(best)),
            _entry(NVL, shape.with_tokens(256), split, speedup=1.2),
            _entry(NVL, shape.with_tokens(256), KernelConfig.uniform(single), "imported",
                   speedup=1.1, source=SINGLE_SOURCE),
            # another fingerprint on the same device: never mixed in
            _entry(other, shape.with_tokens(4), KernelConfig.uniform(_g(16, 32, 64))),
            # another routing class: not this table's
            _entry(NVL, shape.with_tokens(4), KernelConfig.uniform(_g(64, 64, 64)),
                   routing_class="skewed"),
        ]
    )  # fmt: skip
    store.close()
    out = tmp_path / "vllm"
    res = _run(["export", "--format", "vllm", "--fingerprint", NVL.hash, "--out", str(out),
                "--db", db])  # fmt: skip
    assert res.exit_code == 0, res.output
    assert f"VLLM_TUNED_CONFIG_FOLDER={out.resolve()}" in res.output
    assert [p.name for p in out.iterdir()] == [MIXTRAL_H200]
    for m in (64, 70):
        assert vllm_lookup(out, "NVIDIA H200 NVL", 8, 14336, m) == best.to_triton()
    # unmeasured Ms: the incumbent's row, vLLM's own H200 table (which an NVL host reads)
    own = json.loads((VLLM_CONFIGS / MIXTRAL_H200).read_text())
    for m in (1, 4, 100):
        assert vllm_lookup(out, "NVIDIA H200 NVL", 8, 14336, m) == own[str(vllm.nearest(
            [int(k) for k in own if k.isdigit()], m))]  # fmt: skip
    # the split entry's key: the single config measured beside it, not GEMM1 of the split
    for m in (256, 300):
        assert vllm_lookup(out, "NVIDIA H200 NVL", 8, 14336, m) == single.to_triton()
    assert vllm_lookup(out, "NVIDIA H200 NVL", 8, 14336, 4096) == own["4096"]
    table = json.loads((out / MIXTRAL_H200).read_text())
    assert table["triton_version"] == NVL.triton == "3.6.0"


def test_export_of_a_fingerprint_without_entries_names_the_ones_there(db: str) -> None:
    assert _run(["import", "mxdb", str(SHIPPED), "--db", db]).exit_code == 0
    res = _run(["export", "--format", "vllm", "--fingerprint", "0123456789abcdef",
                "--out", "x", "--db", db])  # fmt: skip
    assert res.exit_code == 2
    assert SHIPPED_FP in res.output and "NVIDIA H200" in res.output


# -- vLLM import: extra keys, devices, a lossless round trip -------------------------------


def test_every_unquantized_vllm_033_table_round_trips(db: str, tmp_path: Path) -> None:
    files = sorted(VLLM_CONFIGS.glob("E=*.json"))
    assert len(files) == 148
    res = _run(["import", "vllm", str(VLLM_CONFIGS), "--db", db, "--json"])
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    assert report["skipped"] == [] and report["files"] == 148
    out = tmp_path / "back"
    res = _run(["export", "--format", "vllm", "--imported", "--out", str(out), "--db", db])
    assert res.exit_code == 0, res.output
    assert sorted(p.name for p in out.iterdir()) == [p.name for p in files]
    extra_keys: set[str] = set()
    for path in files:
        original = json.loads(path.read_text())
        original.pop("triton_version", None)
        back = json.loads((out / path.name).read_text())
        assert back == original, path.name  # same rows, same keys, same values, same order
        assert list(back) == list(original)
        for row in original.values():
            extra_keys |= set(row) - set(GemmConfig(block_m=16, block_n=16, block_k=16).to_triton())
    assert extra_keys == {"kpack", "waves_per_eu", "matrix_instr_nonkdim", "num_ctas", "grf_mode"}


def test_import_skips_only_the_row_it_cannot_keep(db: str, tmp_path: Path) -> None:
    table = tmp_path / "E=8,N=14336,device_name=AMD_Instinct_MI300X.json"
    rows = {
        "triton_version": "3.4.0",
        "1": {**_g(16, 64, 128).to_triton(), "waves_per_eu": 0, "kpack": 2},
        "2": {**_g(16, 64, 128).to_triton(), "SPLIT_K": 2},
        "4": _g(16, 128, 64).to_triton(),
    }
    table.write_text(json.dumps(rows))
    res = _run(["import", "vllm", str(table), "--db", db, "--json"])
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    assert len(report["skipped"]) == 1
    assert table.name in report["skipped"][0] and "'2'" in report["skipped"][0]
    assert "SPLIT_K" in report["skipped"][0]
    out = tmp_path / "back"
    assert _run(["export", "--format", "vllm", "--imported", "--out", str(out),
                 "--db", db]).exit_code == 0  # fmt: skip
    back = json.loads((out / table.name).read_text())
    assert back == {"1": rows["1"], "4": rows["4"]}


def test_the_device_is_part_of_the_natural_key(db: str, tmp_path: Path) -> None:
    cfg = _g(16, 64, 128).to_triton()
    for device in ("NVIDIA_H100_80GB_HBM3", "NVIDIA_A100-SXM4-80GB"):
        (tmp_path / f"E=8,N=7168,device_name={device}.json").write_text(json.dumps({"1": cfg}))
    store = Store.open(db)
    try:
        report = import_vllm(store, [tmp_path])
        assert report.added == report.read == 4  # 2 tables x 1 row x (bf16, fp16)
        assert {e.device_name for e in store.entries()} == {
            "NVIDIA_H100_80GB_HBM3",
            "NVIDIA_A100-SXM4-80GB",
        }
    finally:
        store.close()


# -- FlagGems -------------------------------------------------------------------------------

SHIPPED_LIKE = """\
_FALLBACK:
  NVIDIA_H800: NVIDIA_H100_80GB_HBM3

# a comment FlagGems ignores
NVIDIA_H100_80GB_HBM3:
  "8,14336,None,0,0":
    "1": [16,64,128,1,4,3]
    "4096": [128,256,64,16,8,3]
  "8,14336,fp8_w8a8,0,0":
    "1": [16,64,128,1,4,3]
NVIDIA_H200:
  "128,768,None,0,0":
    "1": [16,64,128,1,4,3]
  "8,14336,None,0,0":
    "1": [64,64,64,1,4,3]
"""


def _h200_store(db: str) -> Fingerprint:
    fp = Fingerprint(vendor="nvidia", device_name="NVIDIA H200", triton="3.6.0")
    store = Store.open(db)
    store.put_fingerprint(fp)
    shape = MoEShape(8, 4096, 14336, 2, 4, "bf16")
    store.add_entries([_entry(fp, shape, KernelConfig.uniform(_g(16, 128, 64)))])
    store.close()
    return fp


def test_flaggems_merge_keeps_other_devices_keys_and_fallback(db: str, tmp_path: Path) -> None:
    fp = _h200_store(db)
    base = tmp_path / "base.yaml"
    base.write_text(SHIPPED_LIKE)
    out = tmp_path / "out"
    out.mkdir()
    res = _run(["export", "--format", "flaggems", "--fingerprint", fp.hash, "--merge",
                str(base), "--out", str(out), "--db", db])  # fmt: skip
    assert res.exit_code == 0, res.output
    text = (out / "fused_moe_config.yaml").read_text()
    data = yaml.safe_load(text)
    before = yaml.safe_load(SHIPPED_LIKE)
    assert data["_FALLBACK"] == before["_FALLBACK"]
    assert data["NVIDIA_H100_80GB_HBM3"] == before["NVIDIA_H100_80GB_HBM3"]
    assert data["NVIDIA_H200"]["128,768,None,0,0"] == before["NVIDIA_H200"]["128,768,None,0,0"]
    mine = data["NVIDIA_H200"]["8,14336,None,0,0"]
    assert sorted(int(m) for m in mine) == list(vllm.TUNER_BATCH_SIZES)
    assert flaggems_lookup(text, "NVIDIA H200 NVL", 8, 14336, 5) == _g(16, 128, 64).to_triton()
    # the H800 still falls back to the H100's table
    assert flaggems_lookup(text, "NVIDIA H800", 8, 14336, 1) == _g(16, 64, 128).to_triton()
    # and mxdb reads back what it wrote
    assert flaggems.parse(text)["NVIDIA_H200"]["8,14336,None,0,0"][4] == _g(16, 128, 64)


def test_empty_flaggems_export_is_a_mapping_flaggems_loads(db: str, tmp_path: Path) -> None:
    fp = _h200_store(db)
    out = tmp_path / "out"
    out.mkdir()
    # no entries of this routing class: nothing to write, yet a valid document
    res = _run(["export", "--format", "flaggems", "--fingerprint", fp.hash, "--routing-class",
                "sparse", "--out", str(out), "--db", db])  # fmt: skip
    assert res.exit_code == 0, res.output
    text = (out / "fused_moe_config.yaml").read_text()
    data = yaml.safe_load(text)
    assert data == {}
    assert data.get("_FALLBACK", {}) == {}  # FlagGems' first call on the document
    assert flaggems.render({}).strip().endswith("{}")
    # a comments-only document (what FlagGems fails on) is repaired by a merge
    broken = tmp_path / "broken.yaml"
    broken.write_text("# nothing here\n")
    res = _run(["export", "--format", "flaggems", "--fingerprint", fp.hash, "--routing-class",
                "sparse", "--merge", str(broken), "--out", str(out), "--db", db])  # fmt: skip
    assert res.exit_code == 0, res.output
    assert yaml.safe_load((out / "fused_moe_config.yaml").read_text()) == {}


def _fake_flag_gems(root: Path) -> Path:
    pkg = root / "site" / "flag_gems"
    (pkg / "fused").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "fused" / "__init__.py").write_text("")
    (pkg / "fused" / "fused_moe.py").write_text("# kernel\n")
    (pkg / "fused" / "moe_align_block_size.py").write_text("# align\n")
    return pkg


def test_install_writes_flaggems_own_file_with_a_backup(
    db: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fp = _h200_store(db)
    pkg = _fake_flag_gems(tmp_path)
    monkeypatch.syspath_prepend(str(pkg.parent))
    kernel_before = kernel_source_hash(pkg)
    assert moe_table_hash(pkg) is None
    res = _run(["export", "--format", "flaggems", "--fingerprint", fp.hash, "--install",
                "--db", db, "--json"])  # fmt: skip
    assert res.exit_code == 0, res.output
    target = pkg / "utils" / "configs" / "fused_moe_config.yaml"
    report = json.loads(res.stdout)
    assert report["files"] == [str(target)] and report["backup"] is None
    first = target.read_text()
    assert yaml.safe_load(first)["NVIDIA_H200"]["8,14336,None,0,0"]["4"] == [16, 128, 64, 1, 4, 3]
    # installing changes the recorded table, not the kernel source: the host's entries stay
    assert kernel_source_hash(pkg) == kernel_before
    assert moe_table_hash(pkg) is not None
    # a second install merges into the installed table and backs it up first
    target.write_text(SHIPPED_LIKE)
    res = _run(["export", "--format", "flaggems", "--fingerprint", fp.hash, "--install",
                "--db", db])  # fmt: skip
    assert res.exit_code == 0, res.output
    assert str(target) in res.output and "backed up to" in res.output
    backups = list(target.parent.glob("fused_moe_config.yaml.mxdb-backup-*"))
    assert len(backups) == 1 and backups[0].read_text() == SHIPPED_LIKE
    data = yaml.safe_load(target.read_text())
    assert data["_FALLBACK"] == {"NVIDIA_H800": "NVIDIA_H100_80GB_HBM3"}
    assert "NVIDIA_H100_80GB_HBM3" in data and "128,768,None,0,0" in data["NVIDIA_H200"]


def test_import_flaggems(db: str, tmp_path: Path) -> None:
    path = tmp_path / "fused_moe_config.yaml"
    path.write_text(SHIPPED_LIKE)
    res = _run(["import", "flaggems", str(path), "--db", db, "--json"])
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    # 3 unquantized rows x (bf16, fp16); the fp8 table is skipped by name
    assert report["added"] == 8 and report["read"] == 8
    assert any("fp8_w8a8" in s for s in report["skipped"])
    store = Store.open(db)
    try:
        entries = store.entries(source="flaggems")
        assert {e.status for e in entries} == {"imported"}
        mixtral = [e for e in entries if e.family == "E8-H4096-I14336-k2" and e.dtype == "bf16"]
        assert {e.device_name for e in mixtral} == {"NVIDIA_H100_80GB_HBM3", "NVIDIA_H200"}
    finally:
        store.close()


# -- model shapes from Hugging Face configs ---------------------------------------------------


@pytest.mark.parametrize(
    ("file", "tp", "ep", "dims"),
    [
        ("mixtral-8x7b.json", 1, 1, (8, 4096, 14336, 2)),
        ("mixtral-8x7b.json", 2, 1, (8, 4096, 7168, 2)),
        ("mixtral-8x7b.json", 8, 1, (8, 4096, 1792, 2)),
        ("qwen1.5-moe-a2.7b.json", 1, 1, (60, 2048, 1408, 4)),
        ("qwen3-30b-a3b.json", 1, 1, (128, 2048, 768, 8)),
        ("qwen3-30b-a3b.json", 4, 1, (128, 2048, 192, 8)),
        ("qwen3-30b-a3b.json", 1, 8, (16, 2048, 768, 8)),
        ("deepseek-v2-lite.json", 1, 1, (64, 2048, 1408, 6)),
        ("deepseek-v3.json", 8, 1, (256, 7168, 256, 8)),
        ("deepseek-v3.json", 1, 8, (32, 7168, 2048, 8)),
        ("llama-4-scout.json", 8, 1, (16, 5120, 1024, 1)),
        ("olmoe-1b-7b.json", 1, 1, (64, 2048, 1024, 8)),
        ("gpt-oss-20b.json", 1, 1, (32, 2880, 2880, 4)),
    ],
)
def test_model_configs_give_vllms_per_shard_shapes(
    file: str, tp: int, ep: int, dims: tuple[int, int, int, int]
) -> None:
    from mxdb.modelconfig import load

    assert load(MODELS / file, tp=tp, ep=ep).dims() == dims


def test_model_config_errors(tmp_path: Path) -> None:
    from mxdb.errors import InvalidInputError, UsageError
    from mxdb.modelconfig import from_config, load

    with pytest.raises(UsageError, match="cannot be split over --tp 3"):
        load(MODELS / "mixtral-8x7b.json", tp=3)
    with pytest.raises(UsageError, match="cannot be split over --ep 3"):
        load(MODELS / "mixtral-8x7b.json", ep=3)
    with pytest.raises(InvalidInputError, match="not a MoE model mxdb knows"):
        from_config({"architectures": ["LlamaForCausalLM"], "hidden_size": 4096})
    with pytest.raises(InvalidInputError, match="'num_local_experts'"):
        from_config({"architectures": ["MixtralForCausalLM"], "hidden_size": 4096})
    with pytest.raises(InvalidInputError, match="does not exist"):
        load(tmp_path / "nope.json")


def test_presets_match_the_sample_configs() -> None:
    from mxdb.modelconfig import load
    from mxdb.shapes import PRESETS

    for name in ("mixtral-8x7b", "qwen3-30b-a3b", "deepseek-v2-lite", "olmoe-1b-7b",
                 "deepseek-v3", "llama-4-scout", "gpt-oss-20b", "qwen1.5-moe-a2.7b"):  # fmt: skip
        assert load(MODELS / f"{name}.json").dims() == PRESETS[name], name


def test_dispatch_and_import_take_a_model_config(db: str, tmp_path: Path) -> None:
    Store.open(db).close()  # dispatch only reads: it never creates the store
    res = _run(["dispatch", "--model", str(MODELS / "mixtral-8x7b.json"), "--tp", "2",
                "--tokens", "4", "--db", db, "--json"])  # fmt: skip
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["shape"]["family"] == "E8-H4096-I7168-k2"
    res = _run(["dispatch", "--tokens", "4", "--db", db])
    assert res.exit_code == 2 and "--model" in res.output
    # a vLLM table of the Qwen3-30B-A3B shard at tp=4 (E=128, N=192) gets its H and k
    table = VLLM_CONFIGS / "E=128,N=192,device_name=NVIDIA_H200.json"
    res = _run(["import", "vllm", str(table), "--model", str(MODELS / "qwen3-30b-a3b.json"),
                "--tp", "4", "--db", db])  # fmt: skip
    assert res.exit_code == 0, res.output
    store = Store.open(db)
    try:
        assert {e.family for e in store.entries(source="vllm")} == {"E128-H2048-I192-k8"}
    finally:
        store.close()


def test_tune_takes_a_model_config(tmp_path: Path) -> None:
    db = f"sqlite:///{tmp_path / 't.sqlite'}"
    workload = tmp_path / "w.yaml"
    workload.write_text(
        "name: model-config\nmodels: [mixtral-8x7b]\ntokens: [4]\ndtypes: [bf16]\n"
        "routings: [{kind: uniform}]\nseed: 0\n"
        "search: {max_candidates: 4, halving_rounds: 1, replicates: 2, finalists: 1}\n"
    )
    res = CliRunner().invoke(
        cli,
        ["tune", str(workload), "--backend", "fake", "--db", db, "--out", str(tmp_path / "ev"),
         "--model", str(MODELS / "qwen3-30b-a3b.json"), "--tp", "4", "--no-progress", "--json"],
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    store = Store.open(db)
    try:
        families = {m.family for m in store.measurements()}
    finally:
        store.close()
    assert families == {"E128-H2048-I192-k8"}


# -- C500 ------------------------------------------------------------------------------------


def test_check_config_c500_reproduces_the_recorded_failure() -> None:
    m0 = ["--experts", "8", "--hidden", "4096", "--intermediate", "14336", "--topk", "2",
          "--tokens", "4", "--dtype", "fp16"]  # fmt: skip
    default = json.dumps(_g(16, 128, 128, 1, 4, 3).to_triton())
    res = _run(["check-config", "--profile", "c500", *m0, "--config", default])
    assert res.exit_code == 1
    assert "73,728" in res.output and "does not fit" in res.output
    for ok in (_g(16, 128, 64, 1, 4, 2), _g(16, 32, 64, 1, 4, 2)):
        res = _run(["check-config", "--profile", "c500", *m0, "--config",
                    json.dumps(ok.to_triton())])  # fmt: skip
        assert res.exit_code == 0 and "does not fit" not in res.output


# -- the tuner keeps the best single config beside a split winner -------------------------


def test_single_record_beside_a_split_winner() -> None:
    from mxdb.models import Measurement
    from mxdb.pointverdict import PointDecision
    from mxdb.tune.search import SearchResult
    from mxdb.tune.verify import single_record

    shape = MoEShape(8, 4096, 14336, 2, 64, "bf16")
    base = KernelConfig.uniform(flaggems_default_config(shape))
    split = KernelConfig(gemm1=_g(32, 64, 128), gemm2=_g(32, 128, 64), align_block=32)
    single = KernelConfig.uniform(_g(32, 128, 128, 64))
    worse = KernelConfig.uniform(_g(16, 64, 64))
    rounds = [100.0, 100.4, 99.8, 100.2, 100.1, 99.9, 100.3, 100.0]

    def meas(rid: str, cfg: KernelConfig, role: str, scale: float) -> Measurement:
        cand = role == "candidate"
        return Measurement(
            run_id=rid, dtype="bf16", family=shape.family, dims=shape.dims(),
            tokens=shape.tokens, routing_class="uniform", config=cfg.model_dump(),
            config_hash=cfg.hash, role=role,  # type: ignore[arg-type]
            fidelity="layer" if cand else "replay", status="ok",
            samples_us=[x * scale for x in rounds], max_abs_err=0.001 if cand else None,
            rel_err=0.001 if cand else None, comparison="replay", margin=0.005,
        )  # fmt: skip

    ms = [
        meas("r-base", base, "baseline", 1.0),
        meas("r-ctl-a", base, "control", 1.001),
        meas("r-ctl-b", base, "control", 0.999),
        meas("r-fin01", split, "candidate", 0.80),
        meas("r-fin02", single, "candidate", 0.90),
        meas("r-fin03", worse, "candidate", 0.999),
    ]
    result = SearchResult(
        shape=shape, measurements=ms, baseline=base, winner=split,
        winner_samples=ms[3].samples_us, baseline_samples=ms[0].samples_us,
        control_samples=(ms[1].samples_us, ms[2].samples_us), correctness=None,
        budget_exhausted=False, spent_s=1.0,
    )  # fmt: skip
    kw = {"routing_class": "uniform", "fingerprint_hash": "f" * 16, "device_name": "NVIDIA H200"}
    decision = PointDecision(
        "verified", split.hash, "r-fin01", 1.25, 1.24, 1.26, 0.001, 80.0, 100.0, 1.0
    )
    entry = single_record(result, decision, **kw)  # type: ignore[arg-type]
    assert entry is not None
    assert entry.status == "imported" and entry.source == SINGLE_SOURCE
    assert KernelConfig.parse(entry.config) == single
    assert entry.speedup == pytest.approx(1 / 0.9)
    # a uniform winner needs no such record; nor does a point whose decision is not verified
    uniform_result = SearchResult(**{**result.__dict__, "winner": single})
    assert single_record(uniform_result, decision, **kw) is None  # type: ignore[arg-type]
    lost = PointDecision("baseline", base.hash, "r-base", 1.0, None, None, 0.001, 100.0, 100.0, 0.0)
    assert single_record(result, lost, **kw) is None  # type: ignore[arg-type]


def test_peer_tables_in_the_repo_are_the_same_bytes_as_vllms() -> None:
    peers = REPO / "mxdb" / "data" / "vllm"
    if not peers.is_dir():
        pytest.skip("mxdb/data/vllm not present")
    for path in peers.glob("E=*.json"):
        assert (VLLM_CONFIGS / path.name).read_bytes() == path.read_bytes()


def test_fingerprint_documents_record_the_table_outside_the_hash() -> None:
    from mxdb import schemas
    from mxdb.evidence.models import FingerprintDoc
    from mxdb.fingerprint import parse_fingerprint

    fp = Fingerprint(vendor="nvidia", device_name="NVIDIA H200", kernel_source_hash="1" * 16)
    doc = FingerprintDoc(fingerprint=fp, hash=fp.hash, data={"flaggems_moe_table": "2" * 16})
    written = doc.to_json_dict()
    assert written["schema_version"] == "1.1" and written["data"]["flaggems_moe_table"]
    validator = schemas.validator("fingerprint")
    assert list(validator.iter_errors(written)) == []
    # 1.0 documents (every committed bundle's) stay valid
    old = json.loads((REPO / "evidence" / "h200-compile-survey" / "fingerprint.json").read_text())
    assert old["schema_version"] == "1.0" and list(validator.iter_errors(old)) == []
    # the table is data: the fingerprint and its hash are the same with or without it
    assert parse_fingerprint(written) == fp
    assert parse_fingerprint({**fp.components(), "hash": fp.hash, "data": {"x": "y"}}) == fp


def test_a_parity_entry_the_tables_cannot_hold_writes_the_single_beside_it(db: str) -> None:
    from mxdb.interop import tables

    fp = Fingerprint(vendor="nvidia", device_name="NVIDIA H200", triton="3.6.0")
    store = Store.open(db)
    store.put_fingerprint(fp)
    shape = MoEShape(8, 4096, 14336, 2, 4, "bf16")
    sliced = KernelConfig.fused_slice(block_m=16, block_i=64, block_k=256, block_h=256)
    single = KernelConfig.uniform(_g(16, 64, 128))
    # a reconciled key: its dispatchable row is a parity record of fused_slice
    store.add_entries([
        _entry(fp, shape, sliced, "parity", speedup=1.02, source="reconcile"),
        _entry(fp, shape, single, "imported", speedup=1.03, source=SINGLE_SOURCE),
    ])  # fmt: skip
    built = tables.build(store, fp.hash)
    row = built.tables[(8, 14336)].rows[4]
    assert (row.source, row.config) == ("single", single.gemm1)
    # without a single beside it: FlagGems' choice, never the fused_slice tiles
    store2 = Store.open(db.replace(".sqlite", "-2.sqlite"))
    store2.put_fingerprint(fp)
    store2.add_entries([_entry(fp, shape, sliced, "parity", source="reconcile")])
    row2 = tables.build(store2, fp.hash).tables[(8, 14336)].rows[4]
    assert (row2.source, row2.config) == ("baseline-config", flaggems_default_config(shape))
