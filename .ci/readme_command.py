"""Print one of README.md's two set-up commands, exactly as README gives it: `test` or `demo`.

Each is the one line of the ```bash block that follows its marker comment (`<!-- command: test -->`) in README.md;
`.ci/run` runs the test command, and tests/unit/test_readme_commands.py holds README to having both."""

from __future__ import annotations

import re
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def command(name: str, text: str) -> str:
    match = re.search(rf"<!-- command: {re.escape(name)} -->\s*```bash\n(.*?)\n```", text, re.S)
    if match is None:
        raise SystemExit(f"README.md has no `<!-- command: {name} -->` marker followed by a ```bash block")
    lines = [line for line in match.group(1).splitlines() if line.strip() and not line.lstrip().startswith("#")]
    if len(lines) != 1:
        raise SystemExit(f"README.md's {name} command must be one line, found {len(lines)}")
    return lines[0].strip()


if __name__ == "__main__":
    print(command(sys.argv[1] if len(sys.argv) > 1 else "test", README.read_text(encoding="utf-8")))
