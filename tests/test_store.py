"""Store round-trips on real databases (SQLite file, and PostgreSQL when configured)."""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest

from mxdb.errors import InvalidInputError, NotFoundError, StoreError
from mxdb.models import Entry, Fingerprint, Measurement
from mxdb.store import DispatchRow, Store, default_url

FAMILY = "E8-H4096-I14336-k2"


def entry(tokens: int = 16, **kw: Any) -> Entry:
    data: dict[str, Any] = {
        "dtype": "bf16",
        "family": FAMILY,
        "dims": {"experts": 8, "hidden": 4096, "intermediate": 14336, "topk": 2, "tokens": tokens},
        "tokens": tokens,
        "config": {"gemm1": {"block_m": 64, "block_n": 128}, "align_block": 64},
        "config_hash": f"cfg{tokens}",
        "fingerprint_hash": "fp0123456789abcd",
        "status": "verified",
        "source": "tune",
        "speedup": 1.25,
        "noise_band": 0.02,
        "median_us": 40.5,
        "baseline_us": 50.625,
    }
    data.update(kw)
    return Entry(**data)


def measurement(run_id: str, tokens: int = 16, **kw: Any) -> Measurement:
    data: dict[str, Any] = {
        "run_id": run_id,
        "dtype": "bf16",
        "family": FAMILY,
        "dims": {"tokens": tokens},
        "tokens": tokens,
        "routing_class": "skewed",
        "config": {"block_m": 32},
        "config_hash": "c1",
        "status": "ok",
        "samples_us": [10.5, 11.0, 10.75],
        "median_us": 10.75,
        "seed": 2**40,
    }
    data.update(kw)
    return Measurement(**data)


def test_open_reports_url_and_dialect(store: Store, db_url: str) -> None:
    assert store.dialect in ("sqlite", "postgresql")
    assert store.url.split(":")[0] in ("sqlite", "postgresql+psycopg")
    assert store.generation() == 0


def test_password_is_masked(tmp_path: Path) -> None:
    # A SQLite URL has no password; check the masking through the URL renderer we use.
    with Store.open(f"sqlite:///{tmp_path / 'x.sqlite'}") as store:
        assert "***" not in store.url
    from mxdb.store.engine import normalize_url

    url = normalize_url("postgresql://alice:s3cret@db.example/mxdb")
    assert url.drivername == "postgresql+psycopg"
    assert "s3cret" not in url.render_as_string(hide_password=True)


def test_entries_round_trip(store: Store) -> None:
    e = entry(evidence="evidence/run1", device_name="NVIDIA H200", routing_class="hot")
    [eid] = store.add_entries([e])
    got = store.get_entry(eid)
    assert got.id == eid
    assert got.model_dump(exclude={"id", "created_at"}) == e.model_dump(
        exclude={"id", "created_at"}
    )
    assert got.created_at.tzinfo is not None
    assert got.created_at.utcoffset() == timedelta(0)
    assert abs(got.created_at - e.created_at) < timedelta(milliseconds=1)
    assert store.entries() == [got]


def test_add_entries_is_idempotent_on_natural_key(store: Store) -> None:
    a, b = entry(8), entry(16, fingerprint_hash=None)
    ids = store.add_entries([a, b])
    assert len(set(ids)) == 2
    # The same natural keys again (NULL fingerprint included), plus one new one.
    again = store.add_entries([b.model_copy(update={"speedup": 9.0}), a, entry(32)])
    assert again[:2] == [ids[1], ids[0]]
    assert len(store.entries()) == 3
    # Within one batch, too.
    c = entry(64)
    ids2 = store.add_entries([c, c])
    assert ids2[0] == ids2[1]
    assert len(store.entries()) == 4
    # Another source or routing class is another entry.
    store.add_entries([entry(8, source="vllm"), entry(8, routing_class="skewed")])
    assert len(store.entries()) == 6


def test_entry_filters(store: Store) -> None:
    store.add_entries(
        [
            entry(1),
            entry(2, dtype="fp16"),
            entry(3, family="E64-H2048-I1408-k6"),
            entry(4, status="imported", source="vllm", fingerprint_hash=None),
            entry(5, status="stale"),
        ]
    )
    assert [e.tokens for e in store.entries(dtype="fp16")] == [2]
    assert [e.tokens for e in store.entries(family="E64-H2048-I1408-k6")] == [3]
    assert [e.tokens for e in store.entries(status="imported")] == [4]
    assert [e.tokens for e in store.entries(status=["stale", "imported"])] == [4, 5]
    assert [e.tokens for e in store.entries(source="vllm")] == [4]
    assert [e.tokens for e in store.entries(fingerprint_hash="fp0123456789abcd")] == [1, 2, 3, 5]
    assert [e.tokens for e in store.entries(op="fused_moe", dtype="bf16", family=FAMILY)] == [
        1,
        4,
        5,
    ]
    assert store.entries(op="other_op") == []


def test_get_entry_missing(store: Store) -> None:
    with pytest.raises(NotFoundError, match="entry 12345"):
        store.get_entry(12345)


def test_generation_bumps_with_entry_writes(store: Store) -> None:
    g0 = store.generation()
    ids = store.add_entries([entry(1), entry(2)])
    g1 = store.generation()
    assert g1 > g0
    store.add_points("job", [("k", {})])
    store.add_measurements([measurement("r1")])
    store.set_meta("note", "x")
    assert store.generation() == g1  # no entry written
    assert store.set_status(ids, "stale", reason="driver changed") == 2
    g2 = store.generation()
    assert g2 > g1
    assert store.add_entries([]) == []
    assert store.set_status([], "stale") == 0
    assert store.generation() == g2


def test_set_status(store: Store) -> None:
    ids = store.add_entries([entry(1), entry(2), entry(3)])
    assert store.set_status(ids[:2], "stale", reason="torch 2.5 -> 2.6") == 2
    stale = store.entries(status="stale")
    assert [e.id for e in stale] == ids[:2]
    assert all(e.stale_reason == "torch 2.5 -> 2.6" for e in stale)
    assert store.get_entry(ids[2]).status == "verified"
    assert store.set_status([ids[0]], "verified") == 1
    assert store.get_entry(ids[0]).stale_reason is None
    assert store.set_status([999999], "stale") == 0
    with pytest.raises(InvalidInputError, match="not valid"):
        store.set_status(ids, "bogus")


def test_family_rows(store: Store) -> None:
    ids = store.add_entries(
        [entry(64, routing_class="skewed"), entry(16), entry(8, dtype="fp16"), entry(32)]
    )
    rows = sorted(store.family_rows("fused_moe", "bf16", FAMILY), key=lambda r: r.tokens)
    assert [r.tokens for r in rows] == [16, 32, 64]
    assert all(isinstance(r, DispatchRow) for r in rows)
    first = rows[0]
    assert first.id == ids[1]
    assert first.routing_class == "uniform"
    assert store.entry_config(first.id) == '{"align_block":64,"gemm1":{"block_m":64,"block_n":128}}'
    with pytest.raises(NotFoundError, match="no entry with id 999999"):
        store.entry_config(999999)
    assert first.config_hash == "cfg16"
    assert first.fingerprint_hash == "fp0123456789abcd"
    assert first.status == "verified"
    assert first.speedup == pytest.approx(1.25)
    assert store.family_rows("fused_moe", "bf16", "E1-H1-I1-k1") == []
    store.set_status([ids[1]], "stale")
    by_id = {r.id: r for r in store.family_rows("fused_moe", "bf16", FAMILY)}
    assert by_id[ids[1]].status == "stale"


def test_measurements_round_trip_and_filters(store: Store) -> None:
    ms = [
        measurement("r1", 16),
        measurement("r2", 32, status="compile_error", error="out of shared memory", median_us=None),
        measurement("r3", 16, role="baseline", fidelity="proxy"),
    ]
    ids = store.add_measurements(ms)
    assert len(set(ids)) == 3
    got = store.measurements()
    assert [m.id for m in got] == ids
    assert got[0].model_dump(exclude={"id", "created_at"}) == ms[0].model_dump(
        exclude={"id", "created_at"}
    )
    assert got[0].created_at.tzinfo is not None
    assert [m.run_id for m in store.measurements(tokens=16)] == ["r1", "r3"]
    assert [m.run_id for m in store.measurements(status="compile_error")] == ["r2"]
    assert store.measurements(run_id="r2")[0].error == "out of shared memory"
    assert store.measurements(family="nope") == []
    # run_id is unique: re-adding returns the stored id and writes nothing.
    assert store.add_measurements([measurement("r2", 99), measurement("r4")])[0] == ids[1]
    assert len(store.measurements()) == 4
    assert store.measurements(run_id="r2")[0].tokens == 32


def test_fingerprints(store: Store) -> None:
    fp = Fingerprint(vendor="nvidia", device_name="NVIDIA H200", sm_count=132, torch="2.6.0")
    other = Fingerprint(vendor="metax", device_name="C500")
    assert store.put_fingerprint(fp) == fp.hash
    assert store.put_fingerprint(fp) == fp.hash  # idempotent
    store.put_fingerprint(other)
    assert store.get_fingerprint(fp.hash) == fp
    assert store.get_fingerprint("0" * 16) is None
    assert store.fingerprints() == {fp.hash: fp, other.hash: other}


def test_meta(store: Store) -> None:
    assert store.get_meta("policy") is None
    store.set_meta("policy", "strict")
    store.set_meta("policy", "lenient")
    assert store.get_meta("policy") == "lenient"
    assert store.get_meta("generation") == "0"
    with pytest.raises(InvalidInputError):
        store.set_meta("generation", "7")


def test_reopen_keeps_data(db_url: str) -> None:
    with Store.open(db_url) as store:
        store.add_entries([entry(1)])
        store.set_meta("k", "v")
    with Store.open(db_url) as store:
        assert [e.tokens for e in store.entries()] == [1]
        assert store.get_meta("k") == "v"
        assert store.generation() == 1


def test_datetimes_are_utc(store: Store) -> None:
    local = datetime(2024, 5, 1, 12, 0, tzinfo=timezone(timedelta(hours=8)))
    [eid] = store.add_entries([entry(1, created_at=local)])
    got = store.get_entry(eid).created_at
    assert got == local
    assert got.tzinfo is not None and got.utcoffset() == timedelta(0)
    assert got.hour == 4


def test_default_url_and_plain_paths(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MXDB_DB", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    url = default_url()
    assert url.startswith("sqlite:///") and url.endswith("mxdb.sqlite")
    assert str(tmp_path / "cache") in url
    with Store.open() as store:  # parent directories are created
        assert store.generation() == 0
    assert (tmp_path / "cache" / "mxdb" / "mxdb.sqlite").is_file()

    target = tmp_path / "deep" / "er" / "db.sqlite"
    monkeypatch.setenv("MXDB_DB", str(target))  # a plain path is a SQLite file
    assert default_url() == str(target)
    with Store.open() as store:
        store.add_entries([entry(1)])
    assert target.is_file()


def test_unusable_urls(tmp_path: Path) -> None:
    with pytest.raises(StoreError, match="directory"):
        Store.open(f"sqlite:///{tmp_path}")
    with pytest.raises(StoreError, match=r"not installed|cannot use"):
        Store.open("mysql+nosuchdriver://u@h/db")
    with pytest.raises(StoreError, match="cannot open"):
        Store.open("postgresql+psycopg://nobody@127.0.0.1:1/none?connect_timeout=2")


def test_count_entries_by_status(store: Store) -> None:
    ids = store.add_entries([entry(16), entry(32), entry(64, routing_class="skewed")])
    store.set_status([ids[0]], "stale")
    assert store.count_entries() == {"verified": 2, "stale": 1}
    assert store.count_entries(status="verified") == {"verified": 2}
    assert store.count_entries(op="no_such_op") == {}


def test_job_round_trips_and_stays_out_of_the_export(store: Store) -> None:
    """The job column: written, read, filtered on; a later point deciding the same key and
    config leaves the row's job; the store export (mxdb.store-export 1.3) does not carry it."""
    from mxdb.interop.export import StoreExport, build_export

    def entry(tokens: int = 16, **kw: Any) -> Entry:  # no fingerprint: the export needs none
        return globals()["entry"](tokens, fingerprint_hash=None, **kw)

    [eid] = store.add_entries([entry(job="job-a")])
    store.add_entries([entry(tokens=32)])
    store.add_measurements([measurement("r1", job="job-a"), measurement("r2")])
    assert store.get_entry(eid).job == "job-a"
    assert [e.id for e in store.entries(job="job-a")] == [eid]
    assert {m.run_id: m.job for m in store.measurements()} == {"r1": "job-a", "r2": None}
    assert [m.run_id for m in store.measurements(job="job-a")] == ["r1"]
    assert store.entries(job="job-b") == [] and store.measurements(job="job-b") == []
    # a stored row keeps its job: another point deciding the same key and config writes none
    assert store.add_entries([entry(job="job-b")]) == [eid]
    assert store.get_entry(eid).job == "job-a"
    store.add_points("job-b", [("k", {})])
    claim = store.claim_point("job-b", "w")
    assert claim is not None
    assert store.complete_point(claim, entries=[entry(job="job-b", speedup=1.5)])
    assert store.get_entry(eid).job == "job-a"
    # the export holds no job, and a document read back names none
    doc = build_export(store)
    assert {e.job for e in doc.entries} == {"job-a", None}
    data = json.loads(doc.to_json())
    assert data["schema_version"] == "1.3" and all("job" not in e for e in data["entries"])
    assert [e.job for e in StoreExport.model_validate(data).entries] == [None, None]
