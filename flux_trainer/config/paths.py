"""Where flux-train keeps things on a user's machine: caches, user config folders. Pure path arithmetic."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

CONFIG_DIR_ENV = "FLUX_TRAIN_CONFIG_DIR"
CACHE_ENV = "FLUX_TRAIN_CACHE"
MODEL_CACHE_ENV = "FLUX_TRAIN_MODEL_CACHE"


def cache_root(env: Mapping[str, str] = os.environ) -> Path:
    """flux-train's cache folder: $FLUX_TRAIN_CACHE, else $XDG_CACHE_HOME/flux-trainer, else ~/.cache/flux-trainer."""
    if env.get(CACHE_ENV):
        return Path(env[CACHE_ENV]).expanduser()
    xdg = env.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "flux-trainer"


def model_cache(configured: str | None, env: Mapping[str, str] = os.environ) -> Path:
    """Where random model presets are generated: the config key, $FLUX_TRAIN_MODEL_CACHE, or <cache>/models."""
    if configured:
        return Path(configured).expanduser()
    if env.get(MODEL_CACHE_ENV):
        return Path(env[MODEL_CACHE_ENV]).expanduser()
    return cache_root(env) / "models"


def user_config_dirs(cwd: Path | None = None, env: Mapping[str, str] = os.environ) -> list[Path]:
    """The user's own config folders, searched after the shipped ones: ./configs, then $FLUX_TRAIN_CONFIG_DIR."""
    dirs = [(cwd or Path.cwd()) / "configs"]
    if env.get(CONFIG_DIR_ENV):
        dirs.append(Path(env[CONFIG_DIR_ENV]).expanduser())
    return [d.resolve() for d in dirs]


def shipped_config_dir() -> Path:
    """The `configs/` tree: inside an installed wheel it is `flux_trainer.configs`; in a source checkout on
    sys.path (tests, `python -m`) it is the checkout's top-level `configs/`."""
    try:
        import flux_trainer.configs as shipped

        return Path(shipped.__file__).parent
    except ImportError:
        import flux_trainer

        return Path(flux_trainer.__file__).resolve().parent.parent / "configs"
