"""A FLUX.2 / Kontext run's preparation in the launcher: the checkout, the data, the run dir, musubi-tuner's files.

`app.prepare` hands a run whose plan chose this backend to `prepare_run`; it returns what the launcher needs (the
command, the environment) exactly as sd-scripts' side does, so launching, supervising and the progress display are
the same code for both. Everything is checked before the run dir is kept: the dataset and its references, every
flag of the three steps against the committed schema, then the live parsers and musubi-tuner's dataset schema when
the checkout is there. Anything that fails removes the run dir (the caller's rollback).
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from flux_trainer.backend.samples import SAMPLE_FILE, prompts_text
from flux_trainer.config import ConfigError
from flux_trainer.config.paths import cache_root
from flux_trainer.data.check import check_folder
from flux_trainer.data.subsets import subsets_of
from flux_trainer.musubi import checkout as musubi_checkout
from flux_trainer.musubi.runner import RunnerSpec
from flux_trainer.musubi.stage import MusubiFolders, stage_for_musubi
from flux_trainer.musubi.translate import argv_of, translate

RUNNER_MODULE = "flux_trainer.musubi.runner"
TRAIN_TOML = "musubi_tuner.toml"


@dataclass
class MusubiFiles:
    """What the run dir holds for musubi-tuner, and lines for the run's header."""

    train_toml: Path
    dataset_toml: Path
    spec: RunnerSpec
    said: list[str]


def kernels_line(cfg: DictConfig) -> str:
    """The header's kernels line (ConfigError for a kernel set that does not apply to musubi-tuner's models)."""
    from flux_trainer.musubi.kernel_install import kernels_line as line

    return line(cfg)


def planned_kernels(cfg: DictConfig) -> tuple[str, ...]:
    """The kernels the runner will try on this run (kernel_install.planned)."""
    from flux_trainer.musubi.kernel_install import planned

    return planned(cfg)


def locate(cfg: DictConfig, dry_run: bool) -> tuple[Any, list[str]]:
    """The checkout (None on a dry run without one) and warnings to show."""
    try:
        found = musubi_checkout.locate(cfg.get("musubi_tuner"))
    except ConfigError:
        if not dry_run:
            raise
        return None, ["warning: no musubi-tuner checkout: the files are checked against the committed schema only"]
    warning = musubi_checkout.commit_warning(found)
    return found, [f"warning: {warning}"] if warning else []


def model_key(cfg: DictConfig) -> list[Any]:
    """What of the model shapes the caches (a change of any starts a new cache folder)."""
    m = cfg.model
    return [
        str(m.model_type),
        m.get("model_version"),
        str(m.ae),
        m.get("text_encoder"),
        m.get("t5xxl"),
        m.get("clip_l"),
    ]


def stage_dataset(cfg: DictConfig, staged: list[Path]) -> list[MusubiFolders]:
    """musubi-tuner's folders for each staged dataset folder, with the references matched where the dataset names
    them (flux_trainer.data.control)."""
    from flux_trainer.data.control import check_references

    d = cfg.dataset
    subsets = subsets_of(d)
    control = d.get("control_images")
    if control and len(subsets) > 1:
        raise ConfigError(
            f"dataset '{d.name}': control_images with subsets is not supported yet; use `images:` and "
            "`control_images:` (one folder each)"
        )
    folders = []
    for subset, folder in zip(subsets, staged, strict=True):
        check = check_folder(Path(subset.images), str(d.caption_extension), cache_root())
        refs = check_references(str(d.name), str(control), check, cache_root()) if control else None
        folders.append(stage_for_musubi(cache_root(), d, folder, check, refs, model_key(cfg)))
    return folders


def write_files(
    cfg: DictConfig, run_dir: Path, folders: list[MusubiFolders], checkout: Any, resume: Path | None = None
) -> MusubiFiles:
    """The dataset TOML, the training TOML and runner.json, checked against the committed schema (and the live
    parsers with a checkout). `resume`: the state folder the run continues from. ConfigError with every problem."""
    run, said = translate(cfg, run_dir, folders, resume)
    problems = run.problems()
    if problems:
        raise ConfigError(problems)
    train_toml, dataset_toml = run_dir / TRAIN_TOML, run_dir / "dataset.toml"
    train_toml.write_text(run.train.dumps(), encoding="utf-8")
    dataset_toml.write_text(run.dataset.dumps(), encoding="utf-8")
    if cfg.sample.prompts:  # the live check below reads it too
        (run_dir / SAMPLE_FILE).write_text(prompts_text(cfg), encoding="utf-8")
    if checkout is not None:
        from flux_trainer.musubi import live_check

        values = {run.scripts[0]: run.cache_latents, run.scripts[1]: run.cache_text_encoder}
        values[run.scripts[2]] = live_check.training_values(train_toml)
        problems = live_check.checked(
            checkout.path, values, dataset_toml, run_dir, cache_root() / live_check.CACHE_FILE
        )
        if problems:
            raise ConfigError(problems)
    spec = RunnerSpec(
        musubi_tuner=str(checkout.path) if checkout is not None else "",
        scripts=list(run.scripts),
        cache_latents=argv_of(run.cache_latents),
        cache_text_encoder=argv_of(run.cache_text_encoder),
        train_toml=str(train_toml),
        dataset_toml=str(dataset_toml),
        max_steps=cfg.train.max_steps,
        random_dit=str(cfg.model.flux) if cfg.model.get("random_preset") else None,
        metrics={"enabled": bool(cfg.logging.tensorboard), "images_per_step": int(cfg.train.batch_size)},
        lora=str(run_dir / f"{cfg.train.output_name}.safetensors"),
        comfy_copy=bool(cfg.train.comfy_copy),
        kernels={"set": str(cfg.kernels.get("set", "auto"))},
    )
    spec.write(run_dir)
    random = f"--random-model {spec.random_dit} " if spec.random_dit else ""
    steps = "\n".join(
        f"# {i}. python -m flux_trainer.musubi.script {random}{spec.musubi_tuner} {script} {shlex.join(args)}"
        for i, (script, args) in enumerate(
            ((run.scripts[0], spec.cache_latents), (run.scripts[1], spec.cache_text_encoder)), start=1
        )
    )
    (run_dir / "musubi_steps.txt").write_text(
        "# the run's steps, in order (the runner starts 1 and 2, then trains in its own process)\n"
        f"{steps}\n# 3. musubi_tuner.{run.scripts[2]} --config_file {train_toml} --dataset_config {dataset_toml}\n",
        encoding="utf-8",
    )
    return MusubiFiles(train_toml, dataset_toml, spec, said)


def write_config(cfg: DictConfig, run_dir: Path) -> None:
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))


def runner_json(run_dir: Path) -> dict[str, Any]:
    return json.loads((run_dir / "runner.json").read_text())
