"""Every hostile input the issue lists: a clear message and exit 2 (or 1), never a traceback.

Each test is one case of the list; each one failed (traceback, hang, silent pass) before
the bounded reader, the CLI's error mapping and the audit's new checks.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import stat
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner, Result

from mxdb.audit import audit_paths
from mxdb.cli import cli
from mxdb.errors import InvalidInputError, StoreError
from mxdb.evidence.synthetic import synthetic_bundle
from mxdb.evidence.writer import write_manifest
from mxdb.fileio import atomic_write_bytes
from mxdb.models import Entry, Fingerprint
from mxdb.store import Store

DATA = Path(__file__).resolve().parent / "data"
DEEP = "[" * 100_000 + "]" * 100_000
SHAPE = ["-E", "8", "-H", "4096", "-I", "14336", "-k", "2", "-M", "4"]
FP = Fingerprint(vendor="nvidia", device_name="NVIDIA H200", triton="3.6.0", flag_gems="5.0.2")


def run(*args: str, env: dict[str, str] | None = None) -> Result:
    return CliRunner().invoke(cli, list(args), env=env)


def assert_clean(res: Result, code: int, *needles: str) -> str:
    """Exit ``code``, a message, no traceback; returns the message text (stderr or JSON)."""
    text = res.output
    assert res.exit_code == code, (res.exit_code, text, res.exception)
    assert res.exception is None or isinstance(res.exception, SystemExit), res.exception
    assert "Traceback" not in text
    for n in needles:
        assert n in text, (n, text)
    return text


@pytest.fixture
def db(tmp_path: Path) -> str:
    url = f"sqlite:///{tmp_path / 'store.sqlite'}"
    with Store.open(url) as s:
        s.put_fingerprint(FP)
    return url


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("pristine") / "bundle"
    synthetic_bundle(root, groups=2, runs_per_group=6, failure_rate=0.3, seed=3)
    return root


@pytest.fixture
def bundle(pristine: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "evidence" / "bundle"
    shutil.copytree(pristine, dst)
    return dst


def remanifest(root: Path) -> None:
    m = json.loads((root / "manifest.json").read_text())
    write_manifest(root, bundle_id=m["bundle_id"], milestone=m["milestone"])


def checks(*paths: Path) -> set[str]:
    return {f.check for f in audit_paths(list(paths)).findings}


# ---------------------------------------------------------------- nesting, sizes, magnitudes


def test_deep_json_in_every_json_reader(tmp_path: Path, db: str) -> None:
    deep = tmp_path / "deep.json"
    deep.write_text(DEEP)
    limit = "limit of 64 levels"  # mxdb.fileio.MAX_JSON_DEPTH
    assert_clean(run("trace", str(deep), "-E", "8"), 2, limit)
    assert_clean(run("dispatch", *SHAPE, "--fingerprint", str(deep), "--db", db), 2, limit)
    assert_clean(run("fingerprint", "--diff", str(deep)), 2, limit)
    assert_clean(run("import", "mxdb", str(deep), "--db", db), 2, limit)
    assert_clean(run("tune", str(deep), "--backend", "fake", "--db", db), 2, limit)
    table = tmp_path / "E=8,N=14336,device_name=NVIDIA_H200.json"
    table.write_text(DEEP)
    assert_clean(run("import", "vllm", str(table), "--db", db), 2, limit)
    assert_clean(run("check-config", "--profile", "h200", *SHAPE, "--config", str(deep)), 2)


def test_deep_json_in_a_bundle_and_its_signature(bundle: Path, tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.mkdir()
    assert_clean(run("keygen", "--out", str(tmp_path / "k.pem")), 0)
    shutil.copy(tmp_path / "k.pem.pub", keys / "k.pub")
    assert_clean(run("sign", str(bundle), "--key", str(tmp_path / "k.pem")), 0)
    sig = next((bundle / "signatures").glob("*.sig"))
    sig.write_text(DEEP)  # read before the signature check
    out = assert_clean(run("audit", str(bundle), "--trusted-keys", str(keys), "--json"), 1)
    assert "signature.malformed" in out
    (bundle / "summary.json").write_text(DEEP)
    remanifest(bundle)
    assert "json.invalid" in checks(bundle)


def test_huge_ids_and_token_counts(tmp_path: Path, db: str) -> None:
    trace = tmp_path / "t.json"
    trace.write_text("[[1e29, 0]]")
    assert_clean(run("trace", str(trace), "-E", "8"), 2, "magnitude limit")
    trace.write_text("[[100000000000000000000000000000, 0]]")
    assert_clean(run("trace", str(trace), "-E", "8"), 2, "magnitude limit")
    trace.write_text("[[70000, 0]]")
    assert_clean(run("trace", str(trace), "-E", "8"), 2, "beyond any expert id")
    big = [*SHAPE[:-1], str(10**22)]
    assert_clean(run("dispatch", *big, "--db", db), 2, "tokens is", "above the limit")
    assert_clean(
        run("check-config", "--profile", "h200", *big, "--config", '{"BLOCK_SIZE_M": 16}'), 2
    )


def test_store_maps_integer_overflow_to_an_input_error(db: str) -> None:
    with Store.open(db) as s, pytest.raises(InvalidInputError, match="too large"):
        s.set_status([10**22], "verified")


def test_npy_header_claiming_a_huge_shape_is_refused_before_loading(tmp_path: Path) -> None:
    path = tmp_path / "huge.npy"
    header = np.lib.format.header_data_from_array_1_0(np.zeros((1, 2), dtype=np.int64))
    header["shape"] = (10**12, 8)
    with path.open("wb") as fh:
        np.lib.format.write_array_header_1_0(fh, header)
        fh.write(b"\0" * 64)
    t0 = time.perf_counter()
    assert_clean(run("trace", str(path), "-E", "8"), 2, "above the limit")
    assert time.perf_counter() - t0 < 5


def test_experts_beyond_the_limit(tmp_path: Path) -> None:
    trace = tmp_path / "t.json"
    trace.write_text("[[0, 1]]")
    assert_clean(run("trace", str(trace), "--experts", str(10**12)), 2, "above the limit")


def test_workload_sizes_are_bounded_before_generation(tmp_path: Path, db: str) -> None:
    wl = tmp_path / "w.yaml"
    wl.write_text("name: big\nmodels: [mixtral-8x7b]\ntokens: [1000000000000]\n")
    t0 = time.perf_counter()
    assert_clean(run("tune", str(wl), "--backend", "fake", "--db", db), 2, "above the limit")
    wl.write_text(
        "name: wide\nmodels: [{experts: 100000000, hidden: 64, intermediate: 64, topk: 2}]\n"
        "tokens: [1]\n"
    )
    assert_clean(run("tune", str(wl), "--backend", "fake", "--db", db), 2, "experts")
    tokens = ", ".join(str(1_000_000 + i) for i in range(100))
    wl.write_text(f"name: many\nmodels: [qwen3-30b-a3b]\ntokens: [{tokens}]\n")
    assert_clean(run("tune", str(wl), "--backend", "fake", "--db", db), 2, "in all")
    assert time.perf_counter() - t0 < 10


def test_large_trace_file_is_refused_unread(tmp_path: Path) -> None:
    path = tmp_path / "big.json"
    with path.open("wb") as fh:
        fh.truncate(200 * 2**20)  # sparse: 200 MB without writing them
    t0 = time.perf_counter()
    assert_clean(run("trace", str(path), "-E", "8"), 2, "above the limit of")
    assert time.perf_counter() - t0 < 5


@pytest.mark.timeout(20)
def test_fifo_is_refused_without_hanging(tmp_path: Path) -> None:
    fifo = tmp_path / "trace.json"
    os.mkfifo(fifo)
    assert_clean(run("trace", str(fifo), "-E", "8"), 2, "FIFO")
    wl = tmp_path / "w.yaml"
    os.mkfifo(wl)
    assert_clean(run("tune", str(wl), "--backend", "fake"), 2, "FIFO")
    assert_clean(run("db", "info", "--db", str(fifo)), 1, "not a regular file")


def test_binary_workload_file(tmp_path: Path, db: str) -> None:
    wl = tmp_path / "w.yaml"
    wl.write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe\x00")
    assert_clean(run("tune", str(wl), "--backend", "fake", "--db", db), 2, "not UTF-8 text")


def test_vllm_table_with_a_non_ascii_digit_key(tmp_path: Path, db: str) -> None:
    table = tmp_path / "E=8,N=14336,device_name=NVIDIA_H200.json"
    cfg = {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 64, "GROUP_SIZE_M": 1}
    table.write_text(json.dumps({"\u00b2": cfg}))
    assert_clean(run("import", "vllm", str(table), "--db", db), 2, "skipped")
    table.write_text(json.dumps({"0": {**cfg, "num_warps": 4, "num_stages": 2}}))
    assert_clean(run("import", "vllm", str(table), "--db", db), 2, "token count")


def test_import_vllm_of_zero_sized_tables_fails(tmp_path: Path, db: str) -> None:
    src = DATA.parent.parent / "mxdb" / "data" / "vllm" / "E=8,N=14336,device_name=NVIDIA_H200.json"
    bad = tmp_path / "E=0,N=0,device_name=NVIDIA_H200.json"
    shutil.copy(src, bad)
    out = assert_clean(run("import", "vllm", str(bad), "--db", db), 2, "every one of the 1")
    assert "E=0" in out
    with Store.open(db) as s:
        assert s.entries(source="vllm") == []


# ---------------------------------------------------------------- outputs


def test_bad_out_paths(tmp_path: Path, db: str, bundle: Path) -> None:
    afile = tmp_path / "afile"
    afile.write_text("x")
    assert_clean(
        run("export", "--format", "mxdb", "--out", str(afile / "x.json"), "--db", db),
        2,
        "cannot write",
    )
    wl = Path(__file__).resolve().parents[1] / "examples" / "workloads" / "smoke.yaml"
    res = run(
        "tune", str(wl), "--backend", "fake", "--no-progress", "--db", db, "--out", str(afile)
    )
    assert_clean(res, 2, "choose another --out")
    assert_clean(run("report", str(bundle), "--out", str(afile / "r"), "--no-plots"), 2)
    assert_clean(run("keygen", "--out", str(afile / "k.pem")), 2)


def test_full_disk_is_a_message(tmp_path: Path, db: str, monkeypatch: Any) -> None:
    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("mxdb.fileio.os.fsync", full)
    out = tmp_path / "export.json"
    res = run("export", "--format", "mxdb", "--out", str(out), "--db", db)
    assert_clean(res, 1, "disk is full")
    assert not out.exists() and list(tmp_path.glob(".export.json*")) == []


def test_files_follow_the_umask(tmp_path: Path) -> None:
    old = os.umask(0o022)
    try:
        p = atomic_write_bytes(tmp_path / "a.json", b"{}")
        assert stat.S_IMODE(p.stat().st_mode) == 0o644
        os.umask(0o077)
        q = atomic_write_bytes(tmp_path / "b.json", b"{}")
        assert stat.S_IMODE(q.stat().st_mode) == 0o600
    finally:
        os.umask(old)


# ---------------------------------------------------------------- the CLI's error contract


def test_json_errors_are_json_on_stdout(tmp_path: Path) -> None:
    res = CliRunner().invoke(cli, ["trace", str(tmp_path / "none.json"), "-E", "8", "--json"])
    assert res.exit_code == 2
    doc = json.loads(res.stdout)
    assert doc["error"]["type"] == "TraceError" and doc["error"]["exit_code"] == 2
    assert "does not exist" in doc["error"]["message"]
    res = CliRunner().invoke(cli, ["trace", "x.json", "-E", "zero", "--json"])
    assert res.exit_code == 2 and json.loads(res.stdout)["error"]["type"] == "UsageError"


def test_unexpected_errors_have_no_traceback_unless_debug(monkeypatch: Any) -> None:
    def boom(*a: Any, **k: Any) -> Any:
        raise RuntimeError("kaboom")

    monkeypatch.setattr("mxdb.hostinfo.describe", boom)
    res = run("fingerprint")
    assert_clean(res, 1, "kaboom", "--debug")
    res = CliRunner().invoke(cli, ["fingerprint", "--debug"])
    assert res.exit_code == 1 and "Traceback" in res.output


def test_tune_without_torch_says_what_to_install(tmp_path: Path, monkeypatch: Any) -> None:
    import importlib.util

    real = importlib.util.find_spec

    def find_spec(name: str, *a: Any, **k: Any) -> Any:
        return None if name == "torch" else real(name, *a, **k)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    wl = Path(__file__).resolve().parents[1] / "examples" / "workloads" / "smoke.yaml"
    res = run("tune", str(wl), "--db", f"sqlite:///{tmp_path / 's.sqlite'}")
    assert_clean(res, 1, "mxdb[gpu]", "--backend fake", "torch")


def test_mistyped_db_creates_nothing(tmp_path: Path) -> None:
    missing = tmp_path / "typo" / "nested" / "store.sqlite"
    url = f"sqlite:///{missing}"
    assert_clean(run("dispatch", *SHAPE, "--db", url), 1, "no store")
    assert_clean(run("db", "info", "--db", url), 1, "no store")
    assert_clean(
        run("export", "--format", "mxdb", "--out", str(tmp_path / "e.json"), "--db", url), 1
    )
    assert_clean(run("drift", "check", "--db", url, "--dry-run"), 1, "no store")
    assert_clean(run("drift", "guard", "--db", url, "--backend", "fake"), 1, "no store")
    assert not (tmp_path / "typo").exists()


def test_read_only_store_opens_for_reading(db: str, monkeypatch: Any) -> None:
    with Store.open(db) as s:
        s.add_entries([_entry()])
    monkeypatch.setattr("mxdb.store.store._writable", lambda path: False)
    path = Path(db.removeprefix("sqlite:///"))
    path.chmod(0o444)
    try:
        res = run("dispatch", *SHAPE, "--db", db, "--json")
        assert_clean(res, 0)
        assert_clean(run("db", "info", "--db", db), 0, "entries: 1")
        with Store.open(db) as s, pytest.raises(StoreError, match="read-only"):
            s.add_entries([_entry(tokens=8)])
    finally:
        path.chmod(0o644)


def test_empty_fingerprint_is_rejected(tmp_path: Path, db: str) -> None:
    fp = tmp_path / "fp.json"
    fp.write_text("{}")
    assert_clean(run("dispatch", *SHAPE, "--fingerprint", str(fp), "--db", db), 2, "no component")


def test_export_status_must_be_a_status(tmp_path: Path, db: str) -> None:
    out = tmp_path / "e.json"
    assert_clean(run("export", "--format", "mxdb", "--status", "bogus", "--out", str(out)), 2)
    assert not out.exists()


def test_empty_npy_gets_a_clear_error(tmp_path: Path) -> None:
    empty = tmp_path / "t.npy"
    empty.write_bytes(b"")
    out = assert_clean(run("trace", str(empty), "-E", "8"), 2, "empty (0 bytes)")
    assert "Aborted" not in out
    np.save(tmp_path / "z.npy", np.zeros((0, 2), dtype=np.int64))
    assert_clean(run("trace", str(tmp_path / "z.npy"), "-E", "8"), 2, "empty")


def test_report_without_matplotlib_says_so_and_writes_nothing(
    bundle: Path, tmp_path: Path, monkeypatch: Any
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails as if absent
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a, **k: None if name == "matplotlib" else real(name, *a, **k),
    )
    out = tmp_path / "report"
    assert_clean(run("report", str(bundle), "--out", str(out)), 1, "not installed", "--no-plots")
    assert not out.exists()
    assert_clean(run("report", str(bundle), "--out", str(out), "--no-plots"), 0)


def test_trace_reads_mxdbs_own_trace_files() -> None:
    evidence = Path(__file__).resolve().parents[1] / "evidence"
    own = next(evidence.glob("c500-m0-*/traces/*.json"))
    assert_clean(run("trace", str(own), "-E", "8", "--json"), 0, "routing_class")


def test_import_commits_fingerprints_with_entries(
    tmp_path: Path, db: str, monkeypatch: Any
) -> None:
    src = f"sqlite:///{tmp_path / 'src.sqlite'}"
    other = Fingerprint(vendor="nvidia", device_name="Other", triton="3.6.0")
    with Store.open(src) as s:
        s.put_fingerprint(other)
        s.add_entries([_entry(fp=other)])
    export = tmp_path / "e.json"
    assert_clean(run("export", "--format", "mxdb", "--out", str(export), "--db", src), 0)

    def killed(self: Store, conn: Any, entries: Any) -> Any:
        raise KeyboardInterrupt  # the process dies mid-import

    monkeypatch.setattr(Store, "_add_entries", killed)
    with Store.open(db) as s, pytest.raises(KeyboardInterrupt):
        from mxdb.interop.export import import_export

        import_export(s, export)
    with Store.open(db) as s:
        assert other.hash not in s.fingerprints()


def test_dispatch_never_waits_for_a_store_refresh(db: str) -> None:
    from mxdb import Dispatcher, DispatchOptions
    from mxdb.configs import GemmConfig, KernelConfig
    from mxdb.shapes import MoEShape

    with Store.open(db) as s:
        s.add_entries([_entry()])
    store = Store.open(db)
    disp = Dispatcher(store, FP, DispatchOptions(refresh_interval=0.02))
    shape = MoEShape(8, 4096, 14336, 2, 4, "bf16")
    assert disp.dispatch(shape, "uniform").reason == "exact_match"
    real_rows = store.family_rows

    def slow_rows(*a: Any) -> Any:
        time.sleep(0.3)  # a slow database
        return real_rows(*a)

    store.family_rows = slow_rows  # type: ignore[method-assign]
    cfg = KernelConfig.uniform(GemmConfig(block_m=32, block_n=64, block_k=64))
    with Store.open(db) as s:
        s.set_status([e.id for e in s.entries() if e.id is not None], "stale")
        s.add_entries([_entry(config=cfg)])
    worst = 0.0
    deadline = time.monotonic() + 5
    changed = False
    while time.monotonic() < deadline:
        t0 = time.perf_counter()
        d = disp.dispatch(shape, "uniform")
        worst = max(worst, time.perf_counter() - t0)
        if d.config == cfg:
            changed = True
            break
        time.sleep(0.001)
    disp.close()
    store.close()
    assert changed, "the refresher never picked up the change"
    assert worst < 0.1, f"a call waited {worst:.3f} s for the store"
    assert threading.active_count() >= 1


def test_tests_need_nothing_outside_the_repository() -> None:
    here = Path(__file__).resolve().parent
    shared = '"shared"'
    outside = (shared + ' / "peers"', "../" + "shared", "parents[2] / " + shared)
    for test in here.glob("*.py"):
        text = test.read_text()
        assert not any(o in text for o in outside), test.name
    notice = (DATA.parent.parent / "mxdb" / "data" / "vllm" / "NOTICE.md").read_text()
    assert "Apache" in notice and "byte-identical" in notice
    assert (
        len(
            list(
                (DATA.parent.parent / "mxdb" / "data" / "vllm").glob(
                    "E=*,device_name=NVIDIA_H200.json"
                )
            )
        )
        == 22
    )


# ---------------------------------------------------------------- audit blind spots


def test_duplicate_json_keys_are_a_finding(bundle: Path) -> None:
    text = (bundle / "summary.json").read_text()
    assert text.startswith("{")
    (bundle / "summary.json").write_text('{"schema": "forged", ' + text[1:])
    remanifest(bundle)
    assert "json.duplicate_key" in checks(bundle)
    from mxdb.fileio import parse_json

    with pytest.raises(InvalidInputError, match="duplicate key"):
        parse_json('{"speedup": 9.99, "speedup": true}')


def test_report_md_edit_is_a_finding(bundle: Path) -> None:
    md = bundle / "report" / "report.md"
    md.write_text(md.read_text().replace("Geometric mean speedup", "Geometric mean speedup 9x"))
    remanifest(bundle)
    assert "report.markdown_mismatch" in checks(bundle)


def test_case_colliding_summary_is_a_finding(bundle: Path) -> None:
    forged = json.loads((bundle / "summary.json").read_text())
    forged["geomean_speedup"] = 9.99
    (bundle / "Summary.json").write_text(json.dumps(forged))
    remanifest(bundle)
    assert "bundle.case_collision" in checks(bundle)


def test_hardlink_out_of_the_bundle_is_a_finding(bundle: Path, tmp_path: Path) -> None:
    target = bundle / "report" / "report.md"
    outside = tmp_path / "outside.md"
    os.link(target, outside)
    assert "bundle.hardlink" in checks(bundle)


def test_bundle_folder_without_manifest_is_a_finding(bundle: Path) -> None:
    killed = bundle.parent / "killed-tune"
    shutil.copytree(bundle, killed)
    (killed / "manifest.json").unlink()
    assert checks(bundle.parent) == {"bundle.no_manifest"}
    res = run("audit", str(bundle.parent))
    assert_clean(res, 1, "without a manifest")
    assert checks(killed) == {"bundle.no_manifest"}


def _entry(
    tokens: int = 4, fp: Fingerprint = FP, config: Any = None, status: str = "verified"
) -> Entry:
    from mxdb.configs import GemmConfig, KernelConfig
    from mxdb.shapes import MoEShape

    cfg = config or KernelConfig.uniform(GemmConfig(block_m=16, block_n=64, block_k=64))
    s = MoEShape(8, 4096, 14336, 2, tokens, "bf16")
    return Entry(
        op=s.op,
        dtype=s.dtype,
        family=s.family,
        dims=s.dims(),
        tokens=tokens,
        routing_class="uniform",
        config=cfg.model_dump(),
        config_hash=cfg.hash,
        fingerprint_hash=fp.hash,
        device_name=fp.device_name,
        status=status,  # type: ignore[arg-type]
        source="test",
        speedup=1.05,
        noise_band=0.01,
    )


def test_background_refresh_keeps_unchanged_families_and_updates_changed_ones(db: str) -> None:
    from mxdb import Dispatcher, DispatchOptions
    from mxdb.configs import GemmConfig, KernelConfig
    from mxdb.shapes import MoEShape

    with Store.open(db) as s:
        s.add_entries([_entry()])
    store = Store.open(db)
    disp = Dispatcher(store, FP, DispatchOptions(refresh_interval=3600))  # refreshed by hand
    a = MoEShape(8, 4096, 14336, 2, 4, "bf16")
    b = MoEShape(16, 1024, 512, 2, 4, "bf16")
    first_a, first_b = disp.dispatch(a, "uniform"), disp.dispatch(b, "uniform")
    assert first_a.reason == "exact_match" and first_b.reason == "no_entry"
    cfg = KernelConfig.uniform(GemmConfig(block_m=32, block_n=64, block_k=64))
    other = _entry(config=cfg)
    other = other.model_copy(update={"family": b.family, "dims": b.dims()})
    with Store.open(db) as s:
        s.add_entries([other])
    assert disp.refresh_now() is True
    assert disp.dispatch(a, "uniform") is first_a  # unchanged family: the same decision
    assert disp.dispatch(b, "uniform").config == cfg
    assert disp.refresh_now() is False  # nothing new
    disp.close()
    store.close()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_keeps_refreshing(db: str) -> None:
    from mxdb import Dispatcher, DispatchOptions

    store = Store.open(db)
    disp = Dispatcher(store, FP, DispatchOptions(refresh_interval=0.01))
    pid = os.fork()
    if pid == 0:  # the child: its refresher must be alive
        code = 0 if disp._thread is not None and disp._thread.is_alive() else 3
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    disp.close()
    store.close()
    assert os.waitstatus_to_exitcode(status) == 0
