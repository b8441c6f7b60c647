"""Kernel timing as the server runs its decode steps: replayed from a CUDA graph, with cold
caches.

`graph_ms(calls)` captures one CUDA graph that makes every call in `calls` once, in order, and
returns the median replay time divided by len(calls). Each call should read its own copy of the
inputs (`copies_for(nbytes)` says how many so that together they exceed the L2 cache several
times over): then no call finds its data in L2, as a layer's weights are not there when a
forward pass reaches it. Python's launch overhead is not in the time (a graph replays without
it), which is what separates this from `triton.testing.do_bench` for kernels of a few
microseconds.
"""

from __future__ import annotations

import statistics

import torch

_MAX_COPIES = 64


def copies_for(nbytes: int) -> int:
    """Copies of a call's inputs whose bytes together are >= 4x the L2 cache (at most 64)."""
    l2 = torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size
    return max(1, min(_MAX_COPIES, -(-4 * l2 // max(nbytes, 1))))


def graph_ms(calls: list, reps: int = 20) -> float:
    """Median ms per call of `calls` replayed from one CUDA graph (each call run once before
    capture: compiled and warm)."""
    for fn in calls:
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in calls:
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / len(calls))
    return statistics.median(times)
