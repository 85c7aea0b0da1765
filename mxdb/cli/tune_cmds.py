"""``mxdb tune``: search, measure and verify kernel configs for a workload on this host's GPUs."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import click

from mxdb.cli.app import cli, db_option, emit_json, handle_errors, json_option, model_options
from mxdb.errors import GpuUnavailableError, UsageError


def _devices(value: str | None) -> list[int] | None:
    if value is None or not value.strip():
        return None
    try:
        devs = [int(x) for x in value.split(",") if x.strip()]
    except ValueError:
        raise UsageError(
            f"--devices takes comma-separated GPU indices such as 0,1; got {value!r}"
        ) from None
    if not devs or any(d < 0 for d in devs):
        raise UsageError(f"--devices takes non-negative GPU indices such as 0,1; got {value!r}")
    return devs


def _require_gpu_packages() -> None:
    """Fail early, with what to install, when the GPU backend's packages are missing."""
    import importlib.util

    missing = []
    for name in ("torch", "triton", "flag_gems"):
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            missing.append(name)
    if missing:
        raise GpuUnavailableError(
            f"mxdb tune measures on the GPU with torch, triton and flag_gems, and "
            f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not installed here: "
            "install the GPU extra (pip install 'mxdb[gpu]'), or use --backend fake for a dry "
            "run on an analytic CPU model"
        )


@cli.command("tune")
@click.argument("workload", type=click.Path(dir_okay=False))
@db_option
@click.option(
    "--out",
    "out_dir",
    default="evidence",
    show_default=True,
    metavar="DIR",
    help="Folder for the evidence bundle (a new <workload>-<time> folder inside it).",
)
@click.option(
    "--budget",
    type=float,
    default=None,
    metavar="MINUTES",
    help="Wall-clock budget; points not started when it runs out stay pending for the next run.",
)
@click.option(
    "--devices",
    default=None,
    metavar="0,1",
    help="GPU indices: one worker process per GPU (default: one worker on the current GPU).",
)
@click.option(
    "--backend",
    type=click.Choice(["gpu", "fake"]),
    default="gpu",
    show_default=True,
    help="gpu: measure on the GPU. fake: a dry run on an analytic CPU model (for demos and "
    "tests; its results are not real measurements).",
)
@click.option("--no-progress", is_flag=True, help="Do not draw the progress bar on stderr.")
@click.option(
    "--reconcile",
    is_flag=True,
    help="Do not tune: decide once, over all their traces, the keys this workload's finished "
    "tune measured on several traces (routing sources of one class) and decided differently; "
    "their earlier rows become rejected (see mxdb.tune.reconcile).",
)
@model_options(
    "A Hugging Face config.json (or its folder): tune this model's per-shard MoE shape "
    "instead of the workload's models (token counts, routings and search from the workload)."
)
@click.option(
    "--perf-model",
    "perf_model_path",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    metavar="MODEL.json",
    help="A performance model (the model.json of a mxdb.perf-model bundle): each point's "
    "first rung holds the model's best search.model_keep uniform configs at the point's key "
    "instead of a random draw (FlagGems' choice and the peer seeds enter too); ranked on "
    "the CPU, no GPU time.",
)
@json_option
@handle_errors
def tune_cmd(
    workload: str,
    db: str | None,
    out_dir: str,
    budget: float | None,
    devices: str | None,
    backend: str,
    no_progress: bool,
    reconcile: bool,
    model_config: Path | None,
    tp: int,
    ep: int,
    perf_model_path: Path | None,
    as_json: bool,
) -> None:
    """Tune the fused-MoE configs of WORKLOAD (a YAML or JSON file; see examples/workloads/).

    Every point (model shape, token count, dtype, routing) is searched with the
    multi-fidelity ladder (resource proxy, compile, synthetic-routing halving, replayed
    routing, layer check); every candidate is recorded, failures too.  Winners that are
    correct and faster than FlagGems' own choice beyond the measured noise band are stored
    as verified entries under this host's fingerprint.  Interrupted runs resume: run the
    same command again.
    """
    from mxdb.tune.runner import gpu_backend_factory, tune
    from mxdb.tune.workload import load_workload

    wl = load_workload(workload)
    if model_config is not None:
        from mxdb.modelconfig import load as load_model
        from mxdb.tune.workload import ModelSpec

        moe = load_model(model_config, tp=tp, ep=ep)
        e, h, n, k = moe.dims()
        label = f"{moe.architecture}-tp{tp}-ep{ep}"
        spec = ModelSpec(name=label, experts=e, hidden=h, intermediate=n, topk=min(k, e))
        wl = wl.model_copy(update={"models": [spec]})
        if not as_json:
            click.echo(moe.describe(), err=True)
    elif tp != 1 or ep != 1:
        raise UsageError("--tp and --ep shard a model given with --model")
    perf_model = None
    if perf_model_path is not None:
        if reconcile:
            raise UsageError("--reconcile searches nothing: drop --perf-model")
        from mxdb.costmodel.model import PerfModel

        perf_model = PerfModel.load(perf_model_path)
    devs = _devices(devices)
    if backend == "gpu":
        _require_gpu_packages()
    if backend == "fake":
        from mxdb.tune.fake import FakeBackend

        factory = functools.partial(FakeBackend, seed=wl.seed)
    else:
        factory = gpu_backend_factory  # type: ignore[assignment]
    if reconcile:
        if devs or budget is not None:
            raise UsageError(
                "--reconcile measures its keys in this process, to the end: drop --devices "
                "and --budget"
            )
        _reconcile(wl, db, out_dir, factory, as_json)
        return
    report = tune(
        wl,
        store_url=db,
        out_dir=out_dir,
        budget_minutes=budget,
        devices=devs,
        backend_factory=factory,
        progress=not no_progress,
        perf_model=perf_model,
    )
    if as_json:
        emit_json(report.to_dict())
        return
    click.echo(
        f"{report.workload}: {report.points_done}/{report.points_total} points done "
        f"({report.points_measured} measured now), {len(report.verified)} verified, "
        f"{report.parity_keys} at parity with a peer row, {report.baseline_keys} baseline, "
        f"{report.seconds:.1f} s"
    )
    for v in report.verified:
        click.echo(
            f"  {v['family']} {v['dtype']} M={v['tokens']} {v['routing_class']}: "
            f"{v['speedup']:.3f}x (noise {v['noise_band']:.4f})"
        )
    if report.bundle:
        click.echo(f"evidence: {report.bundle}")
    for rec in report.noisy:
        click.echo(
            f"noisy: {rec['family']} {rec['dtype']} M={rec['tokens']} {rec['routing_class']} is "
            f"a {rec['status']} record decided under a noise band of {rec['noise_band']:.1%} (FlagGems' "
            "same-config copies that far apart): the measurement was disturbed; measure the key "
            "again with a workload of it alone and merge its export (mxdb export --format mxdb "
            "--merge)",
            err=True,
        )
    if report.points_done < report.points_total:
        click.echo("budget ran out: run the same command again to finish", err=True)


def _reconcile(wl: Any, db: str | None, out_dir: str, factory: Any, as_json: bool) -> None:
    from mxdb.store import Store
    from mxdb.tune.reconcile import reconcile
    from mxdb.tune.runner import _raw_url, job_name

    backend = factory()
    try:
        job = job_name(wl, backend.fingerprint())
        with Store.open(db) as store:
            states = store.points(job)
            url = db or _raw_url(store)
        pending = sum(1 for s in states if s.state != "done")
        if not states or pending:
            raise UsageError(
                f"--reconcile decides the keys of a finished tune; job {job} has "
                f"{len(states)} points, {pending} not done: run mxdb tune {wl.name!r} first"
            )
        report = reconcile(wl, backend, url, out_dir)
    finally:
        close = getattr(backend, "close", None)
        if close is not None:
            close()
    if as_json:
        emit_json(report.to_dict())
        return
    click.echo(
        f"{report.job}: {report.keys} key(s) decided over their traces, {report.seconds:.1f} s"
    )
    for d in report.decisions:
        click.echo(
            f"  {d['family']} M={d['tokens']} {d['routing_class']}: {d['status']} "
            f"{d['config_hash']} {d['speedup']:.3f}x (won {d['confidence']:.2f} of its traces)"
            if d["speedup"] is not None and d["confidence"] is not None
            else f"  {d['family']} M={d['tokens']} {d['routing_class']}: {d['status']}"
        )
    if report.bundle:
        click.echo(f"evidence: {report.bundle}")
