"""The committed schema of musubi-tuner's parsers at the pinned commit (FLUX.2 and Kontext: two caching scripts and a
trainer each), and the checks our arguments must pass.

Like sd-scripts, musubi-tuner's trainer reads its TOML into an argparse Namespace and ignores keys its parser lacks.
`scripts/gen_musubi_schema.py` writes `parser_schema.json` from a real checkout; every run's training TOML and the
caching scripts' arguments are checked against it (flux_trainer.backend.parser_schema.check_keys), and against the
live parsers when the checkout is present (flux_trainer.musubi.live_check).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from flux_trainer.backend.parser_schema import check_keys

SCHEMA_PATH = Path(__file__).with_name("parser_schema.json")
# model_type -> the three scripts of one run, in order: latents, text-encoder outputs, training (modules of
# musubi_tuner, each with a main() that parses sys.argv)
SCRIPTS: dict[str, tuple[str, str, str]] = {
    "flux2": ("flux_2_cache_latents", "flux_2_cache_text_encoder_outputs", "flux_2_train_network"),
    "kontext": ("flux_kontext_cache_latents", "flux_kontext_cache_text_encoder_outputs", "flux_kontext_train_network"),
}
ALL_SCRIPTS = tuple(s for trio in SCRIPTS.values() for s in trio)


def load_schema(path: Path = SCHEMA_PATH) -> dict[str, Any]:
    return json.loads(path.read_text())


def flags_of(script: str, schema: dict[str, Any] | None = None) -> dict[str, dict[str, Any]]:
    schema = schema or load_schema()
    return schema["scripts"][script]


def check_script_keys(script: str, values: dict[str, Any], schema: dict[str, Any] | None = None) -> list[str]:
    """Every problem with `values` (flag -> value, as a TOML or an argument list gives them) for one script."""
    return check_keys(values, flags_of(script, schema), f"musubi-tuner {script}")
