"""`logging.memory_snapshot_at=N`: record every CUDA allocation of one optimizer step and say what was live at its
peak, by where it was allocated.

The step's allocations go to `<run>/memory/snapshot-rank<R>.pickle` (PyTorch's memory snapshot: drag it onto
https://pytorch.org/memory_viz for the timeline), and `<run>/memory/peak-rank<R>.txt` lists the tensors allocated
within the step that were still live when its allocated memory peaked, grouped by the first stack frame outside
PyTorch and inductor's generated code (the line of sd-scripts or flux_kernels that asked for them). Tensors allocated
before the step (the weights, the optimizer state) are not in the recording; the summary says how much the step
added on top of them. Blocks replayed from CUDA graphs draw on the graphs' own pool, which the recording does not
show; `kernels.cuda_graphs=false` for a step whose blocks should be in it. The summary ends with what the allocator
held after the step by pool and stream (`reserve_text`), the graphs' pools included: where a card's peak above the
allocated one sits. On a device that is not CUDA it logs that once and records nothing.
"""

from __future__ import annotations

import logging
import pickle
from collections import defaultdict
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

GIB = 2**30
TORCH_PARTS = ("/torch/", "\\torch\\")  # a frame in PyTorch's own package
GENERATED_PARTS = ("torchinductor",)  # a frame in inductor's generated code (its cache dir: "torchinductor...")


def where(frames: list[dict]) -> str:
    """The first frame (innermost first, as the snapshot lists them) outside PyTorch's package and inductor's
    generated code (whose `call` line says nothing about the model's code that asked for the tensor), as
    file:line (function); else the first outside PyTorch; else the innermost; "?" without frames."""
    if not frames:
        return "?"

    def outside(frame: dict, parts: tuple[str, ...]) -> bool:
        return not any(p in frame.get("filename", "") for p in parts)

    ours = [f for f in frames if outside(f, TORCH_PARTS)]
    frame = next((f for f in ours if outside(f, GENERATED_PARTS)), ours[0] if ours else frames[0])
    name = Path(frame.get("filename", "?")).name
    return f"{name}:{frame.get('line', '?')} ({frame.get('name', '?')})"


def peak_live(trace: list[dict]) -> tuple[int, int, dict[str, tuple[int, int]], float]:
    """From one device's allocation trace (snapshot["device_traces"][i]): the peak of the bytes allocated within the
    trace and still live, the bytes live at its end, at the peak per `where` (bytes, tensors), and how far into the
    trace the peak came (its event's position, 0-1: a checkpointed step's forward ends well before its backward).
    Two passes: the first finds the peak's event, the second replays the trace up to it."""
    sizes: dict[int, int] = {}
    total = peak = 0
    peak_at = -1
    for i, e in enumerate(trace):
        if e.get("action") == "alloc":
            sizes[e["addr"]] = e["size"]
            total += e["size"]
            if total > peak:
                peak, peak_at = total, i
        elif e.get("action") == "free_completed" and e["addr"] in sizes:
            total -= sizes.pop(e["addr"])
    live: dict[int, dict] = {}
    for e in trace[: peak_at + 1]:
        if e.get("action") == "alloc":
            live[e["addr"]] = e
        elif e.get("action") == "free_completed":
            live.pop(e["addr"], None)
    groups: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for e in live.values():
        group = groups[where(e.get("frames", []))]
        group[0] += e["size"]
        group[1] += 1
    position = (peak_at + 1) / len(trace) if trace else 0.0
    return peak, total, {k: (v[0], v[1]) for k, v in groups.items()}, position


def summary(step: int, trace: list[dict], top: int = 12) -> str:
    peak, end, groups, position = peak_live(trace)
    lines = [
        f"memory of step {step}: {peak / GIB:.2f} GiB allocated within the step and live at its peak, "
        f"{position:.0%} of the way through the step's {len(trace)} allocation events ({end / GIB:.2f} GiB of the "
        "step's allocations still live at its end); at the peak, by where allocated:"
    ]
    for place, (size, n) in sorted(groups.items(), key=lambda kv: -kv[1][0])[:top]:
        lines.append(f"  {size / GIB:8.3f} GiB  {n:5d} tensors  {place}")
    return "\n".join(lines)


def reserve_by_pool(segments: list[dict]) -> list[tuple[str, int, int, int]]:
    """What the allocator held when the snapshot was taken, by pool and stream: (label, reserved bytes, of them
    allocated, segments), largest reserve first. The allocator keeps what it reserved (it gives memory back only on
    `empty_cache` or a failed allocation), so after the step this is its reserve at the step's peak: the card's peak
    less the allocated peak is this reserve's unallocated part plus what the allocator does not hold. Memory
    reserved in one pool (CUDA graphs record into private pools) or for one stream cannot serve another's
    allocations, so a reserve split several ways is where a card's peak rises above the allocated one."""
    groups: dict[tuple[str, int], list[int]] = defaultdict(lambda: [0, 0, 0])
    for seg in segments:
        pool = tuple(seg.get("segment_pool_id") or (0, 0))
        label = "the default pool" if pool == (0, 0) else f"private pool {pool[0]}.{pool[1]} (CUDA graphs)"
        group = groups[(label, int(seg.get("stream", 0)))]
        group[0] += int(seg.get("total_size", 0))
        group[1] += int(seg.get("allocated_size", 0))
        group[2] += 1
    rows = [(f"{label}, stream {stream:#x}", *v) for (label, stream), v in groups.items()]
    return sorted(rows, key=lambda r: -r[1])


def reserve_text(segments: list[dict], top: int = 8) -> str:
    rows = reserve_by_pool(segments)
    total = sum(r[1] for r in rows)
    held = sum(r[2] for r in rows)
    lines = [
        f"reserved after the step: {total / GIB:.2f} GiB in {sum(r[3] for r in rows)} segments, "
        f"{held / GIB:.2f} GiB of it allocated; by pool and stream (reserved / allocated):"
    ]
    for label, size, allocated, n in rows[:top]:
        lines.append(f"  {size / GIB:8.3f} / {allocated / GIB:7.3f} GiB  {n:4d} segments  {label}")
    return "\n".join(lines)


class MemorySnapshot:
    """Starts recording at the first micro-batch of optimizer step `at` and writes at the first one after it (or
    at `close`, where training ends inside the window). A failure is logged, never raised into training."""

    def __init__(self, run_dir: Path, at: int, accumulation: int = 1, rank: int = 0, memory: Any = None) -> None:
        if at < 1:
            raise ValueError(f"logging.memory_snapshot_at must be >= 1, got {at}")
        self.out_dir = Path(run_dir) / "memory"
        self.at = at
        self.first = (at - 1) * accumulation + 1  # micro-batch numbers, 1-based
        self.stop_at = self.first + accumulation
        self.rank = rank
        self._memory = memory  # torch.cuda.memory, or a stand-in for tests
        self._device: Any = None
        self.text: str | None = None

    def on_batch(self, micro_step: int, device: Any) -> bool:
        """Call at the start of every micro-batch; returns True when it just wrote the snapshot."""
        if micro_step == self.first and self._device is None:
            self._start(device)
        elif micro_step == self.stop_at and self._device is not None:
            return self.close()
        return False

    def _start(self, device: Any) -> None:
        if getattr(device, "type", "") != "cuda":
            log.info("logging.memory_snapshot_at: the run is not on a CUDA device; no memory snapshot")
            return
        try:
            # Python frames only: symbolising C++ stacks ("all") can take minutes at a full-size step's allocations
            self._mem()._record_memory_history(enabled="all", stacks="python", device=device)
            self._device = device
        except Exception as e:  # noqa: BLE001 - a diagnostic; the run it observes goes on
            log.warning("memory snapshot not recorded: %s: %s", type(e).__name__, e)

    def close(self) -> bool:
        """Write the snapshot and its summary and stop recording; False where nothing was recording."""
        if self._device is None:
            return False
        mem, device, self._device = self._mem(), self._device, None
        try:
            snapshot = mem._snapshot(device)
            mem._record_memory_history(enabled=None, device=device)
            self.out_dir.mkdir(parents=True, exist_ok=True)
            path = self.out_dir / f"snapshot-rank{self.rank}.pickle"
            with open(path, "wb") as f:
                pickle.dump(snapshot, f)
            index = getattr(device, "index", None) or 0
            traces = snapshot.get("device_traces", [])
            self.text = summary(self.at, traces[index] if index < len(traces) else [])
            segments = [seg for seg in snapshot.get("segments", []) if seg.get("device", index) == index]
            self.text += "\n" + reserve_text(segments)
            (self.out_dir / f"peak-rank{self.rank}.txt").write_text(self.text + "\n")
            log.info("%s\n(snapshot %s: open it at https://pytorch.org/memory_viz)", self.text, path)
            return True
        except Exception as e:  # noqa: BLE001 - see _start
            log.warning("memory snapshot not written: %s: %s", type(e).__name__, e)
            return False

    def _mem(self) -> Any:
        if self._memory is None:
            import torch

            self._memory = torch.cuda.memory
        return self._memory
