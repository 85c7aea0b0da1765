"""Training the performance model from sweeps, with leave-one-family-out validation.

The data are the keys of ``mxdb.perf-sweep`` documents (``benchmarks/perf_sweep.py``): at each
key every timed config has a paired speedup over FlagGems' choice (``mxdb.verdict``, over the
key's randomized rounds); a row is (:func:`mxdb.costmodel.features.features`, log of that
speedup).  For each model class of :data:`CLASSES` and each family, a model trained on the
*other* families chooses, at every key of the held-out family, the menu config with the largest
predicted lower-quartile speedup over the forest's trees (a cautious choice); what that choice
measured in the sweep scores the class: the geomean speedup over FlagGems' choice of the
answers the gate lets through (:class:`Gate`; a fallback counts 1.0), then fewer slower
answers.  The class with the best score is trained again on every family: the shipped model.

The gate (feature set 2 on): for each class, the smallest predicted speedup on
:data:`GATE_STEPS` at which none of the class's gated leave-one-family-out answers measured
slower, raised by :data:`GATE_GUARD` steps, since a sweep times one routing instance per key
while a dispatch meets many (:func:`select_gate`).  Models of feature set 1 keep the fixed
default gate they were trained with.

Confidence: whether a leave-one-family-out choice was faster than FlagGems' choice (the verdict
rule, on the sweep's rounds) against the forest's agreement on it, fitted by Platt scaling
(:mod:`mxdb.costmodel.calibration`).  For family ``f`` the map is fitted on the other families'
outcomes only, so the confidence stated for ``f``'s keys never saw them.  Better: calibrate on
a held-out check of the same leave-one-family-out choices (``check``: :func:`check_calibrations`),
whose protocol is a dispatch's; the sweep's maps then only score the classes and the gate.

Needs scikit-learn (the ``model`` extra); every estimator is deterministic (fixed seeds, one
thread), so the audit trains again and gets the same trees.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from mxdb import verdict
from mxdb.configs import KernelConfig
from mxdb.costmodel import calibration, trees
from mxdb.costmodel.features import CURRENT, features, version_of
from mxdb.costmodel.menu import menu
from mxdb.errors import UsageError
from mxdb.shapes import MoEShape

#: model class -> (scikit-learn estimator, its parameters); both are forests, whose trees'
#: spread gives the confidence signal
CLASSES: dict[str, tuple[str, dict[str, Any]]] = {
    "forest": (
        "sklearn.ensemble.RandomForestRegressor",
        {"n_estimators": 40, "min_samples_leaf": 8, "max_features": 0.5, "random_state": 0,
         "n_jobs": 1},
    ),
    "extra_trees": (
        "sklearn.ensemble.ExtraTreesRegressor",
        {"n_estimators": 40, "min_samples_leaf": 5, "max_features": 0.5, "random_state": 0,
         "n_jobs": 1},
    ),
}  # fmt: skip
#: the quantile of the trees' predictions a choice maximizes
QUANTILE = 0.25
#: the margin of "faster" in the sweep's outcomes (the tuner's default verify margin)
MARGIN = 0.005
#: the predicted speedups a gate may demand (feature set 2 on), smallest first
GATE_STEPS: tuple[float, ...] = (1.03, 1.04, 1.05, 1.06, 1.07, 1.08, 1.09, 1.10)
#: steps above the smallest gate with no slower leave-one-family-out answer
GATE_GUARD = 1


@dataclass(frozen=True)
class Row:
    """One timed config at one sweep key."""

    key: int
    family: str
    config_hash: str
    x: tuple[float, ...]
    y: float


@dataclass(frozen=True)
class KeyData:
    """One sweep key: its shape and class, and every timed config's measured outcome."""

    index: int
    family: str
    shape: MoEShape
    routing_class: str
    source: str
    baseline_hash: str
    #: config hash -> (speedup over FlagGems' choice, verdict outcome)
    outcomes: Mapping[str, tuple[float, str]]


def key_data(
    keys: Sequence[Mapping[str, Any]], version: int = CURRENT
) -> tuple[list[KeyData], list[Row]]:
    """The keys and training rows (feature set ``version``) of sweep documents' keys."""
    out: list[KeyData] = []
    rows: list[Row] = []
    for idx, k in enumerate(keys):
        shape = MoEShape.from_dict(k["shape"])
        arms = k["arms"]
        copies = [a["samples"] for a in arms if a["role"] in ("baseline", "control")]
        round_base = verdict.round_baseline(copies)
        if round_base is None:
            continue
        base_hash = KernelConfig.model_validate(k["baseline"]).hash
        outcomes: dict[str, tuple[float, str]] = {}
        for a in arms:
            if a["role"] != "candidate" or a["status"] != "ok":
                continue
            cfg = KernelConfig.model_validate(a["config"])
            v = verdict.compare(copies, a["samples"], margin=MARGIN)
            p = verdict.paired(round_base, a["samples"])
            if p is None or v.speedup is None:
                continue
            outcomes[cfg.hash] = (p.speedup, v.outcome)
            rows.append(
                Row(idx, k["family"], cfg.hash,
                    tuple(features(shape, k["routing_class"], cfg, version)), math.log(p.speedup))
            )  # fmt: skip
        bcfg = KernelConfig.model_validate(k["baseline"])
        rows.append(Row(idx, k["family"], base_hash,
                        tuple(features(shape, k["routing_class"], bcfg, version)), 0.0))  # fmt: skip
        out.append(
            KeyData(idx, k["family"], shape, k["routing_class"], k["source"], base_hash, outcomes)
        )
    return out, rows


def _estimator(name: str) -> Any:
    import importlib

    path, params = CLASSES[name]
    mod, cls = path.rsplit(".", 1)
    try:
        est_cls = getattr(importlib.import_module(mod), cls)
    except ImportError:
        raise UsageError(
            "training the performance model needs scikit-learn: pip install 'mxdb[model]'"
        ) from None
    return est_cls(**params)


def fit(name: str, rows: Sequence[Row]) -> dict[str, Any]:
    """A model of class ``name`` trained on ``rows``, as plain data (:mod:`trees`)."""
    x = np.asarray([r.x for r in rows], dtype=np.float64)
    y = np.asarray([r.y for r in rows], dtype=np.float64)
    est = _estimator(name)
    est.fit(x, y)
    return trees.from_sklearn(est, "forest", x.shape[1])


@dataclass(frozen=True)
class Gate:
    """When a prediction is answered: its calibrated confidence and its predicted
    lower-quartile speedup must both reach these (else the fallback)."""

    min_confidence: float = 0.6
    min_speedup: float = 1.03

    def admits(self, choice: Choice) -> bool:
        return (
            choice.config is not None
            and choice.confidence is not None
            and choice.confidence >= self.min_confidence
            and choice.predicted >= self.min_speedup
        )


@dataclass(frozen=True)
class Choice:
    """A model's answer at one key: the config, its predicted speedup over FlagGems' choice
    (the lower quartile over the trees), the trees' agreement that it is faster, and the
    calibrated confidence."""

    config: KernelConfig | None
    predicted: float
    agreement: float = 0.0
    confidence: float | None = None


def candidates(shape: MoEShape) -> list[KernelConfig]:
    """What a prediction chooses among: the menu, less what cannot fit an H200 and less
    FlagGems' own choice (the fallback already is that)."""
    from mxdb.profiles import get_profile
    from mxdb.resources import check, flaggems_default_config

    prof = get_profile("h200")
    base = KernelConfig.uniform(flaggems_default_config(shape)).hash
    return [c for c in menu(shape) if c.hash != base and check(c, shape, prof).fits]


def choose(
    model: Mapping[str, Any],
    shape: MoEShape,
    routing_class: str,
    cal: Mapping[str, Any] | None = None,
) -> Choice:
    """The menu config with the largest predicted lower-quartile speedup at the key (None:
    FlagGems' own choice, when nothing is predicted faster than it), with the confidence
    ``cal`` gives it."""
    cands = candidates(shape)
    if not cands:
        return Choice(None, 1.0)
    version = version_of(model.get("n_features"))
    per_tree = trees.members(model, [features(shape, routing_class, c, version) for c in cands])
    low = np.quantile(per_tree, QUANTILE, axis=0)
    agree = (per_tree > math.log1p(MARGIN)).mean(axis=0)
    j = int(np.argmax(low))
    if low[j] <= 0.0:
        return Choice(None, math.exp(float(low[j])))
    a = float(agree[j])
    predicted = math.exp(float(low[j]))
    conf = calibration.confidence(cal, a, predicted) if cal is not None else None
    return Choice(cands[j], predicted, a, conf)


@dataclass(frozen=True)
class Outcome:
    """A leave-one-family-out choice at one sweep key and what it measured there."""

    key: int
    family: str
    config_hash: str | None
    predicted: float
    agreement: float
    measured: float
    outcome: str
    best: float


def lofo(
    name: str, keys: Sequence[KeyData], rows: Sequence[Row]
) -> tuple[dict[str, dict[str, Any]], list[Outcome]]:
    """Leave-one-family-out: a model per family trained without it, and each held-out key's
    choice with what it measured in the sweep."""
    models: dict[str, dict[str, Any]] = {}
    out: list[Outcome] = []
    for fam in sorted({k.family for k in keys}):
        model = fit(name, [r for r in rows if r.family != fam])
        models[fam] = model
        out += [outcome_at(model, k) for k in keys if k.family == fam]
    return models, out


def outcome_at(model: Mapping[str, Any], k: KeyData) -> Outcome:
    """What ``model``'s choice at sweep key ``k`` measured there (a choice the sweep did not
    time, or could not run, counts as no gain and not faster)."""
    ch = choose(model, k.shape, k.routing_class)
    best = max([s for s, _ in k.outcomes.values()], default=1.0)
    if ch.config is None:
        return Outcome(k.index, k.family, None, ch.predicted, 0.0, 1.0, "fallback", best)
    s, o = k.outcomes.get(ch.config.hash, (1.0, "untimed"))
    return Outcome(k.index, k.family, ch.config.hash, ch.predicted, ch.agreement, s, o, best)


def geomean(xs: Iterable[float]) -> float:
    v = list(xs)
    return math.exp(sum(math.log(x) for x in v) / len(v)) if v else 1.0


def calibration_points(outcomes: Iterable[Outcome]) -> list[tuple[float, bool]]:
    """(agreement, faster) of every choice that is not FlagGems' own."""
    return [(o.agreement, o.outcome == "faster") for o in outcomes if o.config_hash]


def nested_calibrations(outcomes: Sequence[Outcome]) -> dict[str, dict[str, Any]]:
    """For each family, the calibration fitted on the other families' outcomes."""
    fams = sorted({o.family for o in outcomes})
    return {f: calibration.fit(calibration_points(o for o in outcomes if o.family != f))
            for f in fams}  # fmt: skip


def score(
    outcomes: Sequence[Outcome], cals: Mapping[str, Mapping[str, Any]], gate: Gate
) -> dict[str, float]:
    """A class's leave-one-family-out figures under ``gate``, each family's confidences from
    the calibration that never saw it: geomean speedup of the answers over FlagGems' choice
    (a fallback counting 1.0), answers, slower answers, the calibration error; and the
    ungated choice's and the best measured config's geomeans."""
    dispatch, pairs, answered, slower = [], [], 0, 0
    for o in outcomes:
        conf = (calibration.confidence(cals[o.family], o.agreement, o.predicted)
                if o.config_hash else None)  # fmt: skip
        ch = Choice(None if o.config_hash is None else menu_config_stub, o.predicted,
                    o.agreement, conf)  # fmt: skip
        if o.config_hash is not None and conf is not None:
            pairs.append((conf, o.outcome == "faster"))
        if gate.admits(ch):
            answered += 1
            slower += o.outcome == "slower"
            dispatch.append(max(o.measured, 1e-9))
        else:
            dispatch.append(1.0)
    return {
        "dispatch": geomean(dispatch),
        "answered": answered,
        "slower": slower,
        "calibration_error": calibration.calibration_error(pairs) or 0.0,
        "chosen": geomean(max(o.measured, 1e-9) for o in outcomes),
        "best": geomean(o.best for o in outcomes),
        "points": len(outcomes),
    }


#: stands for "a config" in :func:`score`, where only whether there is one matters
menu_config_stub = KernelConfig.parse(
    {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 64, "GROUP_SIZE_M": 1,
     "num_warps": 4, "num_stages": 3}
)  # fmt: skip


def select_gate(
    outcomes: Sequence[Outcome], cals: Mapping[str, Mapping[str, Any]]
) -> tuple[Gate, list[dict[str, float]]]:
    """The gate of one class's leave-one-family-out ``outcomes`` (module docstring), and the
    score at every step of :data:`GATE_STEPS` it was chosen from."""
    steps = []
    for s in GATE_STEPS:
        sc = score(outcomes, cals, replace(Gate(), min_speedup=s))
        steps.append({"min_speedup": s, "dispatch": sc["dispatch"],
                      "answered": sc["answered"], "slower": sc["slower"]})  # fmt: skip
    safe = next((j for j, st in enumerate(steps) if st["slower"] == 0), len(GATE_STEPS) - 1)
    top = min(safe + GATE_GUARD, len(GATE_STEPS) - 1)
    return replace(Gate(), min_speedup=GATE_STEPS[top]), steps


@dataclass(frozen=True)
class CheckPoint:
    """A timed leave-one-family-out choice of a held-out check (``mxdb.perf-check``): where it
    was asked, what the plan stated, and whether it measured faster than FlagGems' choice."""

    family: str
    shape: MoEShape
    routing_class: str
    config_hash: str
    predicted: float
    agreement: float
    faster: bool


def check_calibrations(
    models: Mapping[str, Mapping[str, Any]], points: Sequence[CheckPoint], gate: Gate
) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """The confidence map fitted on a check's outcomes (:func:`calibration.fit_gated`, the
    gate's step), on every family's and, per family, on the other families' only.

    The check must have timed *these* leave-one-family-out choices (``models``: each family's
    model trained without it): the choice and predicted speedup the plan stated at each point
    are the ones ``models`` make there, else :class:`UsageError`."""
    if not points:
        raise UsageError("the check holds no timed choice of the model to calibrate on")
    unknown = sorted({p.family for p in points} - set(models))
    if unknown:
        raise UsageError(
            f"the check times families the model was not trained on: {', '.join(unknown)}; "
            f"it was trained on {', '.join(sorted(models))}"
        )
    asked: dict[tuple[str, int, str], Choice] = {}
    wrong: list[str] = []
    for p in points:
        at = (p.family, p.shape.tokens, p.routing_class)
        if at not in asked:
            asked[at] = choose(models[p.family], p.shape, p.routing_class)
        ch = asked[at]
        if (ch.config is None or ch.config.hash != p.config_hash
                or abs(ch.predicted - p.predicted) > 1e-9 * abs(p.predicted)):  # fmt: skip
            wrong.append(
                f"{p.family} M={p.shape.tokens} {p.routing_class}: the check timed "
                f"{p.config_hash} (predicted {p.predicted:.6f}), this training chooses "
                f"{ch.config.hash if ch.config else 'FlagGems own choice'} "
                f"(predicted {ch.predicted:.6f})"
            )
    if wrong:
        raise UsageError(
            f"the check did not time this model's leave-one-family-out choices ({len(wrong)} of "
            f"{len(points)} points differ; first: {wrong[0]}): calibrate on a check planned from "
            "a model trained on the same sweeps, families and feature set"
        )
    step = gate.min_speedup
    pairs = [(p.predicted, p.faster) for p in points]
    nested = {f: calibration.fit_gated([(p.predicted, p.faster) for p in points
                                        if p.family != f], step)
              for f in sorted(models)}  # fmt: skip
    return calibration.fit_gated(pairs, step), nested


def train(
    keys_docs: Sequence[Mapping[str, Any]],
    gate: Gate | None = None,
    version: int = CURRENT,
    check: Sequence[CheckPoint] | None = None,
) -> dict[str, Any]:
    """Every class's leave-one-family-out score, the chosen class's model trained on every
    family with its calibration, and the leave-one-family-out outcomes and calibrations.

    ``version`` is the feature set; ``gate`` a fixed gate (default: the default gate for
    feature set 1, else each class's :func:`select_gate`).  With ``check`` (the timed points
    of a held-out check of the chosen class's leave-one-family-out choices), the confidence is
    calibrated on the check (:func:`check_calibrations`): ``calibration`` and
    ``check_calibrations`` (per family) are fitted there; the sweep's calibrations still score
    the classes and choose the gate."""
    keys, rows = key_data(keys_docs, version)
    families = sorted({k.family for k in keys})
    if len(families) < 3:
        raise UsageError(
            f"leave-one-family-out validation needs at least 3 families, the sweeps hold "
            f"{len(families)}: {', '.join(families)}"
        )
    scores: dict[str, dict[str, float]] = {}
    runs: dict[str, list[Outcome]] = {}
    fits: dict[str, dict[str, dict[str, Any]]] = {}
    gates: dict[str, Gate] = {}
    steps: dict[str, list[dict[str, float]]] = {}
    for name in CLASSES:
        models, outs = lofo(name, keys, rows)
        fits[name] = models if check is not None else {}  # a forest per family: kept if needed
        runs[name] = outs
        cals = nested_calibrations(outs)
        if gate is None and version >= 2:
            gates[name], steps[name] = select_gate(outs, cals)
        else:
            gates[name] = gate or Gate()
        scores[name] = score(outs, cals, gates[name])
    chosen = max(CLASSES, key=lambda n: (scores[n]["dispatch"], -scores[n]["slower"], n))
    outcomes = runs[chosen]
    out: dict[str, Any] = {
        "classes": scores,
        "chosen": chosen,
        "model": fit(chosen, rows),
        "calibration": calibration.fit(calibration_points(outcomes)),
        "lofo_calibrations": nested_calibrations(outcomes),
        "outcomes": [o.__dict__ for o in outcomes],
        "gate": gates[chosen].__dict__,
        "rows": len(rows),
        "keys": len(keys),
        "families": families,
    }
    if version >= 2:  # what feature set 1's documents do not hold
        out["feature_version"] = version
        out["gate_steps"] = steps
    if check is not None:
        out["calibration"], out["check_calibrations"] = check_calibrations(
            fits[chosen], check, gates[chosen]
        )
    return out


def lofo_plan(
    keys_docs: Sequence[Mapping[str, Any]],
    doc: Mapping[str, Any],
    tokens: Sequence[int],
    classes: Sequence[str] | None = None,
) -> list[dict[str, Any]]:
    """What each family's leave-one-family-out model answers at every (token count, routing
    class): the choice, its predicted speedup, agreement and confidence (from the calibration
    that never saw the family), and whether the gate admits it.  ``doc`` is :func:`train`'s
    result (its class, gate and per-family calibrations); the models are trained again."""
    from mxdb.models import ROUTING_CLASSES

    keys, rows = key_data(keys_docs, int(doc.get("feature_version", 1)))
    gate = Gate(**doc["gate"])
    shapes = {k.family: k.shape for k in keys}
    out: list[dict[str, Any]] = []
    for fam in doc["families"]:
        model = fit(doc["chosen"], [r for r in rows if r.family != fam])
        cal = (doc.get("check_calibrations") or doc["lofo_calibrations"])[fam]
        for m in tokens:
            shape = shapes[fam].with_tokens(m)
            for cls in classes or ROUTING_CLASSES:
                ch = choose(model, shape, cls, cal)
                out.append({
                    "family": fam, "tokens": m, "routing_class": cls,
                    "config": None if ch.config is None else ch.config.model_dump(),
                    "predicted": ch.predicted, "agreement": ch.agreement,
                    "confidence": ch.confidence, "answered": gate.admits(ch),
                })  # fmt: skip
    return out


def predicted_over(
    model: Mapping[str, Any],
    shape: MoEShape,
    routing_class: str,
    config: KernelConfig,
    other: KernelConfig,
) -> float:
    """The predicted lower-quartile speedup of ``config`` over ``other`` at the key: per tree,
    the difference of the two predicted log speedups over FlagGems' choice (the quartile
    :func:`choose` ranks by), so the comparison is as cautious as the model's own choice."""
    version = version_of(model.get("n_features"))
    rows = [features(shape, routing_class, c, version) for c in (config, other)]
    per_tree = trees.members(model, rows)
    return math.exp(float(np.quantile(per_tree[:, 0] - per_tree[:, 1], QUANTILE)))
