"""The incumbent (``mxdb.incumbent``) and the dispatch level that answers with it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from mxdb import Dispatcher, DispatchOptions, MoEShape
from mxdb.cli.app import cli
from mxdb.configs import GemmConfig, KernelConfig
from mxdb.fingerprint import fingerprint_document
from mxdb.incumbent import DEFAULT, IMPORTED, SHIPPED, TABLES_DIR, incumbent, shipped_tables
from mxdb.interop import vllm
from mxdb.models import Fingerprint
from mxdb.resources import flaggems_default_config
from mxdb.store import Store
from tests.test_dispatcher import H200, entry

MIXTRAL = MoEShape(8, 4096, 14336, 2, 4, "bf16")
MIXTRAL_TABLE = "E=8,N=14336,device_name=NVIDIA_H200.json"
#: a shape with no vLLM table for any device
UNTABLED = MoEShape(24, 1536, 704, 3, 4, "bf16")


def own_rows(name: str = MIXTRAL_TABLE) -> dict[int, dict[str, int]]:
    raw = json.loads((TABLES_DIR / name).read_text())
    return {int(k): v for k, v in raw.items() if k.isdigit()}


@settings(max_examples=60, deadline=None)
@given(st.integers(min_value=1, max_value=65536))
def test_the_row_is_vllms_nearest_m_for_both_gemms(tokens: int) -> None:
    rows = own_rows()
    # vLLM: min(keys, key=|x - M|) over keys in increasing order: the smaller M on a tie
    want = min(sorted(rows), key=lambda m: abs(m - tokens))
    inc = incumbent(MIXTRAL.with_tokens(tokens), "NVIDIA H200")
    assert (inc.source, inc.table, inc.table_tokens) == (SHIPPED, MIXTRAL_TABLE, want)
    gemm = GemmConfig.from_triton(rows[want])
    assert inc.config == KernelConfig(gemm1=gemm, gemm2=gemm, align_block=gemm.block_m)
    assert MIXTRAL_TABLE in inc.describe() and f"M={want}" in inc.describe()


@pytest.mark.parametrize("name", ["NVIDIA H200", "NVIDIA H200 NVL", "NVIDIA H200 141GB HBM3e"])
def test_every_h200_name_reads_the_h200_tables(name: str) -> None:
    tables = shipped_tables(name)
    assert len(tables) == 22
    assert (8, 14336) in tables and (128, 768) in tables


def test_no_table_no_dtype_or_no_device_is_flaggems_default() -> None:
    for shape, device in [
        (UNTABLED, "NVIDIA H200"),
        (MIXTRAL, "MetaX C500"),
        (MIXTRAL, None),
        (MoEShape(8, 4096, 14336, 2, 4, "fp32"), "NVIDIA H200"),  # tables: fp16/bf16 only
    ]:
        inc = incumbent(shape, device)
        assert inc.source == DEFAULT and inc.table is None and not inc.is_table_row
        assert inc.config == KernelConfig.uniform(flaggems_default_config(shape))
        assert "FlagGems' default" in inc.describe()


def test_every_shipped_table_is_read_whole() -> None:
    names = sorted(p.name for p in TABLES_DIR.glob("E=*.json"))
    assert len(names) == 148
    devices = {vllm.parse_table_name(n).device_name for n in names}
    read = sum(len(shipped_tables(d.replace("_", " "))) for d in devices)
    # every one (the two dtype=bf16 tables are of (E, N)s without a plain table)
    assert read == 148


def test_an_imported_table_comes_before_the_shipped_one() -> None:
    mine = GemmConfig(block_m=32, block_n=64, block_k=64, group_m=1, num_warps=4, num_stages=3)
    inc = incumbent(MIXTRAL, "NVIDIA H200", {(8, 14336): {1: mine, 512: mine}})
    assert (inc.source, inc.table_tokens, inc.config) == (IMPORTED, 1, KernelConfig.uniform(mine))
    assert inc.describe().startswith("imported table " + MIXTRAL_TABLE)


# -- dispatch ------------------------------------------------------------------------


def test_dispatch_answers_the_incumbent_where_nothing_measured_answers(tmp_path: Path) -> None:
    store = Store.open(f"sqlite:///{tmp_path / 'mxdb.sqlite'}")
    try:
        d = Dispatcher(store, H200, DispatchOptions(refresh_interval=0)).dispatch(MIXTRAL)
        want = incumbent(MIXTRAL, "NVIDIA H200")
        assert (d.level, d.reason, d.config) == ("incumbent", "no_entry", want.config)
        assert d.source == want.describe() and d.entry_id is None
        assert d.to_dict()["source"] == want.describe()
        # a shape no table covers: FlagGems' default, as a fallback
        u = Dispatcher(store, H200, DispatchOptions(refresh_interval=0)).dispatch(UNTABLED)
        assert (u.level, u.config, u.source) == ("fallback", None, None)
        # on another device the H200 tables never answer
        c500 = Fingerprint(vendor="metax", device_name="MetaX C500")
        assert Dispatcher(store, c500).dispatch(MIXTRAL).is_fallback
        # turned off: FlagGems' default, as before
        off = Dispatcher(store, H200, DispatchOptions(incumbent=False)).dispatch(MIXTRAL)
        assert (off.level, off.reason, off.config) == ("fallback", "no_entry", None)
    finally:
        store.close()


def test_a_verified_entry_still_answers_before_the_incumbent(tmp_path: Path) -> None:
    store = Store.open(f"sqlite:///{tmp_path / 'mxdb.sqlite'}")
    try:
        store.put_fingerprint(H200)
        e = entry()
        store.add_entries([e])
        d = Dispatcher(store, H200, DispatchOptions(refresh_interval=0)).dispatch(
            MIXTRAL.with_tokens(e.tokens)
        )
        assert (d.level, d.reason, d.source) == ("exact", "exact_match", None)
    finally:
        store.close()


def test_an_imported_vllm_table_answers_as_the_incumbent(tmp_path: Path) -> None:
    """``mxdb import vllm`` of the user's own table: dispatch answers its rows (it is what
    the user's engine runs), naming it."""
    mine = {"1": {"BLOCK_SIZE_M": 32, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 64,
                  "GROUP_SIZE_M": 1, "num_warps": 4, "num_stages": 3}}  # fmt: skip
    folder = tmp_path / "tables"
    folder.mkdir()
    (folder / MIXTRAL_TABLE).write_text(json.dumps(mine))
    db = f"sqlite:///{tmp_path / 'mxdb.sqlite'}"
    runner = CliRunner()
    res = runner.invoke(cli, ["import", "vllm", str(folder / MIXTRAL_TABLE), "--db", db])
    assert res.exit_code == 0, res.output
    fp = tmp_path / "fingerprint.json"
    fp.write_text(json.dumps(fingerprint_document(H200)))
    args = ["dispatch", "-E", "8", "-H", "4096", "-I", "14336", "-k", "2", "-M", "4",
            "--db", db, "--fingerprint", str(fp)]  # fmt: skip
    res = runner.invoke(cli, [*args, "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert (doc["level"], doc["reason"]) == ("incumbent", "no_verified_entry")
    assert doc["triton_config"]["gemm1"] == mine["1"]
    assert doc["source"] == f"imported table {MIXTRAL_TABLE}, row M=1"
    text = runner.invoke(cli, args)
    assert text.exit_code == 0, text.output
    assert "level:      incumbent" in text.stdout
    assert f"the incumbent: imported table {MIXTRAL_TABLE}" in text.stdout
