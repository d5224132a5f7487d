"""The committed schema of sd-scripts' FLUX LoRA parser, and the check every run's TOML must pass.

sd-scripts reads its training TOML into an argparse Namespace and ignores keys its parser does not define (see
flux_trainer.backend.parser_schema, which describes parsers and checks keys for both backends).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from flux_trainer.backend.parser_schema import check_keys, describe_parser  # noqa: F401 - describe_parser: API

SCHEMA_PATH = Path(__file__).with_name("parser_schema.json")


def load_schema(path: Path = SCHEMA_PATH) -> dict[str, Any]:
    return json.loads(path.read_text())


def check_training_keys(flat: dict[str, Any], flags: dict[str, dict[str, Any]]) -> list[str]:
    """Every problem with a flattened sd-scripts training TOML against the parser's flags (empty when clean)."""
    return check_keys(flat, flags, "sd-scripts")
