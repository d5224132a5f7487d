"""Check our two TOMLs with the sd-scripts checkout itself: its parser and its dataset-config validator.

The committed schema catches unknown keys without a checkout; this catches what only the real code knows
(a commit whose parser changed, a dataset value its voluptuous schema refuses).

Importing sd-scripts for it (transformers, diffusers, its library) cost the launcher seconds at every start (on this
project's 2-core CPU the training process started 4.0-4.4 s after the command, 2.3-2.4 s without it), while a run's
TOMLs are mostly ones an earlier run had: the same config again, a resume. `checked` keeps the verdicts that passed
in flux-train's cache folder, keyed by everything the check reads: the two files (the run dir's own path, which
differs per run, replaced), the checkout's Python files (path, size, modification time), the versions of the
packages that parse and validate them, and this module's code. A pair that passed is not imported and checked again.
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Callable
from pathlib import Path

import toml

from flux_trainer.backend.verdicts import code_digest, remembered
from flux_trainer.sdscripts.checkout import SdScriptsModules, sd_scripts_argv
from flux_trainer.sdscripts.parser_schema import check_training_keys, describe_parser

CACHE_FILE = "sd_scripts_checks.json"
CODE_DIRS = (".", "library", "networks")  # the checkout's code the check runs (not a venv or tests beside it)
PACKAGES = ("voluptuous", "toml")


def live_check(mods: SdScriptsModules, train_toml: Path, dataset_toml: Path) -> list[str]:
    """Problems found by sd-scripts' own code (empty when it accepts both files)."""
    problems = []
    parser = mods.flux_train_network.setup_parser()
    flat: dict = {}
    for value in toml.load(train_toml).values():
        flat.update(value if isinstance(value, dict) else {})
    problems.extend(check_training_keys(flat, describe_parser(parser)))
    out = io.StringIO()
    argv = ["--config_file", str(train_toml), "--dataset_config", str(dataset_toml)]
    try:
        with contextlib.redirect_stderr(out), sd_scripts_argv(argv):
            args = parser.parse_args(argv)
            mods.train_util.read_config_from_file(args, parser)
    except SystemExit:
        problems.append(f"sd-scripts' parser refused {train_toml.name}: {out.getvalue().strip().splitlines()[-1:]}")
    try:
        user_config = mods.config_util.load_user_config(str(dataset_toml))
        mods.config_util.ConfigSanitizer(True, True, False, True).sanitize_user_config(user_config)
    except Exception as exc:  # noqa: BLE001 - voluptuous.Invalid and its many subclasses
        problems.append(f"sd-scripts' dataset validator refused {dataset_toml.name}: {exc}")
    return problems


def check_key(checkout: Path, train_toml: Path, dataset_toml: Path, run_dir: Path) -> str:
    """What the check's verdict depends on, as one digest (see the module's docstring)."""
    root = Path(checkout).resolve()
    files = [f for sub in CODE_DIRS for f in ((root / sub).glob("*.py") if sub == "." else (root / sub).rglob("*.py"))]
    h = code_digest(Path(__file__), root, files, PACKAGES)
    for f in (train_toml, dataset_toml):
        h.update(Path(f).read_text(encoding="utf-8").replace(str(run_dir), "<run dir>").encode() + b"\0")
    return h.hexdigest()


def checked(
    modules: Callable[[], SdScriptsModules],
    checkout: Path,
    train_toml: Path,
    dataset_toml: Path,
    run_dir: Path,
    cache: Path,
) -> list[str]:
    """`live_check` with the verdicts that passed kept in `cache`: an identical pair (see `check_key`) is not
    checked again, so sd-scripts (`modules()`) is not imported. Problems are never kept: they are found again."""
    key = check_key(checkout, train_toml, dataset_toml, run_dir)
    return remembered(cache, key, lambda: live_check(modules(), train_toml, dataset_toml))
