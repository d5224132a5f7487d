"""The training process's own account of how it ended, kept in the run dir for the launcher (both backends).

accelerate launch turns every child failure into exit code 1; the training process writes its real code and a
one-line reason to `runner_exit.json`, and flux-train reports those.
"""

from __future__ import annotations

import json
from pathlib import Path

EXIT_FILE = "runner_exit.json"


def child_reason(run_dir: Path, code: int) -> str | None:
    """The training process's own one-line account of how it ended, for codes that need no log to explain:
    stopped on request (130), disk full, kernels or a non-finite loss."""
    try:
        record = json.loads((run_dir / EXIT_FILE).read_text())
    except (OSError, ValueError):
        return None
    if record.get("code") != code or code in (0, 1):
        return None
    return str(record.get("reason") or "") or None


def child_exit_code(run_dir: Path, launcher_code: int) -> int:
    """The training process's own exit code where the launcher reported only success/failure."""
    try:
        recorded = int(json.loads((run_dir / EXIT_FILE).read_text())["code"])
    except (OSError, ValueError, KeyError, TypeError):
        return launcher_code
    return recorded if launcher_code != 0 and recorded != 0 else launcher_code
