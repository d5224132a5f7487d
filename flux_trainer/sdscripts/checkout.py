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
import subprocess
import sys
import types
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from flux_trainer.config.errors import ConfigError
from flux_trainer.config.paths import cache_root

log = logging.getLogger(__name__)

PINNED_COMMIT = "48d368fa557731ad0488c07304dfeba8c07910eb"
REPO_URL = "https://github.com/kohya-ss/sd-scripts"
ENV_VAR = "FLUX_TRAIN_SD_SCRIPTS"
# Written by `flux-train setup` (and by anyone exporting a commit without .git) so the commit stays known.
COMMIT_FILE = ".flux-train-commit"


@dataclass(frozen=True)
class Checkout:
    path: Path
    source: str  # "config" | "env" | "cache"
    commit: str | None

    @property
    def pinned(self) -> bool:
        return self.commit == PINNED_COMMIT


def default_location(env: Mapping[str, str] = os.environ) -> Path:
    return cache_root(env) / "sd-scripts"


def candidates(configured: str | None, env: Mapping[str, str] = os.environ) -> list[tuple[str, Path]]:
    found = []
    if configured:
        found.append(("config", Path(configured).expanduser()))
    if env.get(ENV_VAR):
        found.append(("env", Path(env[ENV_VAR]).expanduser()))
    found.append(("cache", default_location(env)))
    return found


def checkout_commit(path: Path) -> str | None:
    """The commit of a checkout: `git rev-parse HEAD`, else the commit file an export left, else None."""
    path = Path(path)
    if (path / ".git").exists():
        try:
            out = subprocess.run(
                ["git", "-C", str(path), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10, check=True
            )
            return out.stdout.strip()
        except (OSError, subprocess.SubprocessError):
            pass
    marker = path / COMMIT_FILE
    if marker.is_file():
        return marker.read_text().strip() or None
    return None


def locate(configured: str | None = None, env: Mapping[str, str] = os.environ) -> Checkout:
    """The first candidate that exists. A named path (config or env) that is not a checkout is an error."""
    tried = []
    for source, path in candidates(configured, env):
        if not path.exists():
            if source != "cache":
                raise ConfigError(
                    f"sd-scripts: {path} (from {_describe(source)}) does not exist; point it at a checkout of "
                    f"{REPO_URL} or run `flux-train setup`"
                )
            tried.append(str(path))
            continue
        if not (path / "flux_train_network.py").is_file():
            raise ConfigError(
                f"sd-scripts: {path} (from {_describe(source)}) has no flux_train_network.py, so it is not an "
                f"sd-scripts checkout; check out {REPO_URL} at {PINNED_COMMIT[:10]} there or run `flux-train setup`"
            )
        return Checkout(path=path.resolve(), source=source, commit=checkout_commit(path))
    raise ConfigError(
        f"sd-scripts not found (looked at {', '.join(tried)}); run `flux-train setup`, or set {ENV_VAR} "
        f"or sd_scripts=PATH to a checkout of {REPO_URL} at {PINNED_COMMIT[:10]}"
    )


def commit_warning(checkout: Checkout) -> str | None:
    if checkout.pinned:
        return None
    have = checkout.commit or "an unknown commit (no .git and no commit file)"
    return (
        f"sd-scripts at {checkout.path} is {have}, flux-train is tested with {PINNED_COMMIT}; "
        f"flags may differ (`git -C {checkout.path} checkout {PINNED_COMMIT[:10]}`)"
    )


def _describe(source: str) -> str:
    return {"config": "the sd_scripts config key", "env": f"${ENV_VAR}", "cache": "the cache folder"}[source]


def install_torchvision_shim() -> bool:
    """sd-scripts imports `torchvision.transforms` for ToTensor/Normalize only. Where torchvision cannot be
    installed (CPU-only PyTorch builds without a matching torchvision), give it those few transforms in
    plain PyTorch. Does nothing when a real torchvision imports. Returns True if the shim was installed."""
    try:
        import torchvision  # noqa: F401

        return False
    except Exception:  # noqa: BLE001 - a broken torchvision (wrong CUDA build) is as absent as a missing one
        for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
            del sys.modules[name]
    from flux_trainer.sdscripts import tv_shim

    tv = types.ModuleType("torchvision")
    tv.__spec__ = importlib.machinery.ModuleSpec("torchvision", None)
    tv.__version__ = "0.0.0+flux-train-shim"
    tv.transforms = tv_shim.transforms_module()
    sys.modules["torchvision"] = tv
    sys.modules["torchvision.transforms"] = tv.transforms
    sys.modules["torchvision.transforms.functional"] = tv.transforms.functional
    log.info("torchvision is not importable: using flux-train's minimal torchvision.transforms for sd-scripts")
    return True


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
