"""Interleaved GPU timing of several layer callables: CUDA-graph replays or eager calls.

Every candidate is timed on the same stream, in turn (A B C A B C ...), with device events;
samples are microseconds per layer call.

* ``graph``: each callable is captured ``calls_per_sample`` times in one CUDA graph; a sample is
  one replay, divided by ``calls_per_sample`` (amortizing the replay's own launch).  This is the
  GPU time of the layer, free of host overhead.
* ``eager``: a sample is ``calls_per_sample`` plain back-to-back calls between two events, divided
  likewise.  When the host is the bottleneck the GPU waits for it, so this measures what an
  eager inference loop pays per call.

Both warm up first (compilation, autotuning of FlagGems' ``moe_sum``, module loading), outside
any capture.  The host never synchronizes between samples: events are read once at the end.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

import torch
from mxdb.kernels.stream import VARIANTS, stream_sum

METHODS = ("graph", "eager")


def capture(
    fn: Callable[[], object], calls: int, stream: torch.cuda.Stream | None = None
) -> torch.cuda.CUDAGraph:
    """A CUDA graph of ``calls`` back-to-back calls of ``fn`` (already warmed up)."""
    graph = torch.cuda.CUDAGraph()
    side = stream if stream is not None else torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()  # one call on the capture stream first, as PyTorch recommends
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph, stream=side):
        for _ in range(calls):
            fn()
    return graph


def time_interleaved(
    fns: Sequence[Callable[[], object]],
    *,
    reps: int,
    method: str = "graph",
    calls_per_sample: int = 8,
    warmup: int = 3,
    order_seed: int | None = None,
) -> list[list[float]]:
    """Samples (us per call) for each of ``fns``, interleaved; ``reps`` samples each.

    Sample ``r`` of every callable belongs to round ``r``.  With ``order_seed``, each round
    runs the callables in a random order drawn from it (a fixed order biased same-config
    comparisons by about 0.4% on an H200); without it, in the order given.
    """
    if method not in METHODS:
        raise ValueError(f"timing method {method!r} is not one of {', '.join(METHODS)}")
    if reps < 1 or calls_per_sample < 1:
        raise ValueError("reps and calls_per_sample must be at least 1")
    for fn in fns:
        for _ in range(warmup):
            fn()
    torch.cuda.synchronize()
    n = len(fns)
    if method == "graph":
        graphs = [capture(fn, calls_per_sample) for fn in fns]
        for g in graphs:  # first replays upload the graph
            g.replay()
            g.replay()
        torch.cuda.synchronize()

        def body(i: int) -> None:
            graphs[i].replay()

    else:

        def body(i: int) -> None:
            fn = fns[i]
            for _ in range(calls_per_sample):
                fn()

    starts = [[torch.cuda.Event(enable_timing=True) for _ in range(reps)] for _ in range(n)]
    ends = [[torch.cuda.Event(enable_timing=True) for _ in range(reps)] for _ in range(n)]
    rng = random.Random(order_seed) if order_seed is not None else None
    for r in range(reps):
        order = list(range(n))
        if rng is not None:
            rng.shuffle(order)
        for i in order:
            starts[i][r].record()
            body(i)
            ends[i][r].record()
    torch.cuda.synchronize()
    scale = 1000.0 / calls_per_sample
    return [[starts[i][r].elapsed_time(ends[i][r]) * scale for r in range(reps)] for i in range(n)]


def rate_samples(
    fn: Callable[[], object], amount: float, *, reps: int = 20, warmup: int = 3
) -> list[float]:
    """``amount`` (bytes, FLOPs) per second of ``fn``: one sample per call between two events,
    after ``warmup`` calls (the device rates the memory-bound and compute floors divide by)."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(reps):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        out.append(amount / (start.elapsed_time(end) / 1000))
    return out


def copy_bandwidth_samples(reps: int = 20) -> list[float]:
    """Device-to-device copy bandwidth of a 1 GiB buffer (read + write bytes per second)."""
    n = 1 << 30
    a = torch.empty(n, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    return rate_samples(lambda: b.copy_(a), 2 * n, reps=reps)


def read_bandwidth_samples(reps: int = 20) -> list[float]:
    """Streaming-read bandwidth (bytes read per second): 2 GiB of bf16 summed into float32.

    A copy also writes what it reads; a layer at decode batch sizes mostly reads weights, and
    some reach more than the copy bandwidth, so floors are reported against both.  The probe is
    a Triton kernel (:func:`mxdb.kernels.stream.stream_sum`: wide loads, one partial sum per
    program), not a torch reduction; each of its launch shapes (``stream.VARIANTS``) is timed 5
    times and the ``reps`` samples are those of the one with the highest median."""
    n = 1 << 30
    r = torch.ones(n, dtype=torch.bfloat16, device="cuda")

    def samples(v: tuple[int, int, int], k: int) -> list[float]:
        return rate_samples(lambda: stream_sum(r, v), 2 * n, reps=k)

    best = max(VARIANTS, key=lambda v: sorted(samples(v, 5))[2])
    return samples(best, reps)


def torch_sum_read_samples(reps: int = 20) -> list[float]:
    """The earlier probe, ``torch.sum`` in float32 over 2 GiB of bf16 (bytes read per second):
    kept to compare the two on a device."""
    n = 1 << 30
    r = torch.ones(n, dtype=torch.bfloat16, device="cuda")
    return rate_samples(lambda: r.sum(dtype=torch.float32), 2 * n, reps=reps)
