"""`logging.profile_at=N`: profile a few training steps with torch.profiler and say where the step's time went.

Writes, under ``<run>/profile/``: ``trace-rank<R>.json.gz`` (open it in Perfetto or chrome://tracing),
``summary.txt`` / ``summary.json`` (device time per step by kind of kernel: matmul, attention, Triton-generated,
eager elementwise, optimizer, copies; how long the device sat idle within the step; the top kernels), and the
summary as TensorBoard text ``run/profile``. The window is whole batches: it opens at the start of batch
``(N-1) x accumulation + 1`` and closes at the start of the batch after ``steps`` optimizer steps, so it holds
everything the loop does between them (forward, backward, optimizer, logging).

Nothing here runs unless asked: profiling slows the steps it covers, so those steps' `time/*` tags are not
representative (the summary's device times are).
"""

from __future__ import annotations

import bisect
import gzip
import json
import logging
import re
import time
import traceback
import warnings
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

# first match wins: cuDNN's attention kernels carry "wgmma" too, so attention is tried before matmul
KINDS: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("communication", re.compile(r"nccl", re.I)),
    ("attention", re.compile(r"flash|fmha|sdpa|attention|attn", re.I)),
    ("matmul", re.compile(r"gemm|nvjet|cutlass|xmma|cublas|scaled_mm|wgmma|triton_tem|splitk", re.I)),
    ("optimizer", re.compile(r"multi_tensor|foreach|adam|prodigy", re.I)),
    ("triton", re.compile(r"^triton_|^flux_kernels|_kernel_tl|^_tl_", re.I)),
    ("copy/cast", re.compile(r"memcpy|memset|copy|cast|fill|cat_|catarray", re.I)),
    ("reduction", re.compile(r"reduce", re.I)),
    ("elementwise", re.compile(r"elementwise|vectorized|unrolled|pointwise", re.I)),
)


# matmul ops and the positions of their two factors among the op's inputs (record_shapes)
MATMUL_OPS = {"aten::mm": (0, 1), "aten::addmm": (1, 2), "aten::_scaled_mm": (0, 1), "aten::bmm": (0, 1),
              "aten::baddbmm": (1, 2)}  # fmt: skip
LARGE_MATMUL_FLOP = 5e9  # a FLUX 3072x3072 projection of 4096 tokens is 77 GFLOP; a rank-16 LoRA factor 0.4


@dataclass(frozen=True)
class Kernel:
    """One device activity: a kernel, copy or memset, times in microseconds."""

    name: str
    start_us: float
    dur_us: float


def kind_of(name: str) -> str:
    return next((kind for kind, pattern in KINDS if pattern.search(name)), "other")


def busy_us(kernels: Iterable[Kernel]) -> float:
    """Time the device ran anything: the union of the kernels' intervals (streams overlap; summing would not)."""
    total, end = 0.0, float("-inf")
    for k in sorted(kernels, key=lambda k: k.start_us):
        stop = k.start_us + k.dur_us
        if stop <= end:
            continue
        total += stop - max(k.start_us, end)
        end = stop
    return total


def matmul_flop(name: str, shapes: list[list[int]]) -> float:
    """FLOPs of one matmul op from its recorded input shapes (0 when they are not what the op should take)."""
    i, j = MATMUL_OPS[name]
    try:
        a, b = shapes[i], shapes[j]
        if len(a) == 3:
            return 2.0 * a[0] * a[1] * a[2] * b[2]
        return 2.0 * a[0] * a[1] * b[1]
    except (IndexError, TypeError):
        return 0.0


def matmul_rates(events: Iterable[Any], steps: int) -> dict[str, dict[str, float]]:
    """Achieved rate of the matmul ops, large (the model's projections) and small (LoRA factors, modulation):
    FLOPs from the shapes, device time from the kernels each op launched."""
    acc: dict[str, list[float]] = {"large": [0.0, 0.0, 0], "small": [0.0, 0.0, 0]}
    for e in events:
        if e.name not in MATMUL_OPS or getattr(e.cpu_parent, "name", None) in MATMUL_OPS:
            continue
        flop = matmul_flop(e.name, e.input_shapes)
        row = acc["large" if flop >= LARGE_MATMUL_FLOP else "small"]
        row[0] += flop
        row[1] += float(e.device_time_total)
        row[2] += 1
    return {
        size: {"calls_per_step": n / steps, "ms_per_step": us / 1e3 / steps, "tflop_per_step": flop / 1e12 / steps,
               "tflops": flop / (us * 1e-6) / 1e12 if us else 0.0}
        for size, (flop, us, n) in acc.items() if n
    }  # fmt: skip


def summarize(kernels: list[Kernel], wall_s: float, steps: int, top: int = 20) -> dict[str, Any]:
    """Per-step figures of a profiled window: wall, device busy/idle, time by kind and the top kernels."""
    per_kind: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    per_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for k in kernels:
        for table, key in ((per_kind, kind_of(k.name)), (per_name, k.name)):
            table[key][0] += k.dur_us
            table[key][1] += 1
    busy = busy_us(kernels) / 1e3 / steps
    kernel_sum = sum(k.dur_us for k in kernels) / 1e3 / steps
    wall = wall_s * 1e3 / steps
    return {
        "steps": steps,
        "wall_ms_per_step": wall,
        "device_busy_ms_per_step": busy,
        "device_idle_ms_per_step": max(0.0, wall - busy) if kernels else None,
        "kernels_per_step": len(kernels) / steps,
        "by_kind": {
            kind: {"ms_per_step": t / 1e3 / steps, "share": t / 1e3 / steps / kernel_sum, "count_per_step": n / steps}
            for kind, (t, n) in sorted(per_kind.items(), key=lambda kv: -kv[1][0])
        },
        "top_kernels": [
            {
                "name": name,
                "kind": kind_of(name),
                "ms_per_step": t / 1e3 / steps,
                "calls_per_step": n / steps,
                "mean_us": t / n,
            }
            for name, (t, n) in sorted(per_name.items(), key=lambda kv: -kv[1][0])[:top]
        ],  # fmt: skip
    }


def uncovered_matmuls(summary: dict[str, Any]) -> str | None:
    """The large/small rates come from the ops' recorded shapes; kernels replayed from CUDA graphs were launched by
    no op, so they have none. Say so when they are most of the matmul time, rather than print a rate for a few."""
    total = summary["by_kind"].get("matmul", {}).get("ms_per_step", 0.0)
    covered = sum(row["ms_per_step"] for row in summary.get("matmuls", {}).values())
    if total <= 0 or covered >= 0.9 * total:
        return None
    return (
        f"(those rates cover {covered:.1f} of the {total:.1f} ms/step of matmul kernels: the rest were replayed "
        "from CUDA graphs, which record no shapes)"
    )


def format_summary(summary: dict[str, Any], cpu_ops: list[tuple[str, float]] | None = None) -> str:
    s = summary
    lines = [f"profiled {s['steps']} step(s): wall {s['wall_ms_per_step']:.1f} ms/step (profiler overhead included)"]
    if s["kernels_per_step"] == 0:
        lines.append("no device kernels seen (a CPU run): top CPU ops by self time, ms per step")
        lines += [f"  {ms:9.2f}  {name[:100]}" for name, ms in cpu_ops or []]
        return "\n".join(lines) + "\n"
    idle = s["device_idle_ms_per_step"]
    lines.append(
        f"device busy {s['device_busy_ms_per_step']:.1f} ms/step, idle {idle:.1f} ms/step "
        f"({idle / s['wall_ms_per_step']:.0%} of wall), {s['kernels_per_step']:.0f} kernels/step"
    )
    lines.append(f"{'kind':<12} {'ms/step':>9} {'share':>6} {'kernels/step':>13}")
    for kind, row in s["by_kind"].items():
        lines.append(f"{kind:<12} {row['ms_per_step']:9.2f} {row['share']:6.1%} {row['count_per_step']:13.0f}")
    for size, row in s.get("matmuls", {}).items():
        lines.append(
            f"{size} matmuls: {row['calls_per_step']:.0f}/step, {row['ms_per_step']:.2f} ms/step, "
            f"{row['tflop_per_step']:.2f} TFLOP/step, {row['tflops']:.0f} TFLOP/s"
        )
    if (note := uncovered_matmuls(s)) is not None:
        lines.append(note)
    if s.get("idle_by_cpu_op"):
        lines.append(f"device idle while the CPU ran:  {'ms/step':>9} {'gaps/step':>9}  outermost CPU op")
        for row in s["idle_by_cpu_op"]:
            lines.append(f"{'':31} {row['ms_per_step']:9.2f} {row['gaps_per_step']:9.0f}  {row['cpu_op'][:100]}")
    if s.get("host_copies_by_cpu_op"):
        lines.append(f"device-to-host copies (syncs):  {'per step':>9}            CPU op (outermost > innermost)")
        for row in s["host_copies_by_cpu_op"]:
            lines.append(f"{'':31} {row['copies_per_step']:9.1f}            {row['cpu_op'][:110]}")
    if s.get("syncs"):
        lines.append(f"synchronising calls: {'per step':>9}            Python call stack, innermost first")
        for row in s["syncs"]:
            lines.append(f"{'':20} {row['per_step']:9.1f}            {row['where'][:200]}")
    lines.append(f"top kernels: {'ms/step':>9} {'calls':>6} {'mean us':>8}  kind         name")
    for row in s["top_kernels"]:
        lines.append(
            f"            {row['ms_per_step']:9.2f} {row['calls_per_step']:6.0f} {row['mean_us']:8.1f}  "
            f"{row['kind']:<12} {row['name'][:110]}"
        )
    return "\n".join(lines) + "\n"


def device_kernels(events: Iterable[Any]) -> list[Kernel]:
    """The device-side activities among torch.profiler's events (everything not on the CPU), without the user
    annotations mirrored onto the device timeline (inductor's `## Call CompiledFxGraph ... ##` spans whole graphs:
    counting them would count their kernels twice)."""
    out = []
    for e in events:
        if str(getattr(e, "device_type", "")).endswith("CPU") or getattr(e, "is_user_annotation", False):
            continue
        if e.name.startswith("## ") or e.name.startswith("ProfilerStep#"):
            continue
        out.append(Kernel(e.name, float(e.time_range.start), float(e.time_range.elapsed_us())))
    return out


class CpuTimeline:
    """The outermost recorded CPU ops of a profile, per thread, to ask which one ran during a device interval.
    By time, not by kernel-launch correlation ids: on torch 2.11 (the H200's) those did not link kernels to ops in
    the events torch.profiler returns."""

    def __init__(self, events: Iterable[Any]) -> None:
        self.threads: dict[Any, list[tuple[float, float, Any]]] = defaultdict(list)
        for e in events:
            if not str(getattr(e, "device_type", "")).endswith("CPU") or getattr(e, "cpu_parent", None) is not None:
                continue
            if not getattr(e, "is_async", False):
                self.threads[getattr(e, "thread", 0)].append((float(e.time_range.start), float(e.time_range.end), e))
        for ops in self.threads.values():
            ops.sort(key=lambda o: o[0])
        self.starts = {t: [o[0] for o in ops] for t, ops in self.threads.items()}

    def outermost(self, a: float, b: float) -> Any:
        """The outermost op overlapping [a, b] the longest, on any thread (None: only Python ran)."""
        best, found = 0.0, None
        for t, ops in self.threads.items():
            i = bisect.bisect_left(self.starts[t], b) - 1
            while i >= 0 and ops[i][1] > a:  # a thread's outermost ops do not overlap: ends rise with starts
                overlap = min(b, ops[i][1]) - max(a, ops[i][0])
                if overlap > best:
                    best, found = overlap, ops[i][2]
                i -= 1
        return found


def _innermost(op: Any, a: float, b: float) -> Any:
    """Down from `op` through the child ops overlapping [a, b] to the deepest one."""
    while True:
        inside = [c for c in getattr(op, "cpu_children", []) or [] if c.time_range.start < b and c.time_range.end > a]
        if not inside:
            return op
        op = inside[0]


def idle_by_cpu_op(kernels: list[Kernel], timeline: CpuTimeline, steps: int, top: int = 10) -> list[dict[str, Any]]:
    """The device's idle gaps inside the window, each charged to what the CPU was doing meanwhile: the outermost
    recorded CPU op (an autograd node, a compiled region, `Optimizer.step#...`, `aten::item`, `cudaStreamSynchronize`,
    an annotation such as `flux_kernels::lora_grad_norms`) overlapping the gap most, on any thread; "(no recorded
    op)" when only Python ran. Much idle time under one name says the GPU waited on the CPU there: launches too
    small to cover their own overhead, or a sync."""
    acc: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    end = None
    for k in sorted(kernels, key=lambda k: k.start_us):
        if end is not None and k.start_us > end:
            op = timeline.outermost(end, k.start_us)
            row = acc["(no recorded op)" if op is None else op.name]
            row[0] += k.start_us - end
            row[1] += 1
        end = k.start_us + k.dur_us if end is None else max(end, k.start_us + k.dur_us)
    rows = sorted(acc.items(), key=lambda kv: -kv[1][0])[:top]
    return [{"cpu_op": name, "ms_per_step": us / 1e3 / steps, "gaps_per_step": n / steps} for name, (us, n) in rows]


HOST_COPY = re.compile(r"memcpy dtoh|device -> pageable|device -> pinned", re.I)


def host_copies_by_cpu_op(kernels: list[Kernel], timeline: CpuTimeline, steps: int, top: int = 8) -> list[dict]:
    """Device-to-host copies (each one a sync when it goes to pageable memory: `.item()`, `.cpu()`, a Python `if`
    on a tensor) per step, by the CPU ops that ran them: "outermost > innermost" op during the copy."""
    acc: dict[str, int] = defaultdict(int)
    for k in kernels:
        if HOST_COPY.search(k.name):
            a, b = k.start_us, k.start_us + max(k.dur_us, 1e-3)
            op = timeline.outermost(a, b)
            inner = None if op is None else _innermost(op, a, b)
            label = "(no recorded op)" if op is None else op.name if inner is op else f"{op.name} > {inner.name}"
            acc[label] += 1
    rows = sorted(acc.items(), key=lambda kv: -kv[1])[:top]
    return [{"cpu_op": name, "copies_per_step": n / steps} for name, n in rows]


def cpu_top_ops(prof: Any, steps: int, top: int = 12) -> list[tuple[str, float]]:
    rows = sorted(prof.key_averages(), key=lambda r: -r.self_cpu_time_total)[:top]
    return [(r.key, r.self_cpu_time_total / 1e3 / steps) for r in rows]


SYNC_WARNING = "called a synchronizing"  # torch's warning in sync debug mode ("... CUDA operation")
_NOT_THE_CALLER = re.compile(r"[/\\](torch|warnings\.py|contextlib\.py|flux_trainer[/\\]metrics[/\\]profile\.py)")


def caller_stack(frames: list[traceback.FrameSummary], depth: int = 3) -> str:
    """The innermost `depth` frames outside torch, innermost first: "dir/file.py:line func < ..."."""
    mine = [f for f in frames if not _NOT_THE_CALLER.search(f.filename)]
    parts = [f"{'/'.join(Path(f.filename).parts[-2:])}:{f.lineno} {f.name}" for f in reversed(mine[-depth:])]
    return " < ".join(parts) or "(torch internals only)"


class SyncTrace:
    """Which Python lines make the device synchronise: torch.cuda's sync debug mode ("warn") over the profile window,
    each synchronising call's warning turned into a count per Python call stack (the profiler sees the copies but
    not who asked for them). Other warnings pass through as before."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self._cm: Any = None
        self._cuda = False

    def start(self, cuda: bool) -> None:
        self._cm = warnings.catch_warnings()  # restores filters and showwarning at stop
        self._cm.__enter__()
        warnings.filterwarnings("always", message=f"{SYNC_WARNING}.*")
        passthrough = warnings.showwarning

        def show(message, category, filename, lineno, file=None, line=None):
            if str(message).startswith(SYNC_WARNING):
                self.counts[caller_stack(traceback.extract_stack()[:-1])] += 1
            else:
                passthrough(message, category, filename, lineno, file, line)

        warnings.showwarning = show
        self._cuda = cuda
        if cuda:
            import torch

            torch.cuda.set_sync_debug_mode("warn")

    def stop(self) -> None:
        if self._cm is None:
            return
        if self._cuda:
            import torch

            torch.cuda.set_sync_debug_mode("default")
        self._cm.__exit__(None, None, None)
        self._cm = None

    def rows(self, steps: int, top: int = 8) -> list[dict[str, Any]]:
        return [{"where": k, "per_step": n / steps} for k, n in self.counts.most_common(top)]


class StepProfiler:
    """Opens torch.profiler at the start of a chosen batch and closes it `steps` optimizer steps later."""

    def __init__(
        self, run_dir: Path, at: int, steps: int = 3, accumulation: int = 1, rank: int = 0, python: bool = False
    ) -> None:
        if at < 1 or steps < 1:
            raise ValueError(f"logging.profile_at must be >= 1 and logging.profile_steps >= 1, got {at}, {steps}")
        self.out_dir = Path(run_dir) / "profile"
        self.first = (at - 1) * accumulation + 1  # micro-batch numbers, 1-based
        self.stop_at = self.first + steps * accumulation
        self.steps = steps
        self.accumulation = accumulation
        self._seen = 0
        self._started_at = 0
        self.rank = rank
        self.python = python  # logging.profile_python: the trace records the Python calls too (with_stack)
        self._prof: Any = None
        self._syncs = SyncTrace()
        self._t0 = 0.0
        self._device: Any = None
        self.summary: dict[str, Any] | None = None
        self.text: str | None = None

    def on_batch(self, micro_step: int, device: Any) -> bool:
        """Call at the start of every micro-batch; returns True when it just wrote a profile."""
        self._seen = micro_step
        if micro_step == self.first and self._prof is None:
            self._start(device, micro_step)
        elif micro_step == self.stop_at and self._prof is not None:
            return self._finish(device)
        return False

    def close(self) -> bool:
        """At the end of training: a window the run ended inside is written with the steps it saw."""
        if self._prof is None:
            return False
        return self._finish(self._device)

    def _start(self, device: Any, micro_step: int) -> None:
        import torch
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU]
        if getattr(device, "type", "") == "cuda":
            activities.append(ProfilerActivity.CUDA)
            torch.cuda.synchronize(device)
        self._prof = profile(activities=activities, record_shapes=True, with_stack=self.python)
        self._prof.__enter__()
        self._syncs = SyncTrace()
        self._syncs.start(cuda=getattr(device, "type", "") == "cuda")
        self._t0 = time.perf_counter()
        self._device = device
        self._started_at = micro_step

    def _finish(self, device: Any) -> bool:
        """Close the window and write the summary; a failure here is logged, never raised into training."""
        import torch

        prof, self._prof = self._prof, None
        self._syncs.stop()
        try:
            if getattr(device, "type", "") == "cuda":
                torch.cuda.synchronize(device)
            wall = time.perf_counter() - self._t0
            if self._seen < self.stop_at:  # closed by the end of training: only the batches that ran
                self.steps = max(1, (self._seen - self._started_at + 1) // self.accumulation)
            prof.__exit__(None, None, None)
            self._write(prof, wall)
            return True
        except Exception as e:  # noqa: BLE001 - the profile is a diagnostic; the run it observes goes on
            log.warning("profile not written: %s: %s", type(e).__name__, e)
            return False

    def _write(self, prof: Any, wall: float) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        events = prof.events()
        kernels = device_kernels(events)
        self.summary = summarize(kernels, wall, self.steps)
        if self.summary["kernels_per_step"]:
            self.summary["matmuls"] = matmul_rates(events, self.steps)
            timeline = CpuTimeline(events)
            self.summary["idle_by_cpu_op"] = idle_by_cpu_op(kernels, timeline, self.steps)
            self.summary["host_copies_by_cpu_op"] = host_copies_by_cpu_op(kernels, timeline, self.steps)
        self.summary["syncs"] = self._syncs.rows(self.steps)
        self.text = format_summary(self.summary, cpu_top_ops(prof, self.steps))
        trace = self.out_dir / f"trace-rank{self.rank}.json"
        prof.export_chrome_trace(str(trace))
        with open(trace, "rb") as src, gzip.open(str(trace) + ".gz", "wb") as dst:
            dst.writelines(src)
        trace.unlink()
        if self.rank == 0:
            (self.out_dir / "summary.txt").write_text(self.text)
            (self.out_dir / "summary.json").write_text(json.dumps(self.summary, indent=1) + "\n")
