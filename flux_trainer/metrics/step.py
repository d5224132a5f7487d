"""Per-step scalars for TensorBoard: VRAM, step and data-wait time, throughput, MFU, NVML readings, host RAM.

Used from inside sd-scripts' loop: our trainer subclass calls ``mark_data_ready()`` when a batch arrives and
``on_step_end(global_step)`` after each optimizer step, and merges the returned dict into the ``logs`` that
sd-scripts' ``step_logging`` hands to ``accelerator.log`` - so our tags land in the same TensorBoard run as
``loss/*`` and ``lr/*``.

Nothing here synchronises the device (no ``torch.cuda.synchronize``, no ``.item()``): a sync per step would
cost throughput to measure throughput. sd-scripts' loop waits for the GPU once every step before logging: for the
whole step (its ``loss.detach().item()``), or with ``train.sync_free`` for that step's forward only (the loss's
copy, flux_trainer.sdscripts.step_values). Either way each step end is paced by the device, so wall-clock time
between successive ``on_step_end`` calls is the real step time (averaged over steps; with sync_free a single
reading can move by how much of the step the host ran ahead). It includes whatever sd-scripts does between steps
(sampling, saving), which then shows up as a spike, as it should.
"""

from __future__ import annotations

import collections
import os
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

from flux_trainer.metrics.flops import mfu
from flux_trainer.metrics.nvml import NvmlReader

GIB = float(1 << 30)
ENERGY_WINDOW = 10  # logs that gpu/energy_j_per_step averages over
VRAM_TAGS = (
    "vram/allocated_gib",
    "vram/reserved_gib",
    "vram/peak_gib",
    "vram/reserved_peak_gib",
    "vram/alloc_retries",
)


class StepMetrics:
    """Measures training steps; one instance per process, created once the device is known.

    ``flops_per_step`` and ``images_per_step`` are per process (per GPU): pass batch size x gradient
    accumulation, and ``flux_step_flops(...).total`` times accumulation. Throughput tags are therefore per GPU;
    MFU is per GPU by definition. With ``processes`` > 1, ``throughput/images_per_s_all_ranks`` is this process's
    images/s times the process count: data-parallel processes step together (they meet at the gradient all-reduce
    every step), so one process's step time is everyone's. ``peak_tflops=None`` (a card not in the peak table)
    leaves ``throughput/mfu`` out.

    On a device that is not CUDA, the ``vram/*`` tags are 0.0 (there is no device allocator to ask), and there
    are no ``gpu/*`` tags. With ``log_every=N`` only every N-th step returns tags (the others return ``{}``
    after one clock read); ``time/*`` and throughput are then means over the N steps, ``vram/peak_gib`` the
    peak over them, ``vram/alloc_retries`` the count over them: how often PyTorch's allocator found no free
    block, released its whole cache to the driver and tried again (a device sync and a stall each time; more than
    0 means the card is at its memory limit and the steps are slower for it).

    Timing: the first ``on_step_end`` has nothing to measure from unless ``start()`` was called, so it returns
    no ``time/*`` or throughput tags (that step also carries warm-up and compilation, which would mislead).
    ``time/data_s`` is the wait from one step's end to the next ``mark_data_ready()``; with gradient
    accumulation only the first micro-batch's wait is seen.
    """

    def __init__(
        self,
        device: torch.device | str | int,
        flops_per_step: float,
        images_per_step: float,
        peak_tflops: float | None = None,
        *,
        enabled: bool = True,
        clock: Callable[[], float] = time.perf_counter,
        nvml: NvmlReader | None | str = "auto",
        log_every: int = 1,
        processes: int = 1,
    ) -> None:
        if log_every < 1:
            raise ValueError(f"log_every must be >= 1, got {log_every}")
        self.device = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
        self.flops_per_step = float(flops_per_step)
        self.images_per_step = float(images_per_step)
        self.processes = int(processes)
        self.peak_tflops = peak_tflops
        self.enabled = enabled
        self.log_every = log_every
        self._clock = clock
        self._is_cuda = self.device.type == "cuda"
        if nvml == "auto":
            nvml = NvmlReader(self.device.index or 0) if self._is_cuda and enabled else None
        elif isinstance(nvml, str):
            raise ValueError(f"nvml must be 'auto', None or an NvmlReader, got {nvml!r}")
        self.nvml: NvmlReader | None = nvml
        self._process: Any = None
        self._t_ref: float | None = None  # last step end (or start())
        self._t_log: float | None = None  # last time tags were returned
        self._steps = 0
        self._data_s = 0.0
        self._waiting_for_data = False
        self._retries = 0  # the allocator's cumulative num_alloc_retries at the last log
        # (steps counted so far, the card's energy counter) at start() and the last ENERGY_WINDOW logs
        self._energy: collections.deque[tuple[int, float]] = collections.deque(maxlen=ENERGY_WINDOW + 1)
        self._steps_total = 0

    def start(self) -> None:
        """Mark the start of the loop, so the first step gets a time too."""
        if self.enabled:
            self._t_ref = self._t_log = self._clock()
            self._waiting_for_data = True
            self._energy.clear()
            if self.nvml is not None and (energy := self.nvml.energy_j()) is not None:
                self._energy.append((0, energy))

    def mark_data_ready(self) -> None:
        """Call when the batch is in hand: the time since the last step end counts as data wait."""
        if not self.enabled or self._t_ref is None or not self._waiting_for_data:
            return
        self._data_s += self._clock() - self._t_ref
        self._waiting_for_data = False

    def skip_since_step_end(self) -> None:
        """The time since the last step's end was spent outside training (sd-scripts' validation loss): the next
        step's time and data wait start from now, as if that time had not passed."""
        if not self.enabled or self._t_ref is None:
            return
        away = self._clock() - self._t_ref
        self._t_ref += away
        if self._t_log is not None:
            self._t_log += away

    def on_step_end(self, global_step: int) -> dict[str, float]:
        """Call after each optimizer step; returns the tags to merge into sd-scripts' ``logs``."""
        if not self.enabled:
            return {}
        now = self._clock()
        if self._t_ref is None:
            self._t_log = now
        else:
            self._steps += 1
            self._steps_total += 1
        self._t_ref = now
        self._waiting_for_data = True
        if global_step % self.log_every:
            return {}

        tags = self._vram()
        if self._steps > 0 and self._t_log is not None and now > self._t_log:
            step_s = (now - self._t_log) / self._steps
            tflops = self.flops_per_step / step_s / 1e12
            tags["time/step_s"] = step_s
            tags["time/data_s"] = self._data_s / self._steps
            tags["throughput/images_per_s"] = self.images_per_step / step_s
            if self.processes > 1:
                tags["throughput/images_per_s_all_ranks"] = self.processes * self.images_per_step / step_s
            tags["throughput/tflops"] = tflops
            if self.peak_tflops:
                tags["throughput/mfu"] = mfu(tflops, self.peak_tflops)
        if self.nvml is not None:
            tags.update(self.nvml.read())
            tags.update(self._energy_per_step())
        tags["host/ram_gib"] = self._rss_gib()
        self._t_log, self._steps, self._data_s = now, 0, 0.0
        return tags

    def _energy_per_step(self) -> dict[str, float]:
        """`gpu/energy_j_per_step`: the card's joules a step over the last ENERGY_WINDOW logs (its energy counter's
        rise over the steps between). A card at its power limit is as fast as its steps are frugal, so this, beside
        time/step_s, says whether a change made the step cheaper. Over a window, not one step: NVML's counter
        advances in coarse increments (one step's reading was 14% off the run's mean on an H200), and the host's step
        boundaries are not the device's."""
        energy = self.nvml.energy_j() if self.nvml is not None else None
        if energy is None:
            self._energy.clear()
            return {}
        if self._energy and energy < self._energy[-1][1]:  # the counter went back (a driver reload): start again
            self._energy.clear()
        self._energy.append((self._steps_total, energy))
        (steps0, energy0), (steps1, energy1) = self._energy[0], self._energy[-1]
        return {"gpu/energy_j_per_step": (energy1 - energy0) / (steps1 - steps0)} if steps1 > steps0 else {}

    def _vram(self) -> dict[str, float]:
        if not self._is_cuda:
            return dict.fromkeys(VRAM_TAGS, 0.0)
        dev = self.device
        # one read of the allocator's own dict: memory_allocated / memory_reserved / max_memory_allocated would each
        # flatten and sort all of it (H200 profile: ~1.8 ms a step, while the device waited for the next step)
        stats = torch.cuda.memory_stats_as_nested_dict(dev)
        allocated, reserved = stats.get("allocated_bytes", {}).get("all", {}), stats.get("reserved_bytes", {})
        tags = {
            "vram/allocated_gib": allocated.get("current", 0) / GIB,
            "vram/reserved_gib": reserved.get("all", {}).get("current", 0) / GIB,
            "vram/peak_gib": allocated.get("peak", 0) / GIB,
            # the allocator's reserve at its peak: the card's peak less this is the CUDA context and what PyTorch's
            # allocator does not hold (libraries' own allocations, loaded kernels)
            "vram/reserved_peak_gib": reserved.get("all", {}).get("peak", 0) / GIB,
        }
        # not reset by the reset_peak_memory_stats below, hence the difference
        retries = int(stats.get("num_alloc_retries", 0))
        tags["vram/alloc_retries"] = float(retries - self._retries)
        self._retries = retries
        torch.cuda.reset_peak_memory_stats(dev)  # so the next peak is the peak since this log
        return tags

    def _rss_gib(self) -> float:
        if self._process is None:
            import psutil

            self._process = psutil.Process(os.getpid())
        return self._process.memory_info().rss / GIB

    def close(self) -> None:
        """Release NVML."""
        if self.nvml is not None:
            self.nvml.close()


def reduce_max_across_ranks(values: Mapping[str, float], accelerator: Any) -> dict[str, float]:
    """Replace the ``vram/*`` tags with their maximum over all processes; other tags are returned as they are.

    Why: rank 0 writes TensorBoard, but the rank that runs out of memory may be another one. The cost is one
    ``gather`` collective plus one device-to-host copy per call, so call it only on logging steps (``log_every``),
    and only with more than one process (otherwise it returns at once, without any collective).

    Every rank must call it at the same steps, with the same tags: it is a collective and would hang otherwise.
    sd-scripts calls ``step_logging`` on the main process only (trackers exist only there), so call this from a
    hook that runs on all ranks, not from ``step_logging``.
    """
    out = dict(values)
    if getattr(accelerator, "num_processes", 1) <= 1:
        return out
    keys = sorted(k for k in out if k.startswith("vram/"))
    if not keys:
        return out
    local = torch.tensor([out[k] for k in keys], dtype=torch.float32, device=accelerator.device)
    gathered = accelerator.gather(local).reshape(-1, len(keys))
    for key, value in zip(keys, gathered.max(dim=0).values.tolist(), strict=True):
        out[key] = float(value)
    return out
