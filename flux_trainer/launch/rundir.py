"""Run dirs that belong to one run each, and one live run per output name.

`runs/<output_name>/` holds every run of that name. While a run is live it holds an exclusive lock on that folder
(flock on the folder itself: no lock file to leave behind; the kernel drops it when the process ends, however it
ends, and the training child holds it too, so a child left running by a killed parent still counts as live). A
second run of the same name is refused with the live one's run dir and pid; `resume=auto` therefore never reads a
state that a live run may still be writing.

Each run dir gets `run.json` created exclusively (O_EXCL): two runs started in the same second (Hydra names run
dirs by the second) never share one; the later takes `<time>-2`.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from flux_trainer.config.errors import ConfigError

RUN_RECORD = "run.json"


@dataclass
class OutputLock:
    """The exclusive lock of `runs/<output_name>/` held by this process (and any child given `fd`)."""

    folder: Path
    fd: int

    def release(self) -> None:
        if self.fd >= 0:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_UN)
            finally:
                os.close(self.fd)
            self.fd = -1


def live_run_dir(folder: Path) -> tuple[Path, dict] | None:
    """The newest run dir of `folder` whose run.json names a process alive on this host, with that record."""
    for record in sorted(folder.glob(f"*/{RUN_RECORD}"), key=lambda p: p.stat().st_mtime, reverse=True):
        try:
            info = json.loads(record.read_text(encoding="utf-8"))
            pid = int(info["pid"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if info.get("host") == socket.gethostname() and _pid_alive(pid):
            return record.parent, info
    return None


def live_holder(folder: Path) -> str:
    """The live run of `folder` for the refusal message: the newest run dir whose run.json names a running pid."""
    if found := live_run_dir(folder):
        run_dir, info = found
        return f"{run_dir} (pid {info['pid']}, started {info.get('started', '?')})"
    return f"a process holding {folder}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def lock_output(folder: Path) -> OutputLock:
    """Take `folder`'s lock (the folder is made if needed), or refuse naming the live run that holds it."""
    folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise
        name = folder.name
        raise ConfigError(
            f"output_name '{name}' is being trained by a live run: {live_holder(folder)}; wait for it to finish, "
            f"stop it (Ctrl-C in its terminal), or use another name: train.output_name={name}_2"
        ) from None
    return OutputLock(folder, fd)


def is_locked(folder: Path) -> bool:
    """Whether a live run holds `folder` (used by `flux-train runs` and resume; False where it cannot be told)."""
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)
    return False


def claim_run_dir(run_dir: Path, command: list[str] | None = None) -> Path:
    """`run_dir`, or the first free `run_dir-N`, with its run.json created exclusively (pid, host, start, command).
    Returns the dir that is now this run's."""
    record = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "command": command or [],
    }
    for n in range(1, 1000):
        candidate = run_dir if n == 1 else run_dir.with_name(f"{run_dir.name}-{n}")
        candidate.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(candidate / RUN_RECORD, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            continue
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(record, f, indent=1)
            f.write("\n")
        return candidate
    raise ConfigError(f"{run_dir}: 999 run dirs of this name exist already; remove some")


def remove_refused(run_dir: Path, made: bool, parents: tuple[Path, ...] = ()) -> None:
    """Undo a run dir for a config refused after it was made: the run dir (all of it if this run `made` its files,
    else only if empty), then each of `parents` (its output_name folder, the runs root) that is left empty."""
    if made:
        shutil.rmtree(run_dir, ignore_errors=True)
    else:
        _rmdir(run_dir)
    for parent in parents:
        _rmdir(parent)


def _rmdir(path: Path) -> None:
    try:
        path.rmdir()
    except OSError:
        pass
