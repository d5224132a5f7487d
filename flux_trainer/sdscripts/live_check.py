"""Check our two TOMLs with the sd-scripts checkout itself: its parser and its dataset-config validator.

The committed schema catches unknown keys without a checkout; this catches what only the real code knows
(a commit whose parser changed, a dataset value its voluptuous schema refuses).
"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import toml

from flux_trainer.sdscripts.checkout import SdScriptsModules, sd_scripts_argv
from flux_trainer.sdscripts.parser_schema import check_training_keys, describe_parser


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
