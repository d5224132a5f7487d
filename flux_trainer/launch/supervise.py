"""The one place flux-train starts a process: the training child, supervised.

The child gets an argument list (never a shell, so no argument is ever interpreted) and its own session, so a
terminal's Ctrl-C reaches only us and we decide what the child gets: first Ctrl-C -> SIGINT to its whole process
group (accelerate, torchrun and every rank) and wait for it to stop; second -> SIGTERM; third -> SIGKILL. Its
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

from flux_trainer.launch.failure import explain_failure

__all__ = ["explain_failure", "run_supervised"]

_LADDER = (signal.SIGINT, signal.SIGTERM, signal.SIGKILL)  # Ctrl-C once, twice, three times
_TAIL_LINES = 200  # kept for explain_failure
_SHOWN_LINES = 20  # printed after a failure
_TAIL_CHARS = 65536  # longest unfinished line kept


class _Tee:
    """Writes the child's output to the screen and the log; keeps the last lines for explain_failure."""

    def __init__(self, log: TextIO, echo: TextIO | None):
        self.log, self.echo = log, echo
        self.lock = threading.RLock()
        self.tail: deque[str] = deque(maxlen=_TAIL_LINES)
        self._partial = ""
        self._last_was_cr = False

    def write(self, text: str) -> None:
        with self.lock:
            self.log.write(text)
            self.log.flush()
            if self.echo is not None:
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

    def lines(self) -> list[str]:
        with self.lock:
            return [*self.tail, self._partial] if self._partial else list(self.tail)

    def say(self, message: str) -> None:
        """A flux-train message (not the child's) on the screen and in the log."""
        self.write(f"flux-train: {message}\n")


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
) -> int:
    """Run `cmd` to the end and return its exit code (128+N when killed by signal N, 127 when it cannot start).

    `env` is the child's whole environment (None: ours). `echo` defaults to sys.stdout at call time. Ctrl-C
    forwarding needs the main thread (Python delivers signals there); from another thread the child still runs and
    is waited for, without forwarding. When the child has exited but something it started still holds the output
    open for `linger_s` with no Ctrl-C from the user, the group is terminated so a leaked worker cannot hang us.
    `memory_tier` (the resolved memory preset) makes an out-of-memory explanation name the next smaller preset.
    `exit_code` maps the launcher's code to the training process's own (accelerate reports every failure as 1) before
    it is reported and returned.
    """
    if isinstance(cmd, (str, bytes)) or not cmd:
        raise TypeError("run_supervised takes a non-empty argument list, never a shell string")
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "a", encoding="utf-8", errors="replace", newline="") as log:
        tee = _Tee(log, sys.stdout if echo is None else echo)
        state: dict = {"step": 0, "proc": None, "pending": None}

        def forward(sig: int) -> None:
            step = min(state["step"], len(_LADDER) - 1)
            if sig != signal.SIGINT:  # SIGTERM/SIGHUP to us: at least SIGTERM to the child
                step = max(step, 1)
            state["step"] = step + 1
            _send(state, _LADDER[step], tee)

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
                )
            except OSError as e:
                tee.say(f"cannot start {cmd[0]}: {e}")
                return 126 if isinstance(e, PermissionError) else 127
            state["proc"] = proc
            if state["pending"] is not None:  # a signal came while starting: deliver it now
                _send(state, state["pending"], tee)
            reader = threading.Thread(target=_pump, args=(proc.stdout.fileno(), tee), daemon=True)
            reader.start()
            rc = proc.wait()
            _drain(reader, proc.pid, state, linger_s, tee)
            proc.stdout.close()
        finally:
            for s, h in previous.items():
                signal.signal(s, h)
        code = 128 - rc if rc < 0 else rc
        code = exit_code(code) if exit_code is not None else code
        if code != 0 and state["step"]:
            # Stopped on request: launchers turn that into exit 1 and a traceback; no failure to explain.
            tee.say(f"training stopped on request (exit code {code}); the log is {log_path}")
        elif code != 0:
            _report_failure(tee, code, log_path, memory_tier)
        return code


def _send(state: dict, sig: int, tee: _Tee) -> None:
    proc = state["proc"]
    if proc is None:
        state["pending"] = sig
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


def _report_failure(tee: _Tee, code: int, log_path: Path, memory_tier: str | None) -> None:
    lines = tee.lines()
    shown = lines[-_SHOWN_LINES:]
    name = f" ({signal.Signals(code - 128).name})" if code > 128 and _is_signal(code - 128) else ""
    out = [
        f"---- last {len(shown)} lines of {log_path} ----",
        *shown,
        "----",
        f"training exited with code {code}{name}",
        explain_failure(lines, memory_tier),
    ]
    tee.write("\n".join(out) + "\n")


def _is_signal(n: int) -> bool:
    try:
        signal.Signals(n)
    except ValueError:
        return False
    return True
