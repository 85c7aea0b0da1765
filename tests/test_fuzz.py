"""The fuzz suite: hostile inputs to every file parser and every CLI command.

Hypothesis builds the inputs: valid documents (the committed examples, a synthetic evidence
bundle, vLLM's tables) with hostile values put in at random places (huge and negative
numbers, NaN, wrong types, deep nesting, non-ASCII digits, long strings), raw-text damage
(truncation, duplicated keys, flipped bytes, deep nesting, binary bytes), and hostile
command-line values (huge, negative and non-numeric numbers; paths to FIFOs, folders,
binary, empty and deeply nested files; paths under a file).

The rule for every case: a parser returns or raises an ``MxdbError``; a command exits 0, 1 or
2 with a message, never with a traceback, never with the "unexpected error" of a bug, and
each case finishes within ``CASE_TIMEOUT_S`` (a SIGALRM per case turns a hang into a
failure).  The budget is fixed (``derandomize``, ``max_examples`` per test) so that CI runs
the same cases every time; ``MXDB_FUZZ_EXAMPLES`` scales it for a longer local run.
``MXDB_FUZZ_REPORT=FILE`` writes how many cases ran.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import signal
import tempfile
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mxdb.audit import AuditOptions, audit_paths
from mxdb.cli import cli
from mxdb.configs import KernelConfig
from mxdb.errors import MxdbError
from mxdb.evidence.synthetic import synthetic_bundle
from mxdb.evidence.writer import write_manifest
from mxdb.fingerprint import load_fingerprint
from mxdb.interop import flaggems, vllm
from mxdb.interop.export import read_export
from mxdb.models import Fingerprint
from mxdb.routing import load_topk
from mxdb.store import Store
from mxdb.tune.workload import load_workload

ROOT = Path(__file__).resolve().parents[1]
VLLM_DIR = ROOT / "mxdb" / "data" / "vllm"
CASE_TIMEOUT_S = 10.0
SCALE = float(os.environ.get("MXDB_FUZZ_EXAMPLES", "1"))
TRIED: Counter[str] = Counter()


def budget(n: int) -> Any:
    return settings(
        max_examples=max(1, int(n * SCALE)),
        derandomize=True,
        database=None,
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )


class Hang(Exception):
    pass


@contextmanager
def case(kind: str) -> Iterator[None]:
    """One fuzz case: counted, and failed (not hung) after CASE_TIMEOUT_S."""
    TRIED[kind] += 1

    def alarm(signum: int, frame: Any) -> None:
        raise Hang(f"{kind}: a case ran longer than {CASE_TIMEOUT_S} s")

    old = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, CASE_TIMEOUT_S)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def parses_or_refuses(kind: str, fn: Callable[[], Any]) -> None:
    with case(kind):
        try:
            fn()
        except MxdbError as exc:
            assert str(exc), f"{kind}: an error without a message"


# ---------------------------------------------------------------- hostile material

HOSTILE_SCALARS = st.sampled_from(
    [
        0,
        -1,
        2**31,
        2**63,
        10**30,
        -(10**30),
        1e308,
        -1e-308,
        0.5,
        float("nan"),
        float("inf"),
        "",
        "\u00b2",
        "\u0663",
        "x" * 5000,
        "../../etc/passwd",
        "NVIDIA H200",
        None,
        True,
        False,
        [],
        {},
        [[]],
        [[0, 0]],
        {"": None},
    ]
)
HOSTILE_VALUES = st.one_of(
    HOSTILE_SCALARS,
    st.integers(),
    st.floats(),
    st.text(max_size=12),
    st.lists(st.integers(min_value=-3, max_value=300), max_size=5),
    st.integers(min_value=60, max_value=120).map(lambda d: json.loads("[" * d + "]" * d)),
)


def _paths(doc: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if isinstance(doc, dict):
        for k, v in list(doc.items())[:40]:
            out += _paths(v, (*prefix, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc[:6]):
            out += _paths(v, (*prefix, i))
    return out


def _set(doc: Any, path: tuple[Any, ...], value: Any) -> Any:
    if not path:
        return value
    node = doc
    for p in path[:-1]:
        node = node[p]
    node[path[-1]] = value
    return doc


@st.composite
def mutated(draw: st.DrawFn, base: Any) -> Any:
    """``base`` with 1-3 hostile values put in at random places (keys added or replaced)."""
    doc = copy.deepcopy(base)
    for _ in range(draw(st.integers(min_value=1, max_value=3))):
        paths = _paths(doc)
        path = draw(st.sampled_from(paths))
        if draw(st.booleans()) and isinstance(_get(doc, path), dict):
            path = (*path, draw(st.sampled_from(["schema", "tokens", "experts", "ids", "x"])))
        doc = _set(doc, path, draw(HOSTILE_VALUES))
    return doc


def _get(doc: Any, path: tuple[Any, ...]) -> Any:
    for p in path:
        doc = doc[p]
    return doc


def _dump(doc: Any) -> str:
    return json.dumps(doc, allow_nan=True)


@st.composite
def damaged_text(draw: st.DrawFn, text: str) -> bytes:
    """Raw damage to a document's text: truncation, duplicate keys, flipped bytes, nesting."""
    data = text.encode("utf-8", "surrogatepass")
    how = draw(st.sampled_from(["truncate", "dup", "flip", "deep", "binary", "empty", "bom"]))
    if how == "truncate" and data:
        return data[: draw(st.integers(min_value=0, max_value=len(data) - 1))]
    if how == "dup" and data.startswith(b"{"):
        key = draw(st.sampled_from([b'"schema"', b'"speedup"', b'"tokens"', b'"ids"']))
        return b"{" + key + b": 1, " + key + b": true, " + data[1:]
    if how == "flip" and data:
        i = draw(st.integers(min_value=0, max_value=len(data) - 1))
        return data[:i] + bytes([data[i] ^ draw(st.integers(1, 255))]) + data[i + 1 :]
    if how == "deep":
        depth = draw(st.integers(min_value=65, max_value=200_000))
        return b"[" * depth + b"]" * draw(st.sampled_from([depth, 0, depth // 2]))
    if how == "binary":
        return draw(st.binary(min_size=1, max_size=64))
    if how == "bom":
        return b"\xef\xbb\xbf" + data
    return b""


def hostile_document(base: Any) -> st.SearchStrategy[bytes]:
    """Bytes of a hostile version of ``base``: mutated values, or damaged text."""
    text = _dump(base)
    return st.one_of(
        mutated(base).map(lambda d: _dump(d).encode()),
        damaged_text(text),
    )


def write(tmp: Path, name: str, data: bytes) -> Path:
    p = tmp / name
    p.write_bytes(data)
    return p


@pytest.fixture(scope="module")
def material(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("fuzz")
    bundle = synthetic_bundle(root / "bundle", groups=2, runs_per_group=4, seed=5)
    return {"root": root, "bundle": bundle}


def _bases() -> dict[str, Any]:
    """The valid documents hostile cases start from, built without the fixture."""
    tmp = Path(tempfile.mkdtemp(prefix="mxdb-fuzz-"))
    bundle = synthetic_bundle(tmp / "bundle", groups=2, runs_per_group=4, seed=5)
    out: dict[str, Any] = {
        rel: json.loads((bundle / rel).read_text())
        for rel in ("manifest.json", "summary.json", "fingerprint.json", "store_export.json")
    }
    out["run"] = json.loads(next((bundle / "runs").glob("*.json")).read_text())
    out["trace"] = json.loads(next((bundle / "traces").glob("*.json")).read_text())
    out["vllm"] = json.loads((VLLM_DIR / "E=8,N=14336,device_name=NVIDIA_H200.json").read_text())
    out["workload"] = yaml.safe_load((ROOT / "examples/workloads/smoke.yaml").read_text())
    out["flaggems"] = yaml.safe_load(
        flaggems.render(
            {
                "NVIDIA_H200": {
                    flaggems.table_key(8, 14336): {
                        1: KernelConfig.parse(out["vllm"]["1"]).gemm1,
                        64: KernelConfig.parse(out["vllm"]["64"]).gemm1,
                    }
                }
            }
        )
    )
    shutil.rmtree(tmp, ignore_errors=True)
    return out


BASES = _bases()


# ---------------------------------------------------------------- file parsers


@budget(120)
@given(data=hostile_document(BASES["trace"]), experts=st.sampled_from([None, 8, 1, 10**12]))
def test_trace_json(tmp_path_factory: pytest.TempPathFactory, data: bytes, experts: Any) -> None:
    tmp = tmp_path_factory.mktemp("t")
    path = write(tmp, "t.json", data)
    parses_or_refuses("trace.json", lambda: load_topk(path, experts=experts))


@st.composite
def npy_bytes(draw: st.DrawFn) -> bytes:
    import io

    shape = tuple(draw(st.lists(st.integers(0, 10**13), min_size=0, max_size=3)))
    dtype = draw(st.sampled_from(["<i8", "<u8", "<f8", "|b1", "<f2", "|O", "<U3", ">i4"]))
    header = {"descr": dtype, "fortran_order": draw(st.booleans()), "shape": shape}
    fh = io.BytesIO()
    if draw(st.booleans()):
        np.lib.format.write_array_header_1_0(fh, header)
    else:
        np.lib.format.write_array_header_2_0(fh, header)
    body = draw(st.binary(max_size=256))
    raw = fh.getvalue() + body
    if draw(st.integers(0, 4)) == 0:  # damage the header itself
        i = draw(st.integers(0, len(raw) - 1))
        raw = raw[:i] + draw(st.binary(max_size=8)) + raw[i + 1 :]
    return raw


@budget(120)
@given(data=npy_bytes())
def test_trace_npy(tmp_path_factory: pytest.TempPathFactory, data: bytes) -> None:
    path = write(tmp_path_factory.mktemp("n"), "t.npy", data)
    parses_or_refuses("trace.npy", lambda: load_topk(path, experts=8))


@budget(120)
@given(
    doc=mutated(BASES["workload"]),
    raw=damaged_text(yaml.safe_dump(BASES["workload"])),
    form=st.sampled_from(["yaml", "json", "raw"]),
)
def test_workload(
    tmp_path_factory: pytest.TempPathFactory, doc: Any, raw: bytes, form: str
) -> None:
    tmp = tmp_path_factory.mktemp("w")
    if form == "yaml":
        try:
            data = yaml.safe_dump(doc, allow_unicode=True).encode()
        except yaml.YAMLError:
            data = raw
        path = write(tmp, "w.yaml", data)
    elif form == "json":
        path = write(tmp, "w.json", _dump(doc).encode())
    else:
        path = write(tmp, "w.yaml", raw)
    parses_or_refuses("workload", lambda: load_workload(path))


@budget(100)
@given(
    data=hostile_document(BASES["vllm"]),
    name=st.sampled_from(
        [
            "E=8,N=14336,device_name=NVIDIA_H200.json",
            "E=0,N=0,device_name=X.json",
            "E=99999999999,N=1,device_name=X.json",
            "E=8,N=14336,device_name=X,dtype=fp8_w8a8.json",
            "E=\u0663,N=1,device_name=X.json",
            "mixtral.json",
        ]
    ),
)
def test_vllm_table(tmp_path_factory: pytest.TempPathFactory, data: bytes, name: str) -> None:
    path = write(tmp_path_factory.mktemp("v"), name, data)
    parses_or_refuses("vllm table", lambda: vllm.table_entries(path))


@budget(100)
@given(doc=mutated(BASES["flaggems"]), raw=damaged_text(yaml.safe_dump(BASES["flaggems"])))
def test_flaggems_yaml(tmp_path_factory: pytest.TempPathFactory, doc: Any, raw: bytes) -> None:
    tmp = tmp_path_factory.mktemp("f")
    try:
        text = yaml.safe_dump(doc, allow_unicode=True).encode()
    except yaml.YAMLError:
        text = raw
    for i, data in enumerate((text, raw)):
        path = write(tmp, f"fused_moe_config{i}.yaml", data)
        parses_or_refuses("flaggems yaml", lambda p=path: flaggems.read(p))


@budget(100)
@given(data=hostile_document(BASES["store_export.json"]))
def test_store_export(tmp_path_factory: pytest.TempPathFactory, data: bytes) -> None:
    tmp = tmp_path_factory.mktemp("e")
    path = write(tmp, "export.json", data)
    parses_or_refuses("store export", lambda: read_export(path))

    def load() -> None:
        with Store.open(f"sqlite:///{tmp / 's.sqlite'}") as s:
            from mxdb.interop.export import import_export

            import_export(s, path)

    parses_or_refuses("store export import", load)


@budget(100)
@given(data=hostile_document(BASES["fingerprint.json"]))
def test_fingerprint(tmp_path_factory: pytest.TempPathFactory, data: bytes) -> None:
    path = write(tmp_path_factory.mktemp("p"), "fp.json", data)
    parses_or_refuses("fingerprint", lambda: load_fingerprint(path))


BUNDLE_FILES = ["manifest.json", "summary.json", "fingerprint.json", "store_export.json", "run"]


@budget(120)
@given(
    which=st.sampled_from(BUNDLE_FILES),
    data=st.data(),
    remanifest=st.booleans(),
)
def test_bundle_documents(
    material: dict[str, Any],
    tmp_path_factory: pytest.TempPathFactory,
    which: str,
    data: Any,
    remanifest: bool,
) -> None:
    """The manifest, summary, fingerprint, export and run documents, as the audit reads them."""
    tmp = tmp_path_factory.mktemp("b")
    bundle = tmp / "bundle"
    shutil.copytree(material["bundle"], bundle)
    raw = data.draw(hostile_document(BASES[which]))
    rel = which if which != "run" else "runs/" + next((bundle / "runs").glob("*.json")).name
    (bundle / rel).write_bytes(raw)
    if remanifest and which != "manifest.json":
        m = json.loads((material["bundle"] / "manifest.json").read_text())
        write_manifest(bundle, bundle_id=m["bundle_id"], milestone=m["milestone"])
    with case(f"audit {which}"):
        audit_paths([bundle], AuditOptions())  # findings or none: never an exception


@pytest.fixture(scope="module")
def signed(material: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("signed")
    from mxdb.signing import keygen, sign_bundle

    key, pub = keygen(tmp / "k.pem")
    keys = tmp / "keys"
    keys.mkdir()
    shutil.copy(pub, keys / "k.pub")
    bundle = tmp / "bundle"
    shutil.copytree(material["bundle"], bundle)
    sign_bundle(bundle, key)
    return {"bundle": bundle, "keys": keys}


@budget(80)
@given(data=st.data())
def test_signature(
    signed: dict[str, Path], tmp_path_factory: pytest.TempPathFactory, data: Any
) -> None:
    tmp = tmp_path_factory.mktemp("s")
    bundle = tmp / "bundle"
    shutil.copytree(signed["bundle"], bundle)
    sig = next((bundle / "signatures").glob("*.sig"))
    base = json.loads(sig.read_text())
    sig.write_bytes(data.draw(hostile_document(base)))
    with case("signature"):
        result = audit_paths([bundle], AuditOptions(trusted_keys=signed["keys"]))
    if _loads(sig) != base:
        assert result.findings, "a damaged signature passed"


@budget(100)
@given(doc=mutated(BASES["vllm"]["64"]), text=st.text(max_size=40))
def test_kernel_config(doc: Any, text: str) -> None:
    parses_or_refuses("config", lambda: KernelConfig.parse(_dump(doc)))
    parses_or_refuses("config text", lambda: KernelConfig.parse(text))


def _loads(path: Path) -> Any:
    """The JSON value of a file, or None when it is not (strictly) JSON."""
    try:
        return json.loads(path.read_bytes(), parse_constant=lambda c: None)
    except (ValueError, RecursionError):
        return None


# ---------------------------------------------------------------- every CLI command

NUMBERS = st.sampled_from(
    ["0", "-1", "1", "8", "2", "1e12", str(10**22), "nan", "", "\u00b2", "9" * 400, "0x10"]
)


@pytest.fixture(scope="module")
def places(material: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Hostile paths: FIFO, folder, binary, empty, deep JSON, a path under a file, ..."""
    tmp = tmp_path_factory.mktemp("places")
    fifo = tmp / "fifo.json"
    os.mkfifo(fifo)
    (tmp / "afile").write_text("x")
    (tmp / "binary.yaml").write_bytes(b"\x00\xff\xfe" * 10)
    (tmp / "empty.json").write_bytes(b"")
    (tmp / "empty.npy").write_bytes(b"")
    (tmp / "deep.json").write_text("[" * 100_000 + "]" * 100_000)
    (tmp / "dup.json").write_text('{"topk_ids": [[0, 1]], "topk_ids": [[1, 2]]}')
    (tmp / "dir").mkdir()
    scratch = tmp / "scratch"
    scratch.mkdir()
    (tmp / "ok.json").write_text("[[0, 1], [2, 3]]")
    db = tmp / "store.sqlite"
    with Store.open(f"sqlite:///{db}") as s:
        s.put_fingerprint(Fingerprint(vendor="nvidia", device_name="NVIDIA H200"))
    return {
        "fifo": str(fifo),
        "under_file": str(tmp / "afile" / "x"),
        "binary": str(tmp / "binary.yaml"),
        "empty": str(tmp / "empty.json"),
        "empty_npy": str(tmp / "empty.npy"),
        "deep": str(tmp / "deep.json"),
        "dup": str(tmp / "dup.json"),
        "dir": str(tmp / "dir"),
        "missing": str(tmp / "missing" / "x.json"),
        "ok": str(tmp / "ok.json"),
        "bundle": str(material["bundle"]),
        "vllm": str(VLLM_DIR / "E=8,N=14336,device_name=NVIDIA_H200.json"),
        "db": f"sqlite:///{db}",
        "bad_db": "sqlite:///" + str(tmp / "afile"),
        "weird_db": "nosuchdriver://x",
        "scratch": str(scratch),
    }


PATH_KEYS = [
    "fifo",
    "under_file",
    "binary",
    "empty",
    "empty_npy",
    "deep",
    "dup",
    "dir",
    "missing",
    "ok",
    "bundle",
    "vllm",
]
DB_KEYS = ["db", "bad_db", "weird_db", "missing"]


@st.composite
def command(draw: st.DrawFn, places: dict[str, str]) -> list[str]:
    def path() -> str:
        return places[draw(st.sampled_from(PATH_KEYS))]

    def num() -> str:
        return draw(NUMBERS)

    def out() -> str:
        key = draw(st.sampled_from(["under_file", "dir", "fresh", "fresh", "fresh"]))
        if key == "fresh":
            return str(Path(tempfile.mkdtemp(dir=places["scratch"])) / "out")
        return places[key]

    def db() -> list[str]:
        key = draw(st.sampled_from(DB_KEYS))
        return ["--db", places[key] if key != "missing" else "sqlite:///" + places["missing"]]

    shape = ["-E", num(), "-H", num(), "-I", num(), "-k", num(), "-M", num()]
    name = draw(
        st.sampled_from(
            [
                "dispatch",
                "trace",
                "fingerprint",
                "check-config",
                "import vllm",
                "import mxdb",
                "export",
                "db info",
                "audit",
                "report",
                "sign",
                "keygen",
                "tune",
                "drift check",
                "drift guard",
            ]
        )
    )
    argv = name.split()
    if name == "dispatch":
        argv += shape + db()
        extra = draw(st.sampled_from(["--routing-trace", "--fingerprint", "--routing-class", ""]))
        if extra == "--routing-class":
            argv += [extra, draw(st.sampled_from(["uniform", "bogus"]))]
        elif extra:
            argv += [extra, path()]
    elif name == "trace":
        argv += [path(), "-E", num()]
    elif name == "fingerprint":
        argv += ["--diff", path()] if draw(st.booleans()) else []
    elif name == "check-config":
        profile = draw(st.sampled_from(["h200", "c500", "bogus"]))
        config = draw(st.sampled_from(['{"BLOCK_SIZE_M": 16}', "{", path()]))
        argv += ["--profile", profile, *shape, "--config", config]
    elif name == "import vllm" or name == "import mxdb":
        argv += [path(), *db()]
    elif name == "export":
        fmt = draw(st.sampled_from(["mxdb", "vllm", "flaggems"]))
        status = draw(st.sampled_from(["verified", "bogus"]))
        argv += ["--format", fmt, "--status", status, "--out", out(), *db()]
    elif name == "db info":
        argv += db()
    elif name == "audit":
        argv += [path()]
        if draw(st.booleans()):
            argv += ["--trusted-keys", path()]
    elif name == "report":
        argv += [path(), "--out", out(), "--no-plots"]
    elif name == "sign":
        argv += [path(), "--key", path()]
    elif name == "keygen":
        argv += ["--out", out()]
    elif name == "tune":
        argv += [path(), "--backend", "fake", "--budget", "0.0001", "--no-progress", *db()]
        argv += ["--out", out(), "--devices", draw(st.sampled_from(["0", "-1", "x", "0,0"]))]
    elif name == "drift check":
        argv += [*db(), "--dry-run"]
        if draw(st.booleans()):
            argv += ["--fingerprint", path()]
    elif name == "drift guard":
        argv += [*db(), "--backend", "fake", "--max-shapes", num(), "--reps", num()]
    if draw(st.booleans()):
        argv.append("--json")
    return argv


@budget(300)
@given(data=st.data())
def test_every_command(places: dict[str, str], data: Any) -> None:
    argv = data.draw(command(places))
    with case(f"cli {argv[0]}"):
        res = CliRunner().invoke(cli, argv)
    code = res.exit_code
    assert code in (0, 1, 2), (argv, code, res.output, res.exception)
    assert res.exception is None or isinstance(res.exception, SystemExit), (
        argv,
        repr(res.exception),
    )
    assert "Traceback" not in res.output, (argv, res.output)
    assert "InternalError" not in res.output and "this is a bug" not in res.output, (
        argv,
        res.output,
    )
    if "--json" in argv:  # stdout is one JSON document: the answer, or the error object
        doc = json.loads(res.stdout)
        if isinstance(doc, dict) and set(doc) == {"error"}:
            assert doc["error"]["exit_code"] == code, (argv, res.stdout)


def test_zz_cases_counted() -> None:
    """How many hostile cases ran (written to $MXDB_FUZZ_REPORT when set)."""
    total = sum(TRIED.values())
    report = os.environ.get("MXDB_FUZZ_REPORT")
    if report:
        Path(report).write_text(json.dumps({"cases": total, "by_kind": dict(TRIED)}, indent=1))
    if total:
        assert total >= 1000 * min(SCALE, 1) * 0.9
