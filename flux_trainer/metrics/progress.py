"""What the training process tells the terminal, and how the launcher shows it.

The training process writes sd-scripts' whole output to train.log; the terminal gets only what flux-train means a
user to read there. The process marks those lines: `SAY` lines (a message: resumed at step k, stopping after this
step ...) and `PROGRESS` lines (after each step: step, total, loss, s/step, peak memory; before the first step: the
phase it is in). The launcher (flux_trainer.launch.supervise) takes the marked lines out of the stream, prints the
messages, and keeps one progress line up to date: redrawn in place on a terminal, a line every 10% elsewhere (a
pipe, CI). With -v everything is shown as it comes, as before. The marked lines travel on a pipe of their own
(`FLUX_TRAIN_PROGRESS_FD`), so they never share a line with a progress bar's redraws; without it, on stdout.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import TextIO

SAY = "[flux-train:say] "
PROGRESS = "[flux-train:progress] "
FD_ENV = "FLUX_TRAIN_PROGRESS_FD"  # a pipe of its own from the launcher: marked lines never meet tqdm's redraws
_channel: TextIO | None = None


def _out(stream: TextIO | None) -> TextIO:
    """Where marked lines go: `stream`, else the launcher's pipe ($FLUX_TRAIN_PROGRESS_FD), else stdout."""
    global _channel
    if stream is not None:
        return stream
    if _channel is None and os.environ.get(FD_ENV, "").isdigit():
        try:
            _channel = os.fdopen(int(os.environ[FD_ENV]), "w", buffering=1, encoding="utf-8", closefd=False)
        except OSError:  # not passed down to this process (accelerate's launcher closes it): stdout
            os.environ.pop(FD_ENV, None)
    return _channel or sys.stdout


def _write(line: str, stream: TextIO | None) -> None:
    out = _out(stream)
    try:
        out.write(line + "\n")
        out.flush()
    except OSError:  # the launcher is gone: the log is what remains
        pass


def say(text: str, stream: TextIO | None = None) -> None:
    """A message for the terminal, from the training process (one line)."""
    _write(SAY + " ".join(str(text).split()), stream)


def progress(stream: TextIO | None = None, **values: object) -> None:
    """One progress record from the training process: step/total/loss/step_s/peak_gib, or phase."""
    _write(PROGRESS + json.dumps({k: v for k, v in values.items() if v is not None}), stream)


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60:02d} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"


@dataclass
class ProgressView:
    """The launcher's side: turns the marked lines into a progress line and messages on `echo`."""

    echo: TextIO | None
    tty: bool = False
    draw: bool = True  # the progress line (off with -v: sd-scripts' own progress bar is shown)
    started: float = field(default_factory=time.monotonic)
    step: int = 0
    total: int = 0
    first_step: int | None = None  # the first step this run trained (a resumed run starts past 1)
    loss: float | None = None
    step_times: list[float] = field(default_factory=list)
    peak_gib: float | None = None
    phase: str = ""
    _shown_tenth: int = -1
    _drawn: bool = False

    def handle(self, line: str) -> bool:
        """Take a marked line (True), or leave it (False)."""
        if line.startswith(SAY):
            self._message(line[len(SAY) :])
            return True
        if not line.startswith(PROGRESS):
            return False
        try:
            record = json.loads(line[len(PROGRESS) :])
        except ValueError:
            return True
        if "phase" in record:
            self.phase = str(record["phase"])
            self._draw(f"preparing: {self.phase}")
            return True
        self.step, self.total = int(record.get("step", self.step)), int(record.get("total", self.total) or 0)
        if self.first_step is None:
            self.first_step = self.step
        if record.get("loss") is not None:
            self.loss = float(record["loss"])
        if record.get("step_s") is not None:
            self.step_times.append(float(record["step_s"]))
        if record.get("peak_gib") is not None:
            self.peak_gib = max(self.peak_gib or 0.0, float(record["peak_gib"]))
        self._draw(self.line())
        return True

    def s_per_step(self) -> float | None:
        """The median of the later half of the step times (the first steps compile and warm up)."""
        if not self.step_times:
            return None
        return statistics.median(self.step_times[len(self.step_times) // 2 :])

    def line(self) -> str:
        parts = [f"step {self.step}/{self.total}" if self.total else f"step {self.step}"]
        if self.loss is not None:
            parts.append(f"loss {self.loss:.4f}")
        if (s := self.s_per_step()) is not None:
            parts.append(f"{s:.2f} s/step")
            if self.total and self.step < self.total:
                parts.append(f"{_duration(s * (self.total - self.step))} left")
        if self.peak_gib:
            parts.append(f"peak {self.peak_gib:.1f} GiB")
        return "  ".join(parts)

    def summary(self) -> str:
        """Steps, s/step and peak memory of what this run trained, for the last line."""
        if self.first_step is None:
            return ""
        steps = f"steps {self.first_step}-{self.step}" if self.first_step > 1 else f"{self.step} steps"
        parts = [steps]
        if (s := self.s_per_step()) is not None:
            parts.append(f"{s:.2f} s/step")
        if self.peak_gib:
            parts.append(f"peak {self.peak_gib:.1f} GiB")
        return ", ".join(parts)

    def _message(self, text: str) -> None:
        self.finish_line()
        self._write(f"flux-train: {text}\n")

    def _draw(self, text: str) -> None:
        if self.echo is None or not self.draw:
            return
        if self.tty:
            self._write("\r\x1b[2K" + text)
            self._drawn = True
            return
        tenth = (10 * self.step // self.total) if self.total else -1
        if text.startswith("preparing:") or tenth != self._shown_tenth or self.step == self.total:
            if not text.startswith("preparing:"):
                self._shown_tenth = tenth
            self._write(text + "\n")

    def finish_line(self) -> None:
        """End a progress line drawn in place, so the next output starts on a line of its own."""
        if self._drawn and self.echo is not None:
            self._write("\n")
        self._drawn = False

    def _write(self, text: str) -> None:
        if self.echo is None:
            return
        try:
            self.echo.write(text)
            self.echo.flush()
        except (OSError, ValueError):
            self.echo = None
