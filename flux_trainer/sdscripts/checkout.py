"""Find, verify and import an sd-scripts checkout.

Order: the `sd_scripts` config key, then $FLUX_TRAIN_SD_SCRIPTS, then <cache>/sd-scripts. A checkout without
`flux_train_network.py` is an error; a different commit than the pinned one is a warning naming both.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.machinery
import logging
import os
import sys
import types
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from flux_trainer.backend import checkout as pinned
from flux_trainer.backend.checkout import COMMIT_FILE, Checkout, checkout_commit  # noqa: F401 - this module's API
from flux_trainer.backend.tv_shim import install_torchvision_shim
from flux_trainer.config.errors import ConfigError

log = logging.getLogger(__name__)

PINNED_COMMIT = "48d368fa557731ad0488c07304dfeba8c07910eb"
REPO_URL = "https://github.com/kohya-ss/sd-scripts"
ENV_VAR = "FLUX_TRAIN_SD_SCRIPTS"


def repo() -> pinned.PinnedRepo:
    """sd-scripts as the shared checkout code reads it (built per call: tests pin a stand-in commit)."""
    return pinned.PinnedRepo(
        name="sd-scripts",
        commit=PINNED_COMMIT,
        url=REPO_URL,
        env_var=ENV_VAR,
        config_key="sd_scripts",
        cache_name="sd-scripts",
        marker="flux_train_network.py",
    )


def default_location(env: Mapping[str, str] = os.environ) -> Path:
    return pinned.default_location(repo(), env)


def candidates(configured: str | None, env: Mapping[str, str] = os.environ) -> list[tuple[str, Path]]:
    return pinned.candidates(repo(), configured, env)


def locate(configured: str | None = None, env: Mapping[str, str] = os.environ) -> Checkout:
    """The first candidate that exists. A named path (config or env) that is not a checkout is an error."""
    return pinned.locate(repo(), configured, env)


def commit_warning(checkout: Checkout) -> str | None:
    return pinned.commit_warning(repo(), checkout)


@contextlib.contextmanager
def sd_scripts_argv(argv: list[str]):
    """sd-scripts' `read_config_from_file` re-parses `sys.argv`; make it see what its own CLI would."""
    saved = sys.argv
    sys.argv = ["flux_train_network.py", *argv]
    try:
        yield
    finally:
        sys.argv = saved


@dataclass
class SdScriptsModules:
    """The sd-scripts modules flux-train uses, imported from one checkout."""

    path: Path
    flux_train_network: types.ModuleType
    train_network: types.ModuleType
    train_util: types.ModuleType
    config_util: types.ModuleType
    flux_utils: types.ModuleType
    flux_models: types.ModuleType


def import_sd_scripts(path: Path | str) -> SdScriptsModules:
    """Put the checkout first on sys.path and import its FLUX training modules (once per process)."""
    path = Path(path).resolve()
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))
    install_torchvision_shim()
    mods = {
        name: importlib.import_module(mod)
        for name, mod in (
            ("flux_train_network", "flux_train_network"),
            ("train_network", "train_network"),
            ("train_util", "library.train_util"),
            ("config_util", "library.config_util"),
            ("flux_utils", "library.flux_utils"),
            ("flux_models", "library.flux_models"),
        )
    }
    loaded_from = Path(mods["flux_train_network"].__file__).resolve().parent
    if loaded_from != path:
        raise ConfigError(
            f"sd-scripts was already imported from {loaded_from}, not {path}; use one checkout per process"
        )
    return SdScriptsModules(path=path, **mods)
