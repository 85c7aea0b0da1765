"""``mxdb dispatch --perf-model`` and ``mxdb model train|predict`` through the real CLI."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from mxdb.cli.app import cli
from mxdb.costmodel.model import PerfModel
from mxdb.fingerprint import fingerprint_document
from mxdb.store import Store
from tests.test_dispatch_predicted import NEW, model_doc, sweep_keys, write_model
from tests.test_dispatcher import H200, entry

#: gpt-oss-20b at M=4: a family the store below never measured
NEW_ARGS = ["-E", "32", "-H", "2880", "-I", "2880", "-k", "4", "-M", "4"]
MIXTRAL_ARGS = ["-E", "8", "-H", "4096", "-I", "14336", "-k", "2", "-M", "4"]


def run(*args: str, env: dict[str, str] | None = None) -> Result:
    return CliRunner().invoke(cli, list(args), env=env)


@pytest.fixture()
def setup(tmp_path: Path) -> dict[str, str]:
    """A store that measured Mixtral-8x7B on the H200 only, that host's fingerprint file and a
    performance model trained there."""
    url = f"sqlite:///{tmp_path / 'mxdb.sqlite'}"
    with Store.open(url) as store:
        store.put_fingerprint(H200)
        store.add_entries([entry()])
    fp = tmp_path / "fingerprint.json"
    fp.write_text(json.dumps(fingerprint_document(H200)))
    model = write_model(tmp_path / "model")
    return {"db": url, "fp": str(fp), "model": str(model)}


def dispatch(setup: dict[str, str], shape: list[str], *extra: str, **kw: Any) -> Result:
    return run("dispatch", *shape, "--db", setup["db"], "--fingerprint", setup["fp"], *extra, **kw)


# -- mxdb dispatch --perf-model -------------------------------------------------------------


def test_dispatch_answers_an_unmeasured_family_from_the_model(setup: dict[str, str]) -> None:
    res = dispatch(setup, NEW_ARGS, "--perf-model", setup["model"], "--json")
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    expected = PerfModel.load(setup["model"]).answer(NEW, "uniform")
    assert expected is not None and expected.config is not None
    assert (doc["level"], doc["reason"], doc["entry_id"]) == ("predicted", "predicted", None)
    assert doc["config_hash"] == expected.config.hash
    assert doc["perf_model"] == setup["model"] and doc["perf_model_fingerprint_hash"] == H200.hash
    text = dispatch(setup, NEW_ARGS, "--perf-model", setup["model"])
    assert text.exit_code == 0, text.output
    assert "predicted (confidence" in text.stdout and "performance model" in text.stdout


def test_dispatch_keeps_the_stores_answer_where_it_measured(setup: dict[str, str]) -> None:
    res = dispatch(setup, MIXTRAL_ARGS, "--perf-model", setup["model"], "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["reason"] == "exact_match"
    far = dispatch(setup, [*MIXTRAL_ARGS[:-1], "4096"], "--perf-model", setup["model"], "--json")
    assert json.loads(far.stdout)["reason"] == "tokens_out_of_range"


def test_dispatch_without_a_model_falls_back_and_mxdb_model_sets_one(
    setup: dict[str, str],
) -> None:
    res = dispatch(setup, NEW_ARGS, "--json", env={"MXDB_MODEL": ""})
    assert json.loads(res.stdout)["reason"] == "no_entry"
    res = dispatch(setup, NEW_ARGS, "--json", env={"MXDB_MODEL": setup["model"]})
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["level"] == "predicted"


def test_dispatch_with_a_bad_model_path_exits_2_naming_it(
    setup: dict[str, str], tmp_path: Path
) -> None:
    missing = str(tmp_path / "no-such-model.json")
    res = dispatch(setup, NEW_ARGS, "--perf-model", missing)
    assert res.exit_code == 2
    assert missing in res.stderr and "does not exist" in res.stderr
    res = dispatch(setup, NEW_ARGS, "--perf-model", setup["db"].removeprefix("sqlite:///"),
                   "--json")  # fmt: skip
    assert res.exit_code == 2
    err = json.loads(res.stdout)["error"]
    assert err["exit_code"] == 2 and "performance model" in err["message"]


# -- mxdb model predict --------------------------------------------------------------------


def test_model_predict_prints_the_choice_without_a_store(setup: dict[str, str]) -> None:
    res = run("model", "predict", setup["model"], *NEW_ARGS, "--routing-class", "hot", "--json")
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    ch = PerfModel.load(setup["model"]).choice(NEW, "hot")
    assert ch.config is not None
    assert doc["config_hash"] == ch.config.hash and doc["answers"] is True
    assert doc["predicted_speedup"] == pytest.approx(ch.predicted)
    assert doc["agreement"] == pytest.approx(ch.agreement)
    assert doc["confidence"] == pytest.approx(ch.confidence)
    assert doc["routing_class"] == "hot" and doc["trained_on_family"] is False
    assert doc["shape"]["family"] == NEW.family
    text = run("model", "predict", setup["model"], *NEW_ARGS)
    assert text.exit_code == 0, text.output
    for word in ("config:", "predicted:", "agreement:", "confidence:", "gate:        answers"):
        assert word in text.stdout


def test_model_predict_shows_a_refusing_gate(tmp_path: Path) -> None:
    path = write_model(tmp_path / "m", gate={"min_confidence": 1.01, "min_speedup": 1.03})
    res = run("model", "predict", str(path), *NEW_ARGS, "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["answers"] is False
    text = run("model", "predict", str(path), *NEW_ARGS)
    assert "refuses (fallback)" in text.stdout


def test_model_predict_errors(tmp_path: Path) -> None:
    missing = str(tmp_path / "missing.json")
    res = run("model", "predict", missing, *NEW_ARGS)
    assert res.exit_code == 2 and missing in res.stderr
    res = run("model", "predict", missing, "-E", "32")
    assert res.exit_code == 2  # a missing shape option
    doc = model_doc()
    doc["model"] = {**doc["model"], "trees": [
        {"left": [1, -1, -1], "right": [2, -1, -1], "feature": [10_000, 0, 0],
         "threshold": [0.0, 0.0, 0.0], "value": [0.0, 0.1, 0.2]}
    ]}  # fmt: skip
    broken = write_model(tmp_path / "broken", doc=doc)
    res = run("model", "predict", str(broken), *NEW_ARGS, "--json")
    assert res.exit_code == 2  # refused when loaded: a split reads a feature rows do not have
    err = json.loads(res.stdout)["error"]
    assert str(broken) in err["message"] and "reads a feature outside 0..40" in err["message"]


# -- mxdb model train ----------------------------------------------------------------------


def test_model_train_writes_a_bundle_dispatch_can_use(tmp_path: Path) -> None:
    from tests.benchmark_scripts import load

    raw = tmp_path / "raw.json"
    raw.write_text(json.dumps({"fingerprint": H200.components(), "keys": sweep_keys(),
                               "errors": []}))  # fmt: skip
    sweep = load("perf_sweep.py").publish([raw], tmp_path / "sweep")
    res = run("model", "train", str(sweep), "--out", str(tmp_path / "model"), "--json")
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert Path(doc["model"]).is_file() and doc["bundle"]
    text = run("model", "train", str(sweep), "--out", str(tmp_path / "model2"))
    assert text.exit_code == 0, text.output
    assert "bundle:" in text.stdout and "model:" in text.stdout
    assert doc["chosen"] in ("forest", "extra_trees") and doc["figures"]["points"] > 0
    assert "class:" in text.stdout and "dispatch geomean" in text.stdout
    res = run("model", "predict", doc["model"], *NEW_ARGS, "--json")
    assert res.exit_code == 0, res.output
    # the bundle folder works too, and its fingerprint.json is the one the sweeps recorded
    url = f"sqlite:///{tmp_path / 'mxdb.sqlite'}"
    Store.open(url).close()
    fp = tmp_path / "fp.json"
    fp.write_text(json.dumps(fingerprint_document(H200)))
    res = run("dispatch", *NEW_ARGS, "--db", url, "--fingerprint", str(fp), "--perf-model",
              doc["bundle"], "--json")  # fmt: skip
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["level"] == "predicted"
