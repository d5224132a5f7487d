"""Check a run's files with the musubi-tuner checkout itself: its scripts' parsers and its dataset-config schema.

The committed schema (parser_schema.json) catches unknown keys without a checkout; this catches what only the real
code knows: a checkout at another commit whose parsers changed, a dataset value its voluptuous schema
(dataset/config_utils.py's ConfigSanitizer) refuses. Importing musubi-tuner costs the launcher seconds, so verdicts
that passed are kept in flux-train's cache, keyed by everything the check reads (the files, with the run dir's own
path replaced; the checkout's code files by size and modification time; the parsing packages' versions; this
module's code), as sd-scripts' live check does. Problems are never kept.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import toml

from flux_trainer.backend.parser_schema import check_keys, describe_parser, parser_of
from flux_trainer.backend.verdicts import code_digest, remembered
from flux_trainer.musubi.checkout import argv, import_module, source_dir

CACHE_FILE = "musubi_tuner_checks.json"
PACKAGES = ("voluptuous", "toml")


def live_check(checkout: Path, scripts: dict[str, dict[str, Any]], dataset_toml: Path) -> list[str]:
    """Problems found by musubi-tuner's own code; `scripts`: script module name -> the flag values we give it."""
    from flux_trainer.backend.tv_shim import install_torchvision_shim

    install_torchvision_shim()
    problems = []
    for script, values in scripts.items():
        module = import_module(checkout, script)
        with argv(f"{script}.py", []):
            parser = parser_of(module.main)
        problems += check_keys(values, describe_parser(parser), f"musubi-tuner {script} (live)")
    config_utils = import_module(checkout, "dataset.config_utils")
    try:
        user_config = config_utils.load_user_config(str(dataset_toml))
        config_utils.ConfigSanitizer().sanitize_user_config(user_config)
    except Exception as exc:  # noqa: BLE001 - voluptuous.Invalid and its many subclasses
        problems.append(f"musubi-tuner's dataset schema refused {dataset_toml.name}: {exc}")
    return problems


def check_key(checkout: Path, scripts: dict[str, dict[str, Any]], dataset_toml: Path, run_dir: Path) -> str:
    src = source_dir(checkout)
    h = code_digest(Path(__file__), src, src.rglob("*.py"), PACKAGES)
    text = json.dumps(scripts, sort_keys=True, default=str) + Path(dataset_toml).read_text(encoding="utf-8")
    h.update(text.replace(str(run_dir), "<run dir>").encode())
    return h.hexdigest()


def checked(
    checkout: Path, scripts: dict[str, dict[str, Any]], dataset_toml: Path, run_dir: Path, cache: Path
) -> list[str]:
    """`live_check`, skipped for a set of files that passed before (see the module's docstring)."""
    key = check_key(checkout, scripts, dataset_toml, run_dir)
    return remembered(cache, key, lambda: live_check(checkout, scripts, dataset_toml))


def training_values(train_toml: Path) -> dict[str, Any]:
    """The training TOML's sections flattened, as musubi-tuner's read_config_from_file merges them."""
    flat: dict[str, Any] = {}
    for value in toml.load(train_toml).values():
        flat.update(value if isinstance(value, dict) else {})
    return flat
