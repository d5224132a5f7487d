"""Watchdogs that turn a bad run into one actionable message: a loss that went NaN/inf, steps that got slow.

Why: sd-scripts keeps training on a NaN loss (the LoRA is ruined from then on and every later save is junk) and
says nothing when the card throttles. Both return a message instead of logging or raising, so the caller
decides (warn once, stop the run); both take plain floats the loop already has, so they cost no device sync.
"""

from __future__ import annotations

import math
import statistics
from collections import deque

from flux_trainer.metrics.nvml import NvmlReader

LOSS_CAUSES = (
    "learning rate too high (lower it, or use an adaptive optimizer such as Prodigy with lr 1)",
    "fp16 overflow (train in bf16 on cards that have it: Ampere and newer)",
    "a bad image or caption in the dataset (corrupt file, empty or extremely long caption)",
    "fp8 base weights without scaling (use a scaled fp8 checkpoint or train the base in bf16)",
)


class LossGuard:
    """Reports a non-finite loss after ``patience`` consecutive bad steps (one bad step can be a fluke that
    the optimizer skips, e.g. under fp16 loss scaling; several in a row mean the run is broken)."""

    def __init__(self, patience: int = 3) -> None:
        if patience < 1:
            raise ValueError(f"patience must be >= 1, got {patience}")
        self.patience = patience
        self.bad_steps = 0
        self.first_bad_step: int | None = None

    def check(self, loss: float, step: int) -> str | None:
        """Pass the loss sd-scripts already read with ``.item()``. Returns a message once per streak, at the
        ``patience``-th consecutive non-finite loss; None otherwise. A finite loss resets the streak."""
        value = float(loss)
        if math.isfinite(value):
            self.bad_steps, self.first_bad_step = 0, None
            return None
        self.bad_steps += 1
        if self.first_bad_step is None:
            self.first_bad_step = step
        if self.bad_steps != self.patience:
            return None
        causes = "; ".join(LOSS_CAUSES)
        return (
            f"loss is {value} at step {step} ({self.bad_steps} consecutive non-finite steps since step "
            f"{self.first_bad_step}); LoRA files saved before step {self.first_bad_step} are unaffected. "
            f"Likely causes: {causes}."
        )


class SlowdownDetector:
    """Warns when steps become much slower than usual: ``factor`` x the median of the last ``window`` step
    times, for ``consecutive`` steps in a row (a single slow step is a save or a sample, not a problem).

    The median rather than the mean, so that the occasional save/sample spike does not move the baseline.
    Slow steps still enter the window: a lasting slowdown becomes the new normal after ~window/2 steps, and
    the warning is given once per streak.
    """

    def __init__(
        self,
        window: int = 50,
        factor: float = 2.0,
        consecutive: int = 3,
        min_history: int = 10,
        nvml: NvmlReader | None = None,
    ) -> None:
        if window < 1 or consecutive < 1 or factor <= 1.0:
            raise ValueError(f"need window >= 1, consecutive >= 1, factor > 1; got {window}, {consecutive}, {factor}")
        self.factor = factor
        self.consecutive = consecutive
        self.min_history = min(min_history, window)
        self.nvml = nvml
        self._history: deque[float] = deque(maxlen=window)
        self._streak = 0
        self._streak_median = 0.0

    def observe(self, step_s: float, step: int) -> str | None:
        """Feed one step time (``time/step_s``); returns a warning at the ``consecutive``-th slow step."""
        message = None
        if len(self._history) >= self.min_history:
            median = statistics.median(self._history)
            if step_s > self.factor * median:
                self._streak += 1
                if self._streak == 1:
                    self._streak_median = median
                if self._streak == self.consecutive:
                    message = self._message(step_s, step)
            else:
                self._streak = 0
        self._history.append(float(step_s))
        return message

    def _message(self, step_s: float, step: int) -> str:
        median = self._streak_median
        text = (
            f"step {step} took {step_s:.3f} s, {step_s / median:.1f}x the median {median:.3f} s of the last "
            f"{len(self._history)} steps, for {self._streak} steps in a row."
        )
        gpu = self.nvml.read() if self.nvml is not None else {}
        if gpu:
            parts = []
            if "gpu/sm_clock_mhz" in gpu:
                clock = f"SM clock {gpu['gpu/sm_clock_mhz']:.0f} MHz"
                top = self.nvml.max_sm_clock_mhz() if self.nvml is not None else None
                parts.append(f"{clock} of {top:.0f}" if top else clock)
            if "gpu/temp_c" in gpu:
                parts.append(f"{gpu['gpu/temp_c']:.0f} C")
            if "gpu/power_w" in gpu:
                parts.append(f"{gpu['gpu/power_w']:.0f} W")
            if "gpu/util_pct" in gpu:
                parts.append(f"utilisation {gpu['gpu/util_pct']:.0f}%")
            text += " GPU: " + ", ".join(parts) + "."
        return text + (
            " Likely: thermal or power throttling (clock well below its maximum), another process on the GPU, "
            "the data loader falling behind (see time/data_s), or the host swapping (see host/ram_gib)."
        )
