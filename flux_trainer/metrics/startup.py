"""Where a run's start-up went: the seconds from the `flux-train` command to the end of the first step, by phase.

A warm start on a lent H200 took ~35-50 s before the first step, and the log did not say where: the launcher,
accelerate's launcher (unless launcher.direct starts the training process itself) and the training process each
start Python and import torch, sd-scripts loads the model, the caches are checked, the kernels probe, accelerate moves
the model to the device, the blocks compile. The launcher passes its times to the training process (its own process
start, the moment it started the next process, and what that process is); the training process marks the end of each
phase it goes through and, after its first step, logs one line and writes it to TensorBoard (`run/startup`, and
`time/startup_s` at the first step).

Wall-clock times (time.time) so that the processes' marks compare on one machine. A launcher time from another host
(a cluster launch) can be skewed: such times, later than this process's start, are dropped and the line starts at this
process's start.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

LAUNCHED_AT_ENV = "FLUX_TRAIN_LAUNCHED_AT"  # the flux-train command's process start (epoch seconds)
SPAWNED_AT_ENV = "FLUX_TRAIN_SPAWNED_AT"  # when the launcher started the training process (or accelerate's launcher)
SPAWNED_VIA_ENV = "FLUX_TRAIN_SPAWNED_VIA"  # the name of the phase from there to the training process's start
SKEW_S = 0.05  # a process start read this much before its spawn is the clock ticks' rounding, not another clock


def process_started_at(pid: int | str = "self") -> float | None:
    """When the process started, as epoch seconds (10 ms resolution; Linux only, else None): its start in clock
    ticks after boot (/proc/PID/stat, field 22) against the boot clock now."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # the name in parentheses may hold spaces
        ticks = int(fields[19])  # field 22; the list starts at field 3
        since_boot = time.clock_gettime(time.CLOCK_BOOTTIME)
        now = time.time()
        return now - (since_boot - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, IndexError, ValueError, AttributeError):
        return None


_launches = 0  # runs this process has started: a sweep's later runs begin where their own job began


def launch_env(began_at: float, spawned_at: float | None = None, via: str = "accelerate launch") -> dict[str, str]:
    """The variables the launcher adds to the training process's environment, just before starting it. The command
    began at this process's start for its first run; a later run (a sweep's next job) at `began_at`. `via`: what runs
    between the spawn and the training process's start (accelerate's launcher, or nothing but the process start)."""
    global _launches
    _launches += 1
    started = process_started_at() if _launches == 1 else began_at
    env = {SPAWNED_AT_ENV: f"{time.time() if spawned_at is None else spawned_at:.3f}", SPAWNED_VIA_ENV: via}
    env[LAUNCHED_AT_ENV] = f"{began_at if started is None else started:.3f}"
    return env


@dataclass
class StartupClock:
    """Phases as marks: each mark is the end of the phase it names; a phase lasts from the previous mark (or the
    start) to its own. A phase marked twice keeps its first mark (a hook that runs again later in the run)."""

    start: float
    marks: list[tuple[str, float]] = field(default_factory=list)
    clock: Callable[[], float] = time.time

    @classmethod
    def from_env(
        cls,
        env: Mapping[str, str] | None = None,
        started_at: float | None = None,
        clock: Callable[[], float] = time.time,
    ) -> StartupClock:
        """This process's clock, begun at the flux-train command when the launcher said when that was. The
        launcher's phase ends when it started the next process (accelerate's launcher, or this one); the next, when
        this process started."""
        env = os.environ if env is None else env
        own = started_at if started_at is not None else process_started_at()
        own = clock() if own is None else own
        launched, spawned = _epoch(env.get(LAUNCHED_AT_ENV)), _epoch(env.get(SPAWNED_AT_ENV))
        if spawned is None or spawned > own + SKEW_S or (launched is not None and launched > spawned):
            return cls(start=own, clock=clock)  # started by hand, or times from another host's clock
        own = max(own, spawned)  # a process started directly: its start is read in 10 ms clock ticks
        via = env.get(SPAWNED_VIA_ENV) or "accelerate launch"
        if launched is None:  # a launcher that could not read its own start: its phase is unknown
            return cls(start=spawned, marks=[(via, own)], clock=clock)
        return cls(start=launched, marks=[("flux-train", spawned), (via, own)], clock=clock)

    def mark(self, phase: str, at: float | None = None) -> None:
        if all(name != phase for name, _ in self.marks):
            self.marks.append((phase, self.clock() if at is None else at))

    def phases(self) -> list[tuple[str, float]]:
        out, last = [], self.start
        for name, at in self.marks:
            out.append((name, max(at - last, 0.0)))
            last = max(last, at)
        return out

    def total(self) -> float:
        return max((at for _, at in self.marks), default=self.start) - self.start

    def line(self) -> str:
        """ "start-up 38.9 s to the first step's end: flux-train 4.1 s, accelerate launch 3.0 s, ...", the phases in
        their order; those under 0.05 s left out."""
        parts = ", ".join(f"{name} {s:.1f} s" for name, s in self.phases() if s >= 0.05)
        return f"start-up {self.total():.1f} s to the first step's end: {parts}"


def _epoch(value: str | None) -> float | None:
    try:
        return float(value) if value else None
    except ValueError:
        return None
