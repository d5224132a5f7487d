"""Errors a user can act on: each problem names the key, the bad value and the fix."""

from __future__ import annotations


class ConfigError(Exception):
    """Bad input. Carries every problem found, so the user fixes them in one go (exit code 2)."""

    exit_code = 2

    def __init__(self, problems: list[str] | str):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__("; ".join(self.problems))

    def __str__(self) -> str:
        if len(self.problems) == 1:
            return self.problems[0]
        return f"{len(self.problems)} problems:\n" + "\n".join(f"  - {p}" for p in self.problems)
