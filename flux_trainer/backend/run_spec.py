"""What the launcher hands the training process, for both backends: a dataclass written to the run dir as
`runner.json` and read back by the runner (each backend's `RunnerSpec` adds its own fields)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

RUNNER_SPEC = "runner.json"


class JsonSpec:
    """`write` / `read` for a dataclass of JSON values, kept as `runner.json` in the run dir."""

    def write(self, run_dir: Path) -> Path:
        path = Path(run_dir) / RUNNER_SPEC
        path.write_text(json.dumps(self.__dict__, indent=1) + "\n")
        return path

    @classmethod
    def read(cls, run_dir: Path) -> Any:
        return cls(**json.loads((Path(run_dir) / RUNNER_SPEC).read_text()))
