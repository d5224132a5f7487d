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

_LADDER = (signal.SIGINT, signal.SIGTERM, signal.SIGKILL)  # Ctrl-C once, twice, three times
_TAIL_LINES = 200  # kept for explain_failure
_SHOWN_LINES = 20  # printed after a failure
_TAIL_CHARS = 65536  # longest unfinished line kept
# Smaller presets in order: an OOM at one tier suggests the next.
MEMORY_TIERS = ("vram80", "vram48", "vram32", "vram24", "vram16", "vram12")
# Import names whose pip package has another name.
_PIP_NAMES = {
    "cv2": "opencv-python-headless",
    "PIL": "pillow",
    "yaml": "pyyaml",
    "google": "protobuf",
    "sklearn": "scikit-learn",
    "pynvml": "nvidia-ml-py",
    "bitsandbytes": "bitsandbytes",
}
_SD_SCRIPTS_MODULES = {"library", "networks", "flux_train_network", "train_network"}


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
) -> int:
    """Run `cmd` to the end and return its exit code (128+N when killed by signal N, 127 when it cannot start).

    `env` is the child's whole environment (None: ours). `echo` defaults to sys.stdout at call time. Ctrl-C
    forwarding needs the main thread (Python delivers signals there); from another thread the child still runs and
    is waited for, without forwarding. When the child has exited but something it started still holds the output
    open for `linger_s` with no Ctrl-C from the user, the group is terminated so a leaked worker cannot hang us.
    `memory_tier` (the resolved memory preset) makes an out-of-memory explanation name the next smaller preset.
    """
    if isinstance(cmd, (str, bytes)) or not cmd:
        raise TypeError("run_supervised takes a non-empty argument list, never a shell string")
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "a", encoding="utf-8", errors="replace") as log:
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
        if code != 0:
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


def _next_tier(memory_tier: str | None) -> str:
    if memory_tier in MEMORY_TIERS:
        i = MEMORY_TIERS.index(memory_tier)
        if i + 1 < len(MEMORY_TIERS):
            return f"try the next smaller memory preset: memory={MEMORY_TIERS[i + 1]}"
        return (
            f"memory={memory_tier} is already the smallest preset: raise memory.blocks_to_swap, or lower "
            "dataset.resolution (768 or 512)"
        )
    return "pick a memory preset below your card's VRAM (memory=vram24, vram16, vram12)"


def _missing_module(m: re.Match) -> str:
    name = m.group(1)
    top = name.split(".")[0]
    if top in _SD_SCRIPTS_MODULES:
        return (
            f"cause: sd-scripts' module '{name}' was not importable: point sd_scripts=... or FLUX_TRAIN_SD_SCRIPTS "
            "at a checkout of the pinned commit."
        )
    return f"cause: Python module '{name}' is missing: pip install {_PIP_NAMES.get(top, top)}"


_CAUSES: tuple[tuple[str, Callable[[re.Match, str | None], str]], ...] = (
    (
        r"CUDA out of memory|OutOfMemoryError|CUBLAS_STATUS_ALLOC_FAILED|CUDA error: out of memory",
        lambda m, tier: (
            f"cause: the GPU ran out of memory. {_next_tier(tier)}; or turn on "
            "memory.gradient_checkpointing=true, or store the base model in fp8: precision=fp8_base."
        ),
    ),
    (
        r"no kernel image is available|not compatible with the current PyTorch installation|"
        r"CUDA error: invalid device function",
        lambda m, tier: (
            "cause: this torch build has no kernels for your GPU. Install the PyTorch build for your card's "
            "CUDA (RTX 50xx / B200 need CUDA 12.8 or newer: pytorch.org 'Get started' selector, cu128) in this "
            "environment, then run again."
        ),
    ),
    (
        r"CUDA driver version is insufficient",
        lambda m, tier: (
            "cause: the NVIDIA driver is older than the CUDA this torch build needs: update the driver, "
            "or install a torch build for an older CUDA."
        ),
    ),
    (r"No module named '([\w.]+)'", lambda m, tier: _missing_module(m)),
    (
        r"cannot import name 'CLIPFeatureExtractor'|FLAX_WEIGHTS_NAME",
        lambda m, tier: (
            "cause: transformers 5 is installed; sd-scripts needs transformers 4: "
            "pip install 'transformers>=4.54.1,<5' 'huggingface_hub<1'"
        ),
    ),
    (
        r"(?i)\b(?:avr_loss|loss)\s*[=:]\s*nan\b|\bloss is nan\b|\bnan loss\b|\bnans? (?:value|detected)",
        lambda m, tier: (
            "cause: the loss became NaN. Lower optimizer.lr, keep precision.mixed=bf16 (fp16 overflows), "
            "keep optimizer.max_grad_norm > 0, and check the dataset for broken images."
        ),
    ),
    (
        r"Address already in use|another process is utilizing it|EADDRINUSE",
        lambda m, tier: "cause: the rendezvous port is taken: set launcher.main_port to a free port (e.g. 29501).",
    ),
)


def explain_failure(log_tail: list[str], memory_tier: str | None) -> str:
    """The likely cause of a failed run and its fix, from the end of its log; a plain pointer when unknown.

    Of the known causes, the one mentioned last wins: a traceback's final line comes after earlier warnings
    (an optional module that was not found, a NaN that was survived).
    """
    text = "\n".join(log_tail)
    best: tuple[int, str] | None = None
    for pattern, message in _CAUSES:
        matches = list(re.finditer(pattern, text))
        if matches and (best is None or matches[-1].end() > best[0]):
            best = (matches[-1].end(), message(matches[-1], memory_tier))
    return best[1] if best else "cause: not recognised; the traceback above usually names it."
