"""The one place flux-train starts a process: the training child, supervised.

The child gets an argument list (never a shell, so no argument is ever interpreted) and its own session, so a
terminal's Ctrl-C reaches only us and we decide what the child gets: first Ctrl-C -> SIGINT to its whole process
group (accelerate, torchrun and every rank) and wait for it to stop; second -> SIGTERM; third -> SIGKILL. A single
training process (`graceful`) gets the first Ctrl-C or SIGTERM alone: it finishes its step, saves a state and
stops (flux_trainer.sdscripts.continuation); the ladder goes on from SIGTERM to the group. Its
combined output streams to the screen and is appended to train.log as it arrives ('\\r' progress bars included).
Our exit code is the child's, signals as 128+N like a shell. On failure, the end of the log and a likely cause.
"""

from __future__ import annotations

import codecs
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TextIO

from flux_trainer.launch.failure import explain_failure, killed_message, oom_kill_count
from flux_trainer.metrics.progress import FD_ENV, PROGRESS, SAY, ProgressView

__all__ = ["explain_failure", "run_supervised"]

_LADDER = (signal.SIGINT, signal.SIGTERM, signal.SIGKILL)  # Ctrl-C once, twice, three times
_TAIL_LINES = 200  # kept for explain_failure
_SHOWN_LINES = 20  # printed after a failure
_TAIL_CHARS = 65536  # longest unfinished line kept


class _Tee:
    """Writes the child's output to the log and (unless quiet) the screen; keeps the last lines for explain_failure.
    Lines the child marked for the terminal (flux_trainer.metrics.progress) go to `view` instead: its messages are
    shown and logged, its progress records drawn as one line and not logged."""

    def __init__(self, log: TextIO, echo: TextIO | None, view: ProgressView | None = None, quiet: bool = False):
        self.log, self.echo, self.view, self.quiet = log, echo, view, quiet
        self.lock = threading.RLock()
        self.tail: deque[str] = deque(maxlen=_TAIL_LINES)
        self._partial = ""
        self._pending = ""  # the start of a line that may be a marked one
        self._last_was_cr = False

    def write(self, text: str) -> None:
        with self.lock:
            if self.view is None:
                self._raw(text)
                return
            self._pending += text
            while (m := re.search(r"[\r\n]", self._pending)) is not None:
                piece, self._pending = self._pending[: m.end()], self._pending[m.end() :]
                self._piece(piece)
            if self._pending and not any(p.startswith(self._pending[: len(p)]) for p in (SAY, PROGRESS)):
                self._raw(self._pending)  # an unfinished line that is no marker (a progress bar): as it comes
                self._pending = ""

    def _piece(self, piece: str) -> None:
        if not self.marked(piece.rstrip("\r\n")):
            self._raw(piece)

    def marked(self, line: str) -> bool:
        """A line the child marked for the terminal: its message logged and shown, its progress shown (True)."""
        with self.lock:
            if self.view is None or not line.startswith((SAY, PROGRESS)):
                return False
            if line.startswith(SAY):
                self._log(f"flux-train: {line[len(SAY) :]}\n")
                self.tail.append(f"flux-train: {line[len(SAY) :]}")
            return self.view.handle(line)

    def _log(self, text: str) -> None:
        self.log.write(text)
        self.log.flush()

    def _raw(self, text: str) -> None:
        self._log(text)
        if self.echo is not None and not self.quiet:
            try:
                self.echo.write(text)
                self.echo.flush()
            except (OSError, ValueError):  # terminal gone (SIGHUP) or closed: keep logging
                self.echo = None
        for piece in re.split(r"(?<=[\r\n])", text):
            if not piece:
                continue
            self._partial += piece
            if piece[-1] in "\r\n":
                self._end_line(self._partial[:-1], carriage=piece[-1] == "\r")
                self._partial = ""
        self._partial = self._partial[-_TAIL_CHARS:]  # output without line ends must not grow without bound

    def _end_line(self, line: str, *, carriage: bool) -> None:
        # A '\r' line is a progress bar redraw: it replaces the previous redraw instead of filling the tail.
        if self._last_was_cr and self.tail:
            self.tail.pop()
        if line or not carriage:
            self.tail.append(line)
        self._last_was_cr = carriage and bool(line)

    def flush(self) -> None:
        """The child has ended: a last unfinished line goes out as it is, a progress line drawn in place ends."""
        with self.lock:
            if self._pending:
                self._piece(self._pending)
                self._pending = ""
            if self.view is not None:
                self.view.finish_line()

    def lines(self) -> list[str]:
        with self.lock:
            return [*self.tail, self._partial] if self._partial else list(self.tail)

    def show(self, text: str) -> None:
        """flux-train's own output (not the child's): in the log and on the screen, quiet or not."""
        with self.lock:
            self._log(text)
            if self.view is not None:
                self.view.finish_line()
            if self.echo is not None:
                try:
                    self.echo.write(text)
                    self.echo.flush()
                except (OSError, ValueError):
                    self.echo = None

    def say(self, message: str) -> None:
        """A flux-train message (not the child's) on the screen and in the log."""
        self.show(f"flux-train: {message}\n")


def _pump_marks(fd: int, tee: _Tee) -> None:
    """The child's marked lines (messages, progress), from their own pipe, line by line."""
    with os.fdopen(fd, "r", encoding="utf-8", errors="replace") as marks:
        for line in marks:
            tee.marked(line.rstrip("\n"))


def _pump(fd: int, tee: _Tee) -> None:
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    while True:
        try:
            chunk = os.read(fd, 65536)
        except InterruptedError:
            continue
        except OSError:
            break
        if not chunk:
            break
        tee.write(decoder.decode(chunk))
    rest = decoder.decode(b"", final=True)
    if rest:
        tee.write(rest)


def run_supervised(
    cmd: list[str],
    env: Mapping[str, str] | None,
    log_path: Path,
    *,
    cwd: Path | None = None,
    echo: TextIO | None = None,
    memory_tier: str | None = None,
    linger_s: float = 30.0,
    exit_code: Callable[[int], int] | None = None,
    pass_fds: tuple[int, ...] = (),
    graceful: bool = False,
    reason: Callable[[int], str | None] | None = None,
    view: ProgressView | None = None,
    quiet: bool = False,
) -> int:
    """Run `cmd` to the end and return its exit code (128+N when killed by signal N, 127 when it cannot start).

    `env` is the child's whole environment (None: ours). `echo` defaults to sys.stdout at call time. Ctrl-C
    forwarding needs the main thread (Python delivers signals there); from another thread the child still runs and
    is waited for, without forwarding. When the child has exited but something it started still holds the output
    open for `linger_s` with no Ctrl-C from the user, the group is terminated so a leaked worker cannot hang us.
    `memory_tier` (the resolved memory preset) makes an out-of-memory explanation name the next smaller preset.
    `exit_code` maps the launcher's code to the training process's own (accelerate reports every failure as 1) before
    it is reported and returned. `pass_fds`: descriptors the child keeps (a lock it must hold while it lives).
    `graceful`: the child is one training process that finishes its step and saves a state on SIGINT; the first
    Ctrl-C goes to it alone (not its data-loader workers, which would die mid-step). `reason(code)`: the child's own
    one-line account of how it ended (interrupted at step k, disk full ...), said instead of the log's tail.
    `view`: shows the lines the child marked for the terminal (its messages, one progress line); `quiet`: the child's
    other output goes to the log alone (shown again, its last lines, if the run fails).
    """
    if isinstance(cmd, (str, bytes)) or not cmd:
        raise TypeError("run_supervised takes a non-empty argument list, never a shell string")
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "a", encoding="utf-8", errors="replace", newline="") as log:
        tee = _Tee(log, sys.stdout if echo is None else echo, view, quiet)
        state: dict = {"step": 0, "proc": None, "pending": None, "graceful": graceful}
        oom_before = oom_kill_count()
        marks = os.pipe() if view is not None else None  # the child's marked lines, apart from its output
        if marks is not None:
            env = {**(os.environ if env is None else env), FD_ENV: str(marks[1])}
            pass_fds = (*pass_fds, marks[1])

        def forward(sig: int) -> None:
            step = min(state["step"], len(_LADDER) - 1)
            if sig != signal.SIGINT and not (graceful and step == 0):  # SIGTERM/SIGHUP: at least SIGTERM
                step = max(step, 1)
            state["step"] = step + 1
            _send(state, _LADDER[step], tee)  # graceful: the first, whichever it was, is a stop after the step

        previous = {}
        if threading.current_thread() is threading.main_thread():
            for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                previous[s] = signal.signal(s, lambda signum, frame: forward(signum))
        try:
            try:
                proc = subprocess.Popen(
                    cmd,
                    env=None if env is None else dict(env),
                    cwd=cwd,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    pass_fds=pass_fds,
                )
            except OSError as e:
                for fd in marks or ():
                    os.close(fd)
                tee.say(f"cannot start {cmd[0]}: {e}")
                return 126 if isinstance(e, PermissionError) else 127
            state["proc"] = proc
            if marks is not None:
                os.close(marks[1])  # the child holds the write end: the pipe ends when the child does
                marker_reader = threading.Thread(target=_pump_marks, args=(marks[0], tee), daemon=True)
                marker_reader.start()
            if state["pending"] is not None:  # a signal came while starting: deliver it now
                _send(state, state["pending"], tee)
            reader = threading.Thread(target=_pump, args=(proc.stdout.fileno(), tee), daemon=True)
            reader.start()
            rc = proc.wait()
            _drain(reader, proc.pid, state, linger_s, tee)
            proc.stdout.close()
            if marks is not None:
                marker_reader.join(5.0)
            tee.flush()
        finally:
            for s, h in previous.items():
                signal.signal(s, h)
        code = 128 - rc if rc < 0 else rc
        code = exit_code(code) if exit_code is not None else code
        known = reason(code) if reason is not None and code != 0 else None
        if code != 0 and known:
            tee.say(f"{known} (exit code {code}; the log is {log_path})")
        elif code != 0 and state["step"]:
            # Stopped on request: launchers turn that into exit 1 and a traceback; no failure to explain.
            tee.say(f"training stopped on request (exit code {code}); the log is {log_path}")
        elif code != 0:
            _report_failure(tee, code, log_path, memory_tier, oom=(oom_before, oom_kill_count()))
        return code


def _send(state: dict, sig: int, tee: _Tee) -> None:
    proc = state["proc"]
    if proc is None:
        state["pending"] = sig
        return
    if sig == signal.SIGINT and state.get("graceful"):  # the child says it stops after the step (continuation)
        try:
            os.kill(proc.pid, sig)  # the training process alone: its data-loader workers carry on to the step's end
        except ProcessLookupError:
            pass
        return
    hint = {signal.SIGINT: " (Ctrl-C again to terminate)", signal.SIGTERM: " (Ctrl-C again to kill)"}.get(sig, "")
    tee.say(f"sending {signal.Signals(sig).name} to the training processes{hint}")
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


def _drain(reader: threading.Thread, pgid: int, state: dict, linger_s: float, tee: _Tee) -> None:
    """Wait for the output to end; if a leftover process holds it open unasked, terminate the group."""
    deadline = time.monotonic() + linger_s
    sent: list[int] = []
    while reader.is_alive():
        reader.join(0.1)
        if state["step"] or not reader.is_alive() or time.monotonic() < deadline:
            continue
        sig = signal.SIGTERM if not sent else signal.SIGKILL
        tee.say(f"the training process exited but its group still holds the output: sending {sig.name}")
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            break
        sent.append(sig)
        deadline = time.monotonic() + 5.0


def _report_failure(
    tee: _Tee, code: int, log_path: Path, memory_tier: str | None, oom: tuple[int | None, int | None] = (None, None)
) -> None:
    lines = tee.lines()
    shown = lines[-_SHOWN_LINES:]
    name = f" ({signal.Signals(code - 128).name})" if code > 128 and _is_signal(code - 128) else ""
    cause = explain_failure(lines, memory_tier)
    if code == 128 + signal.SIGKILL and cause.startswith("cause: not recognised"):
        cause = killed_message(*oom, memory_tier)
    out = [
        f"---- last {len(shown)} lines of {log_path} ----",
        *shown,
        "----",
        f"training exited with code {code}{name}",
        cause,
    ]
    tee.show("\n".join(out) + "\n")


def _is_signal(n: int) -> bool:
    try:
        signal.Signals(n)
    except ValueError:
        return False
    return True
