"""The result of one doctor check, and the helpers every doctor module shares.

Kept apart from `doctor.py` so the check modules (`doctor_gpu`, `doctor_attention`, `doctor_files`, `doctor_env`)
can build results without importing the orchestration (and each other). Stdlib only.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

PASS, WARN, FAIL, SKIP = "pass", "warn", "fail", "skip"
# pass / warn / fail as the issue asks; skip = not applicable here (no GPU, an optional library not installed,
# no dataset given). Only fail changes the exit code.
STATUSES = (PASS, WARN, FAIL, SKIP)
_RANK = {SKIP: 0, PASS: 1, WARN: 2, FAIL: 3}


@dataclass(frozen=True)
class CheckResult:
    """One row of the doctor's table: what was checked, the verdict, what was seen, and the one-line fix."""

    check: str  # "gpu", "attention: sdpa_flash", "model: flux", ...
    status: str  # one of STATUSES
    evidence: str
    fix: str = ""  # empty when there is nothing to do
    group: str = ""  # gpu | attention | kernels | sd-scripts | models | disk | env | config | speed
    data: dict[str, Any] = field(default_factory=dict)  # numbers behind the evidence, for --json

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"status {self.status!r}: choose one of {', '.join(STATUSES)}")

    @property
    def failed(self) -> bool:
        return self.status == FAIL

    def as_dict(self) -> dict[str, Any]:
        return {
            "check": self.check,
            "status": self.status,
            "evidence": self.evidence,
            "fix": self.fix,
            "group": self.group,
            "data": dict(self.data),
        }


def worst(statuses: Iterable[str]) -> str:
    """The most serious status (fail > warn > pass > skip); skip for none."""
    return max(statuses, key=_RANK.__getitem__, default=SKIP)


def exit_code(results: Iterable[CheckResult]) -> int:
    """0 when nothing failed, 1 otherwise (warnings do not change it)."""
    return 1 if any(r.failed for r in results) else 0


def one_line(exc: BaseException, limit: int = 240) -> str:
    """`TypeName: first line of the message`, short enough for a table cell."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    text = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def gib(n_bytes: float) -> str:
    return f"{n_bytes / 2**30:.1f} GiB"
