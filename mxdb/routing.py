"""Routing traces: load top-k expert ids, compute their features, name their class.

A trace is the ``[M, k]`` array of expert ids a router chose for a batch of
``M`` tokens (DESIGN section 5).  ``load_topk`` accepts every form a trace
travels in and rejects malformed ones with the position of the first bad
value; ``features`` computes the per-expert load statistics the dispatcher
and tuner key on; ``classify`` buckets them into a coarse routing class.
"""

from __future__ import annotations

import json
import math
import numbers
import os
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
from pydantic import BaseModel, ConfigDict

from mxdb.errors import TraceError, UsageError
from mxdb.models import ROUTING_CLASSES  # noqa: F401  (the classes classify returns)
from mxdb.shapes import MAX_EXPERTS

IdArray = npt.NDArray[np.int64]

#: Most ids (tokens x k) one trace may hold.
MAX_TRACE_IDS = 1 << 24

ACCEPTED_FORM = (
    "a [M, k] array of integer expert ids (M tokens, k distinct experts each): "
    'a JSON list of lists or {"topk_ids": [[...], ...]}, a .npy file, a list, '
    "a numpy array or a tensor"
)

#: Version tag of the canonical byte form hashed by ``trace_hash``.


def _fail(problem: str) -> TraceError:
    return TraceError(f"{problem}; expected {ACCEPTED_FORM}")


# ---------------------------------------------------------------- loading


def _is_int_value(v: Any) -> bool:
    if isinstance(v, (bool, np.bool_)):
        return False
    if isinstance(v, numbers.Integral):
        return True
    if isinstance(v, numbers.Real):
        f = float(v)
        return math.isfinite(f) and f.is_integer()
    return False


def _from_nested(rows: Any, where: str) -> IdArray:
    """Validate a nested Python sequence value by value; the error names the first bad one."""
    if not isinstance(rows, (list, tuple)):
        raise _fail(f"{where} is a {type(rows).__name__}, not a list of rows")
    if len(rows) == 0:
        raise _fail(f"{where} is empty (no tokens)")
    if not isinstance(rows[0], (list, tuple)):
        if all(not isinstance(r, (list, tuple)) for r in rows):
            raise _fail(
                f"{where} is 1-D ({len(rows)} values); a trace is 2-D: one row of k ids per "
                "token, e.g. [[0, 3], [1, 2]]"
            )
        raise _fail(f"{where}: row 0 is a {type(rows[0]).__name__}, not a list of ids")
    k = len(rows[0])
    if len(rows) * max(k, 1) > MAX_TRACE_IDS:
        raise _fail(
            f"{where} has {len(rows):,} rows of {k} ids, above the limit of "
            f"{MAX_TRACE_IDS:,} ids per trace"
        )
    fast = _fast_nested(rows)
    if fast is not None:
        return fast
    for i, row in enumerate(rows):
        if not isinstance(row, (list, tuple)):
            raise _fail(f"{where}: row {i} is a {type(row).__name__}, not a list of ids")
        if len(row) != k:
            raise _fail(f"{where}: row {i} has {len(row)} ids but row 0 has {k} (ragged rows)")
        for j, v in enumerate(row):
            if isinstance(v, (list, tuple)):
                raise _fail(f"{where}: row {i}, column {j} is a list: the trace is 3-D or deeper")
            if not _is_int_value(v):
                raise _fail(
                    f"{where}: row {i}, column {j} is {v!r} ({type(v).__name__}), "
                    "not an integer expert id"
                )
            if not -MAX_EXPERTS <= v <= MAX_EXPERTS:
                raise _fail(
                    f"{where}: row {i}, column {j} is {v!r}, beyond any expert id "
                    f"(at most {MAX_EXPERTS:,} experts)"
                )
    if k == 0:
        raise _fail(f"{where} has {len(rows)} rows of 0 ids (k = 0)")
    return np.asarray([[int(v) for v in row] for row in rows], dtype=np.int64)


def _fast_nested(rows: Any) -> IdArray | None:
    """Plain rows of plain ints, converted by numpy in one go; None when any value needs a look.

    Booleans (which numpy would quietly turn into 0 and 1), floats, huge integers and ragged
    rows all send the caller to the value-by-value check, which names the first bad one.
    """
    if not all(type(r) is list for r in rows):
        return None
    if any(type(v) is not int for r in rows for v in r):
        return None
    try:
        arr = np.asarray(rows, dtype=np.int64)
    except (ValueError, OverflowError, TypeError):
        return None
    if arr.ndim != 2 or arr.shape[1] == 0:
        return None
    if arr.size and (int(arr.min()) < -MAX_EXPERTS or int(arr.max()) > MAX_EXPERTS):
        return None
    return arr


def _first_pos(mask: npt.NDArray[np.bool_]) -> tuple[int, int]:
    flat = int(np.argmax(mask.reshape(-1)))
    i, j = divmod(flat, mask.shape[1])
    return i, j


def _from_array(arr: npt.NDArray[Any], where: str) -> IdArray:
    if arr.dtype == object:
        return _from_nested(arr.tolist(), where)
    if arr.ndim != 2:
        if arr.ndim == 1:
            raise _fail(
                f"{where} is 1-D (shape {tuple(arr.shape)}); a trace is 2-D: one row of k ids "
                "per token (reshape to [M, k])"
            )
        raise _fail(f"{where} has {arr.ndim} dimensions (shape {tuple(arr.shape)}), not 2")
    if arr.shape[0] == 0 or arr.shape[1] == 0:
        raise _fail(f"{where} is empty (shape {tuple(arr.shape)})")
    kind = arr.dtype.kind
    if kind == "b":
        raise _fail(f"{where} holds booleans (dtype {arr.dtype}), not integer expert ids")
    if kind in "iu":
        if kind == "u" and arr.size and int(arr.max()) > np.iinfo(np.int64).max:
            i, j = _first_pos(arr > np.iinfo(np.int64).max)
            raise _fail(
                f"{where}: row {i}, column {j} is {arr[i, j].item()}, too large for an expert id"
            )
        return np.ascontiguousarray(arr, dtype=np.int64)
    if kind == "f":
        bad = ~np.isfinite(arr) | (np.floor(arr) != arr) | (np.abs(arr) > 2.0**53)
        if bad.any():
            i, j = _first_pos(bad)
            raise _fail(
                f"{where}: row {i}, column {j} is {arr[i, j].item()!r}, not an integer expert id"
            )
        return np.ascontiguousarray(arr, dtype=np.int64)
    raise _fail(f"{where} holds {arr.dtype} values, not integer expert ids")


def _npy_header(data: bytes, where: str) -> tuple[tuple[int, ...], Any]:
    """Shape and dtype from a .npy header, checked against the limits before any array is built."""
    import io

    from numpy.lib import format as npy_format

    fh = io.BytesIO(data)
    try:
        version = npy_format.read_magic(fh)
        if version == (1, 0):
            shape, _, dtype = npy_format.read_array_header_1_0(fh)
        elif version in ((2, 0), (3, 0)):
            shape, _, dtype = npy_format.read_array_header_2_0(fh)
        else:
            raise ValueError(f"unsupported .npy format version {version}")
    except Exception as exc:  # numpy's header parser raises many kinds on hostile bytes
        raise TraceError(f"cannot read {where!r} as a .npy array: {exc}") from None
    if dtype.hasobject:
        raise TraceError(f"{where!r} holds Python objects; a trace is an integer .npy array")
    count = 1
    for n in shape:
        count *= int(n)
    if count > MAX_TRACE_IDS:
        raise TraceError(
            f"{where!r} claims shape {tuple(shape)} ({count:,} ids), above the limit of "
            f"{MAX_TRACE_IDS:,} ids per trace"
        )
    if count * dtype.itemsize > len(data) - fh.tell():
        raise TraceError(
            f"{where!r} claims shape {tuple(shape)} of {dtype} but holds only "
            f"{len(data) - fh.tell():,} bytes of data (truncated file)"
        )
    return tuple(int(n) for n in shape), dtype


def _read_file(path: Path) -> tuple[IdArray, int | None]:
    from mxdb.fileio import MAX_TRACE_BYTES, MAX_TRACE_JSON_BYTES, parse_json, read_bytes

    where = str(path)
    suffix = path.suffix.lower()
    if suffix not in (".npy", ".json"):
        if not path.exists():
            raise TraceError(f"trace file {where!r} does not exist")
        raise TraceError(
            f"trace file {where!r} has suffix {suffix or '(none)'!r}; use a .json or .npy file"
        )
    limit = MAX_TRACE_BYTES if suffix == ".npy" else MAX_TRACE_JSON_BYTES
    raw = read_bytes(path, limit=limit, what="trace file", error=TraceError)
    if not raw:
        raise _fail(f"trace file {where} is empty (0 bytes)")
    if suffix == ".npy":
        import io

        shape, _ = _npy_header(raw, where)
        if 0 in shape:
            raise _fail(f"{where} is empty (shape {shape}): it holds no expert ids")
        try:
            arr = np.load(io.BytesIO(raw), allow_pickle=False)
        except Exception as exc:  # the header was checked; the body can still be damaged
            raise TraceError(f"cannot read {where!r} as a .npy array: {exc}") from None
        return _from_array(arr, where), None
    data = parse_json(raw, what=f"trace file {where!r}", error=TraceError)
    experts = None
    if isinstance(data, dict):
        key = next((k for k in ("topk_ids", "ids") if k in data), None)
        if key is None:
            raise _fail(
                f'{where} is a JSON object without a "topk_ids" (or "ids") key '
                f"(keys: {', '.join(sorted(map(str, data))) or 'none'})"
            )
        raw_e = data.get("experts")
        if raw_e is not None:
            if not _is_int_value(raw_e) or int(raw_e) < 1:
                raise TraceError(f'{where}: "experts" must be a positive integer, got {raw_e!r}')
            if int(raw_e) > MAX_EXPERTS:
                raise TraceError(
                    f'{where}: "experts" is {int(raw_e):,}, above the limit of {MAX_EXPERTS:,}'
                )
            experts = int(raw_e)
        data = data[key]
        where = f"{where}: {key}"
    return _from_nested(data, where), experts


def load_topk(
    source: Any,
    *,
    experts: int | None = None,
    topk: int | None = None,
) -> IdArray:
    """Load and validate a trace; returns a C-contiguous int64 array of shape ``[M, k]``.

    ``source``: a path (``.json``: a list of lists or an object with
    ``topk_ids`` and optionally ``experts``; ``.npy``), a nested list, a numpy
    array, or a tensor (anything with ``.detach().cpu().numpy()``; torch is
    never imported).  ``experts`` bounds the ids to ``[0, experts)``; without
    it (and without ``experts`` in the file) ids need only be non-negative.
    ``topk``, if given, is the required row length.

    Raises TraceError for: a missing or unreadable file, invalid JSON, an empty
    trace, a rank other than 2, ragged rows, a row length other than ``topk``,
    non-integer values (non-integral floats, booleans, strings), ids out of
    range, and an expert repeated within one token's row.
    """
    file_experts: int | None = None
    if isinstance(source, (str, os.PathLike)):
        ids, file_experts = _read_file(Path(source))
    elif isinstance(source, np.ndarray):
        ids = _from_array(source, "trace array")
    elif all(hasattr(source, a) for a in ("detach", "cpu", "numpy")):
        ids = _from_array(np.asarray(source.detach().cpu().numpy()), "trace tensor")
    elif isinstance(source, (list, tuple)):
        ids = _from_nested(source, "trace")
    else:
        raise _fail(f"cannot read a trace from a {type(source).__name__}")

    if experts is not None and file_experts is not None and experts != file_experts:
        raise TraceError(
            f"the trace file says experts={file_experts} but {experts} was asked for; "
            "drop one of them or make them agree"
        )
    bound = experts if experts is not None else file_experts
    if bound is not None and (isinstance(bound, bool) or bound < 1):
        raise UsageError(f"experts must be a positive integer, got {bound!r}")
    if bound is not None and bound > MAX_EXPERTS:
        raise UsageError(f"experts is {bound:,}, above the limit of {MAX_EXPERTS:,}")
    return validate_ids(ids, experts=bound, topk=topk)


def validate_ids(ids: IdArray, *, experts: int | None = None, topk: int | None = None) -> IdArray:
    """Check range, row length and distinctness of an int64 ``[M, k]`` array."""
    k = ids.shape[1]
    if topk is not None and k != topk:
        raise _fail(f"the trace has k = {k} ids per token but top-k {topk} was asked for")
    negative = ids < 0
    if negative.any():
        i, j = _first_pos(negative)
        raise _fail(f"row {i}, column {j} is {ids[i, j].item()}: expert ids are >= 0")
    if experts is not None:
        if k > experts:
            raise _fail(f"rows have k = {k} ids but there are only {experts} experts")
        high = ids >= experts
        if high.any():
            i, j = _first_pos(high)
            raise _fail(
                f"row {i}, column {j} is {ids[i, j].item()}: expert ids must be in [0, {experts})"
            )
    if k > 1:
        s = np.sort(ids, axis=1)
        dup = s[:, 1:] == s[:, :-1]
        if dup.any():
            i, _ = _first_pos(dup)
            row = ids[i]
            vals, counts = np.unique(row, return_counts=True)
            v = int(vals[counts > 1][0])
            cols = [int(c) for c in np.flatnonzero(row == v)]
            raise _fail(
                f"row {i} names expert {v} twice (columns {cols}): "
                "a token's top-k experts are distinct"
            )
    return np.ascontiguousarray(ids, dtype=np.int64)


def trace_hash(ids: Any, experts: int) -> str:
    """A trace's identity, the one evidence bundles record: SHA-256 of the canonical JSON
    ``{experts, ids}`` (16 hex digits).

    A list, a .json file, a .npy file and a tensor holding the same ids hash the same.
    """
    from mxdb.evidence.files import trace_hash as canonical

    arr = ids if isinstance(ids, np.ndarray) and ids.dtype == np.int64 else load_topk(ids)
    if arr.ndim != 2:
        raise _fail(f"cannot hash a {arr.ndim}-D array")
    return canonical(int(experts), arr.tolist())


# ---------------------------------------------------------------- features


class RoutingFeatures(BaseModel):
    """Load statistics of one trace (DESIGN section 5)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    experts: int
    tokens: int
    topk: int
    counts: list[int]
    entropy_norm: float
    cv: float
    empty_ratio: float
    max_share: float
    padding_ratio: float
    align_block: int
    routing_class: str
    trace_hash: str

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump()

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)


def expert_counts(ids: IdArray, experts: int) -> npt.NDArray[np.int64]:
    """Tokens routed to each expert (length ``experts``)."""
    return np.bincount(ids.reshape(-1), minlength=experts).astype(np.int64)


def padding_ratio(counts: Any, align_block: int) -> float:
    """Padded slots / real slots when each expert's slots are padded to a multiple of the block.

    This is what ``moe_align_block_size`` (vLLM, FlagGems) does: an expert with
    ``c`` slots takes ``ceil(c / block) * block``; an expert with none takes none.
    """
    if align_block < 1:
        raise UsageError(f"align_block must be a positive integer, got {align_block}")
    c = np.asarray(counts, dtype=np.int64)
    real = int(c.sum())
    if real == 0:
        return 0.0
    padded = int((-(-c // align_block) * align_block).sum())
    return (padded - real) / real


def features(ids: Any, experts: int, align_block: int = 16) -> RoutingFeatures:
    """The features and class of a trace (validated with ``load_topk`` unless already int64)."""
    if isinstance(experts, bool) or not isinstance(experts, numbers.Integral) or experts < 1:
        raise UsageError(f"experts must be a positive integer, got {experts!r}")
    if isinstance(align_block, bool) or align_block < 1:
        raise UsageError(f"align_block must be a positive integer, got {align_block!r}")
    experts = int(experts)
    if experts > MAX_EXPERTS:
        raise UsageError(f"experts is {experts:,}, above the limit of {MAX_EXPERTS:,}")
    if isinstance(ids, np.ndarray) and ids.dtype == np.int64 and ids.ndim == 2:
        arr = validate_ids(ids, experts=experts)
    else:
        arr = load_topk(ids, experts=experts)
    m, k = arr.shape
    counts = expert_counts(arr, experts)
    total = m * k
    p = counts[counts > 0] / total
    entropy = float(-(p * np.log(p)).sum())
    entropy_norm = entropy / math.log(experts) if experts > 1 else 1.0
    mean = total / experts
    cv = float(counts.std() / mean)
    stats = dict(
        experts=experts,
        tokens=m,
        topk=k,
        counts=[int(c) for c in counts],
        entropy_norm=entropy_norm,
        cv=cv,
        empty_ratio=float((counts == 0).sum() / experts),
        max_share=float(counts.max() / total),
        padding_ratio=padding_ratio(counts, align_block),
        align_block=int(align_block),
    )
    return RoutingFeatures(
        **stats, routing_class=_classify_counts(counts, m, k), trace_hash=trace_hash(arr, experts)
    )


def analyze_trace(source: Any, experts: int, align_block: int = 16) -> RoutingFeatures:
    """Load a trace from any accepted form and compute its features (``mxdb trace``)."""
    return features(load_topk(source, experts=experts), experts, align_block)


# ---------------------------------------------------------------- classes

#: z-score above which a statistic counts as significantly unlike uniform routing.
SIGNIFICANCE_Z = 3.0
#: Intrinsic popularity CV below which routing counts as uniform (material threshold).
SKEW_MIN = 0.25
#: Empty-expert ratio above the uniform expectation that makes a trace sparse.
SPARSE_EXCESS = 0.25
#: How much more often than uniform (in token fraction) the top expert must be chosen to be hot.
HOT_EXCESS = 0.2


def _intrinsic_skew(counts: npt.NDArray[np.float64], m: int) -> tuple[float, bool]:
    """(intrinsic CV, significant) of expert counts against uniform routing of ``m`` tokens.

    Under uniform routing each of the ``n`` experts here is chosen by a token
    with probability ``q = mean / m``, so its count is Binomial(m, q) with
    variance ``m q (1 - q)``.  The intrinsic CV removes that sampling noise:
    ``sqrt(max(0, cv^2 - cv_u^2))``.  Significance: the variance ratio
    ``D = var / (m q (1 - q))`` exceeds ``1 + z * sqrt(2 / (n - 1))``.
    """
    n = counts.size
    mean = float(counts.mean())
    if n < 2 or mean == 0:
        return 0.0, False
    q = min(mean / m, 1.0)
    var_u = m * q * (1.0 - q)
    var = float(counts.var())
    if var_u == 0:
        return (math.sqrt(var) / mean, var > 0)
    skew = math.sqrt(max(0.0, (var - var_u) / mean**2))
    significant = var / var_u > 1.0 + SIGNIFICANCE_Z * math.sqrt(2.0 / (n - 1))
    return skew, significant


def _classify_counts(counts: npt.NDArray[np.int64], m: int, k: int) -> str:
    experts = counts.size
    p = k / experts
    c = counts.astype(np.float64)

    # sparse: far more empty experts than uniform routing leaves at this M.
    e_u = (1.0 - p) ** m
    n_empty = int((counts == 0).sum())
    sd_empty = math.sqrt(experts * e_u * (1.0 - e_u))
    if (
        n_empty / experts - e_u >= SPARSE_EXCESS
        and n_empty - experts * e_u > SIGNIFICANCE_Z * sd_empty + 1.0
    ):
        return "sparse"

    skew, significant = _intrinsic_skew(c, m)
    if not significant or skew < SKEW_MIN:
        return "uniform"

    # hot: one expert carries the excess and the others look uniform.
    order = np.argsort(c)[::-1]
    top = float(c[order[0]])
    rest = c[order[1:]]
    rest_skew, rest_significant = _intrinsic_skew(rest, m)
    if top / m - p >= HOT_EXCESS and (not rest_significant or rest_skew < SKEW_MIN):
        return "hot"
    return "skewed"


def classify(feats: RoutingFeatures) -> str:
    """The routing class of a trace's features: one of ``ROUTING_CLASSES``.

    Every test compares the trace with what uniform routing (each token picks
    k distinct experts uniformly at random) gives at the same ``(M, k, E)``,
    so that small batches are not mistaken for skewed ones: at ``M = 4``,
    ``k = 8``, ``E = 128`` uniform routing leaves about 77% of experts empty.
    With ``p = k / E``:

    1. ``sparse``: the empty-expert ratio exceeds the uniform expectation
       ``(1 - p)^M`` by at least ``SPARSE_EXCESS`` (0.25) and by more than
       ``SIGNIFICANCE_Z`` (3) binomial standard deviations plus one expert.
    2. ``uniform``: the counts' variance is not significantly above the
       multinomial variance ``M p (1 - p)`` (variance ratio at most
       ``1 + 3 sqrt(2 / (E - 1))``), or the intrinsic popularity CV
       ``sqrt(cv^2 - cv_uniform^2)`` is below ``SKEW_MIN`` (0.25).
    3. ``hot``: the most loaded expert is chosen by at least ``HOT_EXCESS``
       (0.2) more of the tokens than uniform routing gives (``p``), and
       without it the other experts pass the uniform test of step 2.
    4. ``skewed``: everything else (graded popularity, several hot experts).
    """
    return _classify_counts(np.asarray(feats.counts, dtype=np.int64), feats.tokens, feats.topk)
