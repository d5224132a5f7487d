"""Composition of every shipped preset, the user's dataset configs, and each bad input's message."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra.errors import ConfigCompositionException
from omegaconf.errors import ConfigKeyError, ValidationError

from flux_trainer.config import ConfigError
from flux_trainer.config.paths import shipped_config_dir
from flux_trainer.config.validate import validate
from tests.conftest import make_images, write_dataset

GROUP_OPTIONS = sorted((p.parent.name, p.stem) for p in shipped_config_dir().glob("*/*.yaml"))


def test_there_are_presets_to_compose():
    groups = {g for g, _ in GROUP_OPTIONS}
    assert {"model", "network", "optimizer", "precision", "memory", "hardware", "kernels", "launcher"} <= groups
    assert {"prodigy", "adamw", "adamw8bit", "adafactor"} <= {o for g, o in GROUP_OPTIONS if g == "optimizer"}


@pytest.mark.parametrize(("group", "option"), GROUP_OPTIONS)
def test_every_shipped_preset_composes_and_resolves(group, option, compose):
    from omegaconf import OmegaConf

    cfg = compose("+dataset=mychar", f"{group}={option}")
    OmegaConf.to_container(cfg, resolve=True)  # every interpolation resolves
    assert cfg[group].get("name", option) in (option, cfg[group].get("name"))


def test_every_shipped_yaml_starts_with_the_command_that_uses_it():
    for path in shipped_config_dir().rglob("*.yaml"):
        lines = path.read_text().splitlines()
        # Hydra reads a `# @package` header only above every other line (Chroma's models also set train.*)
        first = lines[1] if lines[0].startswith("# @package ") else lines[0]
        assert first.startswith("# flux-train"), f"{path} does not start with its command"


def test_user_dataset_found_in_cwd_configs(compose):
    cfg = compose("+dataset=mychar")
    assert cfg.dataset.name == "mychar" and cfg.dataset.trigger == "ohwx" and cfg.train.output_name == "mychar"


def test_user_dataset_found_through_env_dir(tmp_path, monkeypatch):
    from flux_trainer.config.compose import compose_run
    from flux_trainer.config.paths import user_config_dirs

    elsewhere = tmp_path / "elsewhere"
    write_dataset(elsewhere, "envset", make_images(tmp_path / "imgs"))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("FLUX_TRAIN_CONFIG_DIR", str(elsewhere))
    assert elsewhere.resolve() in user_config_dirs()
    assert compose_run(["+dataset=envset"]).dataset.name == "envset"


def test_typo_in_a_key_names_the_key(compose):
    with pytest.raises((ConfigCompositionException, ConfigKeyError)) as info:
        compose("+dataset=mychar", "network.rnk=32")
    assert "rnk" in str(info.value)


def test_typo_inside_a_dataset_file_names_the_key(compose, workdir):
    write_dataset(workdir / "configs", "typo", workdir / "pics" / "mychar", num_repeat=3)
    with pytest.raises(Exception) as info:
        compose("+dataset=typo")
    assert "num_repeat" in str(info.value)


def test_wrong_type_is_refused(compose):
    with pytest.raises((ConfigCompositionException, ValidationError)):
        compose("+dataset=mychar", "network.rank=sixteen")


def test_unknown_optimizer_lists_choices(compose):
    with pytest.raises(ConfigCompositionException) as info:
        compose("+dataset=mychar", "optimizer=sgdx")
    assert "prodigy" in str(info.value) and "adamw" in str(info.value)


def problems_of(cfg, **kw) -> list[str]:
    with pytest.raises(ConfigError) as info:
        validate(cfg, **kw)
    return info.value.problems


def test_valid_default_passes_with_model_warnings_only_in_dry_run(compose):
    cfg = compose("+dataset=mychar", "dry_run=true")
    warnings = validate(cfg)
    assert any("model.flux" in w for w in warnings)
    assert validate(compose("+dataset=mychar", "model=random_tiny")) == []


def test_missing_model_files_are_an_error_outside_dry_run(compose):
    (p,) = [p for p in problems_of(compose("+dataset=mychar")) if "model.flux" in p]
    assert "flux-train setup --models" in p


def test_no_dataset(compose, workdir):
    (p,) = problems_of(compose("model=random_tiny"), search_dirs=[workdir / "configs"])
    assert "+dataset=NAME" in p and "mychar" in p


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (["dataset.resolution=500"], "multiple of 16"),
        (["dataset.resolution=4096"], "between 64 and 2048"),
        (["network.rank=0"], "network.rank=0"),
        (["network.rank=-4"], "positive integer"),
        (["optimizer.name=sgd"], "optimizer.name=sgd"),
        (["memory.blocks_to_swap=4", "memory.cpu_offload_checkpointing=true"], "cannot be combined"),
        (["train.output_name=a/b"], "output_name"),
        (["train.max_steps=0"], "train.max_steps=0"),
        (["dataset.images=/nonexistent/x"], "does not exist"),
        (["network.train_t5xxl=true"], "cache.text_encoder_outputs=false"),
    ],
)
def test_bad_values_name_key_and_fix(overrides, needle, compose):
    problems = problems_of(compose("+dataset=mychar", "model=random_tiny", *overrides))
    assert any(needle in p for p in problems), problems


def test_fp8_base_needs_ampere_or_newer(compose):
    """fp8 base weights are stored in fp8 and multiplied in bf16 from Ampere on (an RTX 3060's 12 GB tier needs
    them); a card older than Ampere has no bf16 and is refused."""
    cfg = compose("+dataset=mychar", "model=random_tiny", "precision=fp8_base")
    (p,) = problems_of(cfg, family="older")
    assert "fp8" in p and "older" in p and "precision=bf16" in p
    for family in ("ampere", "ada", "hopper", "blackwell_consumer"):
        assert validate(cfg, family=family) == []
    assert problems_of(compose("+dataset=mychar", "model=random_tiny", "memory=vram24", "hardware.family=older"))
    assert validate(compose("+dataset=mychar", "model=random", "memory=vram12", "hardware.family=ampere")) == []


@pytest.mark.parametrize(("model", "most"), [("random", 35), ("random_tiny", 0)])
def test_blocks_to_swap_beyond_what_sd_scripts_swaps_is_refused(compose, model, most):
    """sd-scripts asserts at the first step that 2 double and 2 single blocks stay on the GPU: FLUX.1 swaps at most
    35 (17 double, 36 single), the tiny preset (1 + 1 blocks) none."""
    assert validate(compose("+dataset=mychar", f"model={model}", f"memory.blocks_to_swap={most}")) == []
    (p,) = problems_of(compose("+dataset=mychar", f"model={model}", f"memory.blocks_to_swap={most + 1}"))
    assert f"memory.blocks_to_swap={most + 1}" in p and f"at most {most}" in p


def test_one_block_swapped_is_refused(compose):
    """n // 2 = 0 double blocks swapped: sd-scripts' offloader for them does nothing, also not put them on the GPU."""
    (p,) = problems_of(compose("+dataset=mychar", "model=random", "memory.blocks_to_swap=1"))
    assert "memory.blocks_to_swap=1" in p and "choose 0 or 2" in p
    assert validate(compose("+dataset=mychar", "model=random", "memory.blocks_to_swap=2")) == []


def test_folder_without_images(compose, workdir):
    empty = workdir / "empty"
    empty.mkdir()
    write_dataset(workdir / "configs", "empty", empty)
    assert any("has no images" in p for p in problems_of(compose("+dataset=empty", "model=random_tiny")))
    bare = make_images(workdir / "bare", captions=False)  # uncaptioned: the data check's (tests/unit/test_data_check)
    write_dataset(workdir / "configs", "bare", bare)
    assert validate(compose("+dataset=bare", "model=random_tiny")) == []


def test_all_problems_reported_at_once(compose):
    problems = problems_of(compose("+dataset=mychar", "model=random_tiny", "network.rank=0", "dataset.resolution=520"))
    assert len(problems) == 2


def test_random_preset_paths_live_in_the_model_cache(compose, monkeypatch, tmp_path):
    monkeypatch.setenv("FLUX_TRAIN_MODEL_CACHE", str(tmp_path / "mc"))
    cfg = compose("+dataset=mychar", "model=random_tiny")
    assert Path(cfg.model.flux).parent.parent == tmp_path / "mc"
    assert Path(cfg.model.flux).name == "flux.safetensors" and "random-tiny-" in cfg.model.flux


def test_profile_window_must_be_positive(compose):
    assert validate(compose("+dataset=mychar", "model=random_tiny", "logging.profile_at=5")) == []
    (p,) = problems_of(
        compose("+dataset=mychar", "model=random_tiny", "logging.profile_at=5", "logging.profile_steps=0")
    )
    assert "logging.profile_steps=0" in p and "at least 1" in p


def test_profile_options_reach_the_runner(compose):
    from flux_trainer.app import _profile_options

    assert _profile_options(compose("+dataset=mychar")) == {}
    on = compose("+dataset=mychar", "logging.profile_at=5", "logging.profile_python=true")
    assert _profile_options(on) == {"profile_at": 5, "profile_steps": 3, "profile_python": True}
    assert _profile_options(compose("+dataset=mychar", "logging.profile_at=2"))["profile_python"] is False
    snapshot = compose("+dataset=mychar", "logging.memory_snapshot_at=4")
    assert _profile_options(snapshot) == {"memory_snapshot_at": 4}
    (p,) = problems_of(compose("+dataset=mychar", "model=random_tiny", "logging.memory_snapshot_at=0"))
    assert "logging.memory_snapshot_at=0" in p and "at least 1" in p


@pytest.mark.parametrize(
    ("model", "preset"), [("chroma", None), ("random_chroma", "chroma"), ("random_chroma_tiny", "chroma_tiny")]
)
def test_chroma_models_compose_without_clip_l_and_with_chromas_settings(compose, model, preset):
    """Chroma reads T5 alone: no CLIP-L file anywhere (nothing to download, generate or check), and sd-scripts'
    recommended Chroma settings (guidance 0, sigmoid timesteps) unless overridden."""
    from flux_trainer.config.random_specs import preset_parts

    cfg = compose("+dataset=mychar", f"model={model}")
    assert (cfg.model.model_type, cfg.model.clip_l, cfg.model.get("random_preset")) == ("chroma", None, preset)
    assert (cfg.train.guidance_scale, cfg.train.timestep_sampling) == (0.0, "sigmoid")
    if preset:
        assert preset_parts(preset) == ("flux", "ae", "t5xxl")
        assert f"random-{preset}-" in cfg.model.flux and validate(cfg) == []
    assert compose("+dataset=mychar", f"model={model}", "train.guidance_scale=1").train.guidance_scale == 1.0
    assert compose("+dataset=mychar").train.guidance_scale == 1.0  # FLUX.1's own default is untouched


def test_an_unknown_model_type_is_refused(compose):
    (p,) = problems_of(compose("+dataset=mychar", "model=random_tiny", "model.model_type=sd3"))
    assert "model.model_type=sd3" in p and "flux, chroma" in p


def test_only_the_narrow_random_presets_need_flux_trains_own_loader():
    """sd-scripts' loaders hard-code the full widths (FLUX.1-dev's, Chroma's): the full presets go through them."""
    from flux_trainer.app import _custom_loader
    from flux_trainer.config.random_specs import PRESETS, needs_custom_loader

    assert [p for p in PRESETS if needs_custom_loader(PRESETS[p])] == ["tiny", "chroma_tiny"]
    assert [_custom_loader(p) for p in (None, "full", "tiny", "chroma", "chroma_tiny")] == [
        False,
        False,
        True,
        False,
        True,
    ]
