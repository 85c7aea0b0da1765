"""CLI commands of the learned performance model: train one from sweeps, ask one at a key."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from mxdb.cli.app import cli, emit_json, handle_errors, json_option, shape_options
from mxdb.errors import MxdbError
from mxdb.models import ROUTING_CLASSES
from mxdb.shapes import MoEShape

if TYPE_CHECKING:
    from mxdb.costmodel.model import PerfModel

#: the module that writes model bundles (imported when ``mxdb model train`` runs)


@cli.group("model")
def model_group() -> None:
    """The learned performance model: train it from sweeps, ask it at a key.

    A model answers shape families the store has not measured here:
    mxdb dispatch --perf-model MODEL.json (or $MXDB_MODEL, also read by
    mxdb.configure) gives its choice as level predicted where its gate admits it.
    """


@model_group.command("train")
@click.argument(
    "sweeps", nargs=-1, required=True, type=click.Path(path_type=Path), metavar="SWEEP_BUNDLE..."
)
@click.option(
    "--out",
    required=True,
    type=click.Path(path_type=Path),
    metavar="BUNDLE",
    help="The model bundle folder to write, in the folder of the sweep bundles (its "
    "model.json is what --perf-model takes).",
)
@click.option(
    "--exclude",
    multiple=True,
    metavar="FAMILY",
    help="Leave this family's sweep keys out of training (repeatable; a preset name as the "
    "sweeps record it, e.g. mixtral-8x7b), e.g. to check the model on a family it never saw.",
)
@click.option(
    "--calibrate-on",
    type=click.Path(path_type=Path),
    default=None,
    metavar="CHECK_BUNDLE",
    help="Fit the confidence on this held-out check bundle (benchmarks/perf_check.py publish) "
    "of a model trained on the same sweeps, in the same folder, instead of on the sweep.",
)
@json_option
@handle_errors
def train_cmd(
    sweeps: tuple[Path, ...],
    out: Path,
    exclude: tuple[str, ...],
    calibrate_on: Path | None,
    as_json: bool,
) -> None:
    """Train the performance model from sweep bundles and write a model bundle.

    SWEEP_BUNDLE... are bundles of perf sweeps (benchmarks/perf_sweep.py publish)
    of one host, at least 3 families; --out lies in their folder.  Every model
    class is scored by leave-one-family-out validation; the best is trained on
    every family and written with its calibration and gate (the calibration
    fitted on the sweep, or with --calibrate-on on the timed choices of a
    held-out check of the same leave-one-family-out models).  Prints the bundle
    and the chosen class's figures.  Needs scikit-learn (the model extra).  Exit
    0 on success, 1 on failure, 2 for bad input.
    """
    from mxdb.evidence.perfmodel import write_model_bundle

    bundle = Path(
        write_model_bundle(list(sweeps), out, exclude=list(exclude), calibrate_on=calibrate_on)
    )
    summary = training_summary(bundle)
    if as_json:
        emit_json(summary)
        return
    click.echo(f"bundle:      {summary['bundle']}")
    click.echo(f"model:       {summary['model']}")
    chosen, fig = summary["chosen"], summary["figures"]
    if chosen is not None:
        click.echo(f"class:       {chosen}")
    if fig:
        points = fig.get("points")
        click.echo(
            f"  dispatch geomean over FlagGems' choice: {_x(fig.get('dispatch'))} "
            f"({fig.get('answered')} of {points} held-out keys answered, "
            f"{fig.get('slower')} slower)"
        )
        click.echo(
            f"  ungated choice geomean: {_x(fig.get('chosen'))}; best measured config: "
            f"{_x(fig.get('best'))}"
        )
        if fig.get("calibration_error") is not None:
            click.echo(f"  calibration error: {float(fig['calibration_error']):.3f}")
    if summary["families"]:
        click.echo(f"families:    {', '.join(summary['families'])}")
    if summary["excluded"]:
        click.echo(f"left out:    {', '.join(summary['excluded'])}")
    gate = summary["gate"]
    if gate:
        click.echo(
            f"gate:        confidence >= {gate.get('min_confidence')}, predicted speedup >= "
            f"{gate.get('min_speedup')}"
        )


def training_summary(bundle: Path) -> dict[str, Any]:
    """The bundle, its model file, the chosen class and its leave-one-family-out figures (from
    the bundle's model.json), the families trained on and left out, and the gate."""
    from mxdb.errors import EvidenceError
    from mxdb.fileio import load_json

    model_file = bundle if bundle.is_file() else bundle / "model.json"
    doc = load_json(model_file, what="performance model", error=EvidenceError)
    if not isinstance(doc, Mapping):
        raise EvidenceError(f"performance model {str(model_file)!r} is not a JSON object")
    record = _training_record(doc)
    chosen = record.get("chosen")
    classes = record.get("classes")
    figures = classes.get(chosen) if isinstance(classes, Mapping) else None
    families = doc.get("families") or record.get("families") or doc.get("shape_families") or []
    gate = doc.get("gate") or record.get("gate") or {}
    return {
        "bundle": str(bundle),
        "model": str(model_file),
        "chosen": chosen,
        "figures": dict(figures) if isinstance(figures, Mapping) else None,
        "families": [str(f) for f in families],
        "excluded": [str(f) for f in doc.get("excluded") or []],
        "gate": dict(gate) if isinstance(gate, Mapping) else {},
    }


def _training_record(doc: Mapping[str, Any]) -> Mapping[str, Any]:
    """The part of a model document that holds the class choice (``chosen``, ``classes``): the
    document itself or one of its objects."""
    if "chosen" in doc:
        return doc
    for value in doc.values():
        if isinstance(value, Mapping) and "chosen" in value and "classes" in value:
            return value
    return {}


def _x(value: Any) -> str:
    return f"{float(value):.3f}x" if isinstance(value, (int, float)) else "n/a"


@model_group.command("predict")
@click.argument("model", type=click.Path(path_type=Path), metavar="MODEL.json")
@shape_options(dtypes=("bf16",))
@click.option(
    "--routing-class",
    type=click.Choice(list(ROUTING_CLASSES)),
    default="uniform",
    show_default=True,
    help="Routing class of the call.",
)
@json_option
@handle_errors
def predict_cmd(model: Path, shape: MoEShape, routing_class: str, as_json: bool) -> None:
    """Print the performance model's choice at one key, without any store.

    MODEL.json is the model.json of a bundle of 'mxdb model train' (or the bundle
    folder).  Prints the config the model chooses among its menu, its predicted
    speedup over FlagGems' own choice (the lower quartile over the forest's trees),
    the trees' agreement, the calibrated confidence and whether the gate answers
    (what mxdb dispatch --perf-model gives where the store has not measured the
    family).  Exit 0 for any choice, 1 when the model fails, 2 for bad input.
    """
    from mxdb.dispatcher import load_model

    result = predict(load_model(model), shape, routing_class)
    if as_json:
        emit_json(result)
        return
    s = result["shape"]
    click.echo(f"shape:       {s['family']} M={s['tokens']} {s['dtype']}")
    click.echo(f"routing:     {routing_class}")
    if result["config"] is None:
        click.echo("config:      none (nothing predicted faster than FlagGems' own choice)")
    else:
        click.echo(f"config:      {result['config_short']}  [{result['config_hash']}]")
    click.echo(f"predicted:   {result['predicted_speedup']:.3f}x over FlagGems' own choice")
    click.echo(f"agreement:   {result['agreement']:.3f} of the trees")
    conf = result["confidence"]
    click.echo(f"confidence:  {'n/a' if conf is None else f'{conf:.3f}'}")
    gate = result["gate"]
    click.echo(
        f"gate:        {'answers' if result['answers'] else 'refuses (fallback)'} "
        f"(confidence >= {gate['min_confidence']}, predicted >= {gate['min_speedup']})"
    )
    if result["trained_on_family"]:
        click.echo("family:      one the model's sweeps measured")


def predict(model: PerfModel, shape: MoEShape, routing_class: str) -> dict[str, Any]:
    """The model's choice at the key as a JSON-ready dict (see ``mxdb model predict``)."""
    from mxdb.ops import config_to_json

    try:
        choice = model.choice(shape, routing_class)
        answers = bool(model.gate.admits(choice))
    except MxdbError:
        raise
    except Exception as exc:
        raise MxdbError(
            f"performance model {model.path} failed at {shape.family} M={shape.tokens} "
            f"{routing_class}: {type(exc).__name__}: {exc}"
        ) from None
    cfg = choice.config
    return {
        "model": model.path,
        "fingerprint_hash": model.fingerprint_hash,
        "shape": {**shape.to_dict(), "family": shape.family},
        "routing_class": routing_class,
        "trained_on_family": shape.family in model.families,
        "config": config_to_json(cfg) if cfg is not None else None,
        "config_short": cfg.short() if cfg is not None else None,
        "config_hash": cfg.hash if cfg is not None else None,
        "triton_config": (
            {"gemm1": cfg.gemm1.to_triton(), "gemm2": cfg.gemm2.to_triton()}
            if cfg is not None
            else None
        ),
        "predicted_speedup": choice.predicted,
        "agreement": choice.agreement,
        "confidence": choice.confidence,
        "gate": {
            "min_confidence": model.gate.min_confidence,
            "min_speedup": model.gate.min_speedup,
        },
        "answers": answers,
    }
