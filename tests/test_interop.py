"""Interop with peers' tables (vLLM, FlagGems) and mxdb's own export: real stores, real files."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mxdb import GemmConfig, KernelConfig, MoEShape
from mxdb.errors import InvalidInputError
from mxdb.interop import flaggems, vllm
from mxdb.interop.export import (
    ExportOptions,
    StoreExport,
    export_store,
    import_export,
    import_vllm,
    overlay,
    read_export,
)
from mxdb.models import Entry, Fingerprint
from mxdb.resources import flaggems_default_config
from mxdb.store import Store

PEERS = Path(__file__).resolve().parent.parent / "mxdb" / "data" / "vllm"
MIXTRAL = PEERS / "E=8,N=14336,device_name=NVIDIA_H200.json"
FP = Fingerprint(vendor="nvidia", device_name="NVIDIA H200", triton="3.6.0", flag_gems="5.0.2")


@pytest.fixture()
def store(tmp_path: Path) -> Store:
    s = Store.open(f"sqlite:///{tmp_path / 'mxdb.sqlite'}")
    yield s  # type: ignore[misc]
    s.close()


def test_parse_table_names() -> None:
    name = vllm.parse_table_name("E=128,N=768,device_name=NVIDIA_H200.json")
    assert (name.experts, name.intermediate, name.device_name, name.dtype) == (
        128,
        768,
        "NVIDIA_H200",
        None,
    )
    q = vllm.parse_table_name("E=8,N=7168,device_name=NVIDIA_H100_80GB_HBM3,dtype=fp8_w8a8.json")
    assert (
        q.dtype == "fp8_w8a8"
        and q.file_name() == "E=8,N=7168,device_name=NVIDIA_H100_80GB_HBM3,dtype=fp8_w8a8.json"
    )
    with pytest.raises(InvalidInputError, match="expected 'E=<experts>"):
        vllm.parse_table_name("mixtral.json")


def test_import_peer_tables_as_unverified(store: Store) -> None:
    report = import_vllm(store, [PEERS])
    assert report.files == len(list(PEERS.glob("E=*.json")))
    assert report.added == report.read > 0
    entries = store.entries(source="vllm")
    assert {e.status for e in entries} == {"imported"}
    mixtral = [
        e
        for e in entries
        if e.family == "E8-H4096-I14336-k2" and e.dtype == "bf16" and e.device_name == "NVIDIA_H200"
    ]
    table = json.loads(MIXTRAL.read_text())
    m_keys = sorted(int(k) for k in table if k.isdigit())
    assert sorted(e.tokens for e in mixtral) == m_keys
    e1 = next(e for e in mixtral if e.tokens == 1)
    assert KernelConfig.parse(e1.config).gemm1.to_triton() == table["1"]
    # tables of unknown models keep E and N only
    other = [e for e in entries if e.family.startswith("E512-I")]
    assert other and "hidden" not in other[0].dims
    # importing again adds nothing
    assert import_vllm(store, [PEERS]).added == 0


def test_vllm_round_trip_is_unchanged(store: Store, tmp_path: Path) -> None:
    import_vllm(store, [MIXTRAL])
    out = tmp_path / "vllm"
    report = export_store(store, "vllm", out, ExportOptions(imported=True))
    assert report.files == [str(out / MIXTRAL.name)] and report.lossy == []
    original = {k: v for k, v in json.loads(MIXTRAL.read_text()).items() if k.isdigit()}
    assert json.loads((out / MIXTRAL.name).read_text()) == original


def test_flaggems_export_reads_back_as_flaggems_does(store: Store, tmp_path: Path) -> None:
    shape = MoEShape(8, 4096, 14336, 2, 4, "bf16")
    g1 = GemmConfig(block_m=16, block_n=128, block_k=64, group_m=1, num_warps=4, num_stages=3)
    split = KernelConfig(gemm1=g1, gemm2=g1.model_copy(update={"block_n": 64}), align_block=16)
    store.put_fingerprint(FP)
    rows = []
    for m, cfg in ((4, KernelConfig.uniform(g1)), (64, split)):
        s = shape.with_tokens(m)
        rows.append(
            Entry(
                dtype="bf16",
                family=s.family,
                dims=s.dims(),
                tokens=m,
                config=cfg.model_dump(),
                config_hash=cfg.hash,
                fingerprint_hash=FP.hash,
                device_name=FP.device_name,
                status="verified",
                source="tune",
                speedup=1.05,
            )
        )
    store.add_entries(rows)
    report = export_store(store, "flaggems", tmp_path, ExportOptions(fingerprint_hash=FP.hash))
    assert report.lossy == []
    text = (tmp_path / "fused_moe_config.yaml").read_text()
    raw = yaml.safe_load(text)
    assert raw["NVIDIA_H200"]["8,14336,None,0,0"]["4"] == [16, 128, 64, 1, 4, 3]
    parsed = flaggems.parse(text)
    # the split entry's key gets the baseline's config it was measured against, never GEMM1
    rows64 = parsed["NVIDIA_H200"]["8,14336,None,0,0"]
    assert rows64[64] == flaggems_default_config(shape.with_tokens(64)) != g1
    assert sorted(rows64) == sorted(vllm.TUNER_BATCH_SIZES)


def test_mxdb_export_import_round_trip(store: Store, tmp_path: Path) -> None:
    shape = MoEShape(128, 2048, 768, 8, 16, "fp16")
    cfg = KernelConfig.uniform(GemmConfig(block_m=16, block_n=64, block_k=128))
    store.put_fingerprint(FP)
    store.add_entries(
        [
            Entry(
                dtype="fp16",
                family=shape.family,
                dims=shape.dims(),
                tokens=16,
                routing_class="skewed",
                config=cfg.model_dump(),
                config_hash=cfg.hash,
                fingerprint_hash=FP.hash,
                status="verified",
                source="tune",
                speedup=1.2,
            )
        ]
    )
    path = tmp_path / "export.json"
    export_store(store, "mxdb", path)
    doc = read_export(path)
    assert [e.config_hash for e in doc.entries] == [cfg.hash]
    assert FP.hash in doc.fingerprints
    other = Store.open(f"sqlite:///{tmp_path / 'other.sqlite'}")
    try:
        assert import_export(other, path) == {"read": 1, "added": 1}
        assert import_export(other, path) == {"read": 1, "added": 0}
        [e] = other.entries()
        assert (e.config_hash, e.routing_class, e.fingerprint_hash) == (cfg.hash, "skewed", FP.hash)
    finally:
        other.close()


@pytest.mark.parametrize(
    "content, needle",
    [
        ("{", "not valid JSON"),
        ('{"schema": "other"}', "is not an mxdb store export"),
        ('{"schema": "mxdb.store-export", "schema_version": "9.0"}', "this mxdb reads 1.0, 1.1"),
        (
            '{"schema": "mxdb.store-export", "schema_version": "1.0", "entries": [{"dtype": 1}]}',
            "invalid export at entries.0",
        ),
    ],
)
def test_bad_export_files(tmp_path: Path, content: str, needle: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(InvalidInputError) as err:
        read_export(path)
    assert needle in str(err.value)


def test_bad_vllm_tables_name_the_problem(tmp_path: Path, store: Store) -> None:
    bad = tmp_path / "E=8,N=14336,device_name=NVIDIA_H200.json"
    bad.write_text('{"1": {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 48, "BLOCK_SIZE_K": 64}}')
    with pytest.raises(InvalidInputError, match="key '1': .*power of two"):
        vllm.table_entries(bad)
    with pytest.raises(InvalidInputError, match="does not exist"):
        import_vllm(store, [tmp_path / "missing.json"])
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(InvalidInputError, match="holds no vLLM tables"):
        import_vllm(store, [empty])
    assert store.entries() == []


gemm = st.builds(
    GemmConfig,
    block_m=st.sampled_from([16, 32, 64, 128, 256]),
    block_n=st.sampled_from([32, 64, 128, 256]),
    block_k=st.sampled_from([64, 128, 256]),
    group_m=st.sampled_from([1, 16, 32, 64]),
    num_warps=st.sampled_from([4, 8]),
    num_stages=st.sampled_from([2, 3, 4, 5]),
)


@settings(max_examples=40, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(table=st.dictionaries(st.integers(1, 65536), gemm, min_size=1, max_size=12))
def test_vllm_and_flaggems_render_parse_round_trip(
    table: dict[int, GemmConfig], tmp_path: Path
) -> None:
    path = tmp_path / "E=8,N=14336,device_name=NVIDIA_H200.json"
    path.write_text(vllm.render_table(table))
    assert vllm.read_table(path) == table
    nested = {"NVIDIA_H200": {flaggems.table_key(8, 14336): table}}
    assert flaggems.parse(flaggems.render(nested)) == nested


def test_cli_import_export(tmp_path: Path) -> None:
    db = f"sqlite:///{tmp_path / 'cli.sqlite'}"
    tables = tmp_path / "tables"
    tables.mkdir()
    shutil.copy(MIXTRAL, tables)
    run = [sys.executable, "-m", "mxdb"]
    out = subprocess.run(
        [*run, "import", "vllm", str(tables), "--db", db, "--json"], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["added"] > 0
    exp = subprocess.run(
        [
            *run,
            "export",
            "--format",
            "vllm",
            "--imported",
            "--out",
            str(tmp_path / "x"),
            "--db",
            db,
            "--json",
        ],
        capture_output=True,
        text=True,
    )
    assert exp.returncode == 0, exp.stderr
    written = tmp_path / "x" / MIXTRAL.name
    original = {k: v for k, v in json.loads(MIXTRAL.read_text()).items() if k.isdigit()}
    assert json.loads(written.read_text()) == original
    bad = subprocess.run(
        [*run, "export", "--format", "csv", "--out", "x", "--db", db],
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2 and "csv" in bad.stderr


def _exported(entries: list[tuple[int, str, str]]) -> StoreExport:
    """An export of fp16 Qwen3-shaped entries (tokens, routing class, status)."""
    shape = MoEShape(128, 2048, 768, 8, 16, "fp16")
    out = []
    for m, cls, status in entries:
        cfg = KernelConfig.uniform(GemmConfig(block_m=16, block_n=64 if m % 2 else 32, block_k=64))
        e = Entry(
            dtype="fp16", family=shape.family, dims=shape.with_tokens(m).dims(), tokens=m,
            routing_class=cls, config=cfg.model_dump(), config_hash=cfg.hash,
            fingerprint_hash=FP.hash, status=status, source="tune", speedup=1.1,  # type: ignore[arg-type]
        )  # fmt: skip
        out.append(e)
    return StoreExport(fingerprints={FP.hash: FP}, entries=out)


KEYS = st.lists(
    st.tuples(
        st.integers(1, 6),
        st.sampled_from(["uniform", "skewed", "hot"]),
        st.sampled_from(["verified", "baseline", "parity"]),
    ),
    max_size=12,
)


@given(base=KEYS, top=KEYS)
def test_overlay_replaces_exactly_the_keys_the_top_holds(
    base: list[tuple[int, str, str]], top: list[tuple[int, str, str]]
) -> None:
    b, t = _exported(base), _exported(top)
    doc = overlay(b, t)
    held = {(m, c) for m, c, _ in top}
    got = [(e.tokens, e.routing_class, e.status) for e in doc.entries]
    assert got == [k for k in base if k[:2] not in held] + top
    assert [e.id for e in doc.entries] == list(range(1, len(got) + 1))
    assert doc.fingerprints == {FP.hash: FP}


def test_export_merge_lays_the_store_over_an_export(store: Store, tmp_path: Path) -> None:
    earlier = tmp_path / "earlier.json"
    earlier.write_text(
        _exported([(2, "uniform", "baseline"), (4, "uniform", "verified")]).to_json()
    )
    store.put_fingerprint(FP)
    store.add_entries(_exported([(2, "uniform", "verified")]).entries)
    out = tmp_path / "shipped.json"
    export_store(store, "mxdb", out, ExportOptions(merge=earlier))
    doc = read_export(out)
    assert [(e.tokens, e.status) for e in doc.entries] == [(4, "verified"), (2, "verified")]
    # the table formats have no such thing; a missing file is named
    run = [sys.executable, "-m", "mxdb", "export", "--db", f"sqlite:///{tmp_path / 'mxdb.sqlite'}"]
    bad = subprocess.run([*run, "--format", "vllm", "--fingerprint", FP.hash, "--out",
                          str(tmp_path / "v"), "--merge", str(earlier)],
                         capture_output=True, text=True)  # fmt: skip
    assert bad.returncode == 2 and "--merge applies to --format flaggems and mxdb" in bad.stderr
    gone = subprocess.run([*run, "--format", "mxdb", "--out", str(tmp_path / "x.json"),
                           "--merge", str(tmp_path / "nope.json")], capture_output=True, text=True)  # fmt: skip
    assert gone.returncode == 2 and "nope.json" in gone.stderr
