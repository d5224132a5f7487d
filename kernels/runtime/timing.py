"""Four ways to time an op: the median of CUDA-event timings of single calls on a GPU (`median_ms`: the GPU's own
clock; scripts/bench_kernels.py and the doctor), the same with the L2 cache overwritten before each call
(`cold_l2_ms`: memory-bound ops whose operands a step reads from memory; the GEMM scripts), calls queued back to
back (`queued_ms`: the attention probe), and calls kept running for seconds with the energy they take
(`sustained`: a card at its power limit, as in training steps); perf_counter elsewhere."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def median_ms(fn: Callable[[], object], device: torch.device, warmup: int, reps: int) -> float:
    """Median milliseconds of fn() over `reps` calls timed one at a time, after `warmup` untimed ones."""
    return queued_ms(fn, device, warmup, reps=1, rounds=reps)


def queued_ms(fn: Callable[[], object], device: torch.device, warmup: int, reps: int, rounds: int = 3) -> float:
    """Milliseconds per call of fn() with `reps` calls queued back to back, the median over `rounds`: on a GPU,
    CUDA events around all `reps` calls and no sync between them, so the host's work for one call overlaps the
    device's for the one before, as in a training step, where the host runs ahead. A call whose host code is slow
    (FlashAttention-4's Python interface: ~0.3-0.7 ms) and whose kernels are fast is then timed by its kernels, unless
    its host work is the slower of the two. perf_counter elsewhere."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(rounds):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(reps):
                fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / reps)
        else:
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            times.append((time.perf_counter() - t0) * 1e3 / reps)
    return statistics.median(times)


FLUSH_BYTES = 256 * 2**20  # more than any L2 cache so far (H100 / H200: 50 MB, B200: 126 MB)


def cold_l2_ms(fn: Callable[[], object], device: torch.device, warmup: int, reps: int) -> float:
    """Median milliseconds of fn() over `reps` calls timed one at a time, each after a buffer of FLUSH_BYTES was
    overwritten (outside the timed span), so that fn reads its operands from memory rather than from the L2 cache,
    as in a step where other work ran in between. `warmup` untimed calls first. On a GPU every call and its events
    are queued before one sync at the end: the host launches the next call while the device overwrites the buffer
    (~0.07 ms on an H200), so a call's launch time (a Triton kernel's Python launcher: ~0.05-0.08 ms) counts only
    where it outlasts that. perf_counter off the GPU."""
    for _ in range(warmup):
        fn()
    if device.type != "cuda":
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)
    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device=device)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for start, end in events:
        flush.zero_()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize(device)
    return statistics.median(start.elapsed_time(end) for start, end in events)


def sustained(
    fn: Callable[[], object], secs: float, energy_j: Callable[[], float] | None = None, settle_s: float = 1.0
) -> dict[str, float | None]:
    """fn() queued back to back for `settle_s` (a card reaches its power limit within that), then for `secs` more,
    measured: milliseconds a call, and with `energy_j` (a reader of a counter in joules, such as NVML's) joules a call
    and the mean watts. A sync every 20 calls keeps the queue short. Single calls on a cool card (the others here) run
    faster than the same calls in a training step where the card sits at its limit; this is the step's condition."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    fn()
    sync()
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < settle_s:
        fn()
    sync()
    e0, t0, n = energy_j() if energy_j else None, time.perf_counter(), 0
    while time.perf_counter() - t0 < secs or n == 0:
        fn()
        n += 1
        if n % 20 == 0:
            sync()
    sync()
    t1 = time.perf_counter()
    if energy_j is None or e0 is None:
        return {"ms": (t1 - t0) / n * 1e3, "j": None, "w": None}
    e1 = energy_j()
    return {"ms": (t1 - t0) / n * 1e3, "j": (e1 - e0) / n, "w": (e1 - e0) / (t1 - t0)}
