"""Compose configs/ plus the user's own config folders into one run config."""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from flux_trainer.config.paths import model_cache, shipped_config_dir, user_config_dirs
from flux_trainer.config.random_specs import preset_file
from flux_trainer.config.schema import register_configs

_registered = False


def _model_file(preset: str, part: str, *, _root_: DictConfig) -> str:
    """`${model_file:tiny,flux}`: the generated random preset's file inside the model cache (FLUX.2's random sets:
    `${model_file:random_flux2_klein_tiny,dit}`, named by flux_trainer.musubi.random_specs, pure data)."""
    from flux_trainer.musubi.random_specs import FLUX2_PRESETS, flux2_preset_file

    cache = model_cache(_root_.get("model_cache"))
    if preset in FLUX2_PRESETS:
        return str(flux2_preset_file(cache, preset, part))
    return str(preset_file(cache, preset, part))


def register() -> None:
    """Register the schema and our resolvers with Hydra/OmegaConf (idempotent; nothing else at import time)."""
    global _registered
    if _registered:
        return
    register_configs()
    OmegaConf.register_new_resolver("model_file", _model_file, replace=True)
    _registered = True


def hydra_overrides(search_dirs: list[Path] | None = None) -> list[str]:
    """The `hydra.searchpath` override that adds the user's config folders (cwd/configs, $FLUX_TRAIN_CONFIG_DIR)."""
    dirs = [d for d in (user_config_dirs() if search_dirs is None else search_dirs) if d.is_dir()]
    return ["hydra.searchpath=[" + ",".join(f"'file://{d}'" for d in dirs) + "]"]


def compose_run(
    overrides: list[str],
    search_dirs: list[Path] | None = None,
    *,
    config_path: str | None = None,
    config_name: str | None = None,
) -> DictConfig:
    """Compose like `flux-train` does, without creating a run dir (for validation up front and for tests);
    `config_path` / `config_name`: another primary config (Hydra's -cp / -cn)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    register()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(config_path or shipped_config_dir()), version_base="1.3"):
        every = [*overrides, *hydra_overrides(search_dirs)]
        return compose(config_name or "config", overrides=every, return_hydra_config=False)
