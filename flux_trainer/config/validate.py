"""Checks that span fields, run before anything is written. Every problem is collected, then raised once.

Each message names the key, the bad value and the fix. Hydra already rejects unknown keys and wrong types
(the schema); what is left here is what a schema cannot say.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from flux_kernels.runtime.request import KERNEL_NAMES, parse_request
from flux_trainer.backend import BACKENDS, SDSCRIPTS, backend_for
from flux_trainer.backend.options import refusals
from flux_trainer.config.errors import ConfigError
from flux_trainer.config.random_specs import MODEL_TYPES, parts_for
from flux_trainer.config.refusals import output_name_problem
from flux_trainer.data.check import IMAGE_EXTENSIONS
from flux_trainer.data.subsets import resolutions_of, subsets_of

OPTIMIZERS = ("prodigy", "adamw", "adamw8bit", "adafactor")
# network=lokr | network=loha: the LyCORIS release whose 2-step CPU run on the tiny FLUX was checked (pyproject's
# `lycoris` extra pins the same)
LYCORIS = "lycoris-lora==4.1.3"
LYCORIS_ALGOS = ("lokr", "loha")
MEMORY_TIERS = ("auto", "cpu", "vram8", "vram12", "vram16", "vram24", "vram32", "vram48", "vram80")


def model_depth(model: DictConfig) -> tuple[int, int]:
    """(double, single) blocks of the model: a random preset's own shapes, else FLUX.1's 19 and 38."""
    from flux_trainer.config.random_specs import PRESETS

    preset = model.get("random_preset")
    shape = PRESETS[preset]["flux"] if preset in PRESETS else {"depth": 19, "depth_single_blocks": 38}
    return int(shape["depth"]), int(shape["depth_single_blocks"])


def max_blocks_to_swap(double: int, single: int) -> int:
    """The largest `blocks_to_swap` sd-scripts accepts (flux_models.Flux.enable_block_swap): n // 2 double blocks and
    2 (n - n // 2) single blocks swapped, each kind keeping 2 on the GPU (FLUX.1: 35)."""
    n = 0
    while (n + 1) // 2 <= double - 2 and 2 * ((n + 1) - (n + 1) // 2) <= single - 2:
        n += 1
    return n


def tier_gib(tier: str) -> float | None:
    """The card size a memory tier is for (`vram48` -> 48.0); None for `auto` and `cpu`."""
    size = str(tier).removeprefix("vram")
    return float(size) if size.isdigit() else None


FAMILIES = ("auto", "blackwell_consumer", "blackwell", "hopper", "ada", "ampere", "older", "cpu")
# fp8 base weights are stored in fp8 and multiplied in bf16 (sd-scripts' fp8_base) from Ampere on, which has bf16; fp8
# tensor-core matmuls (the fp8_matmul kernel) need Ada (sm_89) or newer, which the kernel's own check decides
FP8_FAMILIES = ("blackwell_consumer", "blackwell", "hopper", "ada", "ampere")
RESOLUTION_RANGE = (64, 2048)
# FLUX.2's variants (musubi-tuner's --model_version choices at the pinned commit)
FLUX2_VERSIONS = ("dev", "klein-4b", "klein-base-4b", "klein-9b", "klein-base-9b")
LOSS_TYPES = ("l2", "l1", "huber", "smooth_l1")  # sd-scripts' --loss_type choices
# sd-scripts' snr schedule reads the noise scheduler's alphas_cumprod, which FLUX's flow-matching scheduler lacks
HUBER_SCHEDULES = ("constant", "exponential")
MAX_VALIDATION_SPLIT = 0.5  # more held out than trained on is a mistake, not a choice


@dataclass
class DatasetScan:
    folder: Path
    images: dict[str, int] = field(default_factory=dict)  # extension -> count
    captioned: int = 0
    uncaptioned: list[str] = field(default_factory=list)

    @property
    def total(self) -> int:
        return sum(self.images.values())


def scan_dataset(folder: Path, caption_extension: str = ".txt") -> DatasetScan:
    """Count images by format and captions beside them (top level only, as sd-scripts reads an image_dir)."""
    scan = DatasetScan(folder)
    for entry in sorted(os.scandir(folder), key=lambda e: e.name):
        ext = os.path.splitext(entry.name)[1].lower()
        try:
            is_file = entry.is_file()
        except OSError:  # a link that loops: flux_trainer.data.check names it
            continue
        if not is_file or ext not in IMAGE_EXTENSIONS:
            continue
        scan.images[ext] = scan.images.get(ext, 0) + 1
        if (folder / (os.path.splitext(entry.name)[0] + caption_extension)).is_file():
            scan.captioned += 1
        else:
            scan.uncaptioned.append(entry.name)
    return scan


def available_datasets(search_dirs: list[Path]) -> list[str]:
    names = set()
    for d in search_dirs:
        names.update(p.stem for p in (d / "dataset").glob("*.yaml"))
    return sorted(names)


def no_dataset_message(search_dirs: list[Path]) -> str:
    found = available_datasets(search_dirs)
    where = " or ".join(str(d / "dataset") for d in search_dirs) or "configs/dataset"
    have = f"datasets found: {', '.join(found)}" if found else f"none found in {where}"
    return f"no dataset: add +dataset=NAME ({have}); create one with `flux-train dataset init NAME --images DIR`"


def _resolution_problems(d: DictConfig) -> list[str]:
    """Each resolution a whole multiple of 16 in RESOLUTION_RANGE, inside the buckets; a list not empty."""
    lo, hi = RESOLUTION_RANGE
    values = resolutions_of(d)
    if not values:
        return ["dataset.resolution=[]: give one resolution (1024) or several ([512, 768, 1024])"]
    out = []
    for res in values:
        if isinstance(res, bool) or not isinstance(res, int):
            out.append(f"dataset.resolution={res}: a whole number of pixels, or a list of them ([512, 768, 1024])")
            continue
        if res % 16 or not lo <= res <= hi:
            nearest = min(max(round(res / 64) * 64, lo), hi)
            out.append(
                f"dataset.resolution={res}: must be a multiple of 16 between {lo} and {hi} "
                f"(FLUX packs 2x2 latents of an 8x-downscaling AE); try dataset.resolution={nearest}"
            )
        elif d.enable_bucket and not d.min_bucket_reso <= res <= d.max_bucket_reso:
            out.append(
                f"dataset.resolution={res} is outside the buckets dataset.min_bucket_reso={d.min_bucket_reso} .. "
                f"dataset.max_bucket_reso={d.max_bucket_reso}; widen them"
            )
    if len(values) != len(set(map(str, values))):
        out.append(f"dataset.resolution={list(values)}: a resolution is listed twice; list each once")
    return out


def _check_folder(d: DictConfig, key: str, folder: Path, problems: list[str], alpha_mask: bool = False) -> None:
    if not folder.is_dir():
        problems.append(f"dataset '{d.name}': {folder} does not exist; set {key} to your image folder")
        return
    scan = scan_dataset(folder, d.caption_extension)
    if scan.total == 0:
        problems.append(f"dataset '{d.name}': {folder} has no images ({' '.join(IMAGE_EXTENSIONS)})")
    elif alpha_mask and (opaque := without_alpha(folder)):
        some = ", ".join(opaque[:3]) + (" ..." if len(opaque) > 3 else "")
        problems.append(
            f"alpha_mask: {len(opaque)} images of {folder} have no alpha channel ({some}); sd-scripts would learn all "
            "of them: save them as RGBA PNGs, or drop alpha_mask"
        )


def without_alpha(folder: Path) -> list[str]:
    """The images of `folder` whose mode carries no alpha channel (their header alone is read)."""
    from PIL import Image

    out = []
    for entry in sorted(os.scandir(folder), key=lambda e: e.name):
        if os.path.splitext(entry.name)[1].lower() not in IMAGE_EXTENSIONS:
            continue
        try:
            with Image.open(entry.path) as im:
                if im.mode in ("RGBA", "LA", "PA", "RGBa", "La") or "transparency" in im.info:
                    continue
        except OSError:
            continue  # not readable: flux_trainer.data.check names it
        out.append(entry.name)
    return out


def _check_subsets(d: DictConfig, problems: list[str]) -> None:
    """The folders of `subsets:`: each one there with images, its numbers in range, one of them not reg."""
    if d.images is not None:
        problems.append(
            f"dataset '{d.name}' has both images and subsets: list the folder {d.images} as a subset, or drop subsets"
        )
    seen: set[str] = set()
    for i, s in enumerate(d.subsets):
        key = f"dataset.subsets[{i}]"
        if s.repeats is not None and s.repeats < 1:
            problems.append(f"{key}.repeats={s.repeats}: must be at least 1")
        rate = s.caption_dropout_rate
        if rate is not None and not 0.0 <= rate <= 1.0:
            problems.append(f"{key}.caption_dropout_rate={rate}: a fraction of steps, 0 to 1 (0.05 is typical)")
        folder = Path(s.images).expanduser()
        if str(folder.absolute()) in seen:
            problems.append(f"{key}.images={s.images}: listed twice; list each folder once (repeats weights it)")
        seen.add(str(folder.absolute()))
        alpha = d.alpha_mask if s.get("alpha_mask") is None else s.alpha_mask
        _check_folder(d, f"{key}.images", folder, problems, bool(alpha) and not s.get("masks"))
        _check_masks(f"{key}.masks", s.get("masks"), problems)
    if all(s.is_reg for s in d.subsets):
        problems.append(f"dataset '{d.name}': every subset has is_reg: true; add a folder of the images to learn")


def _check_dataset(d: DictConfig, problems: list[str]) -> None:
    problems += _resolution_problems(d)
    if d.repeats < 1:
        problems.append(f"dataset.repeats={d.repeats}: must be at least 1")
    split = d.validation_split
    if not 0.0 <= split <= MAX_VALIDATION_SPLIT:
        problems.append(
            f"dataset.validation_split={split}: the fraction of images held out for the validation loss, "
            f"0 (none) to {MAX_VALIDATION_SPLIT}; try dataset.validation_split=0.1"
        )
    rate = d.caption_dropout_rate
    if not 0.0 <= rate <= 1.0:
        problems.append(f"dataset.caption_dropout_rate={rate}: a fraction of steps, 0 to 1 (0.05 is typical)")
    if d.subsets:
        _check_subsets(d, problems)
    elif d.images is None:
        problems.append(
            f"dataset '{d.name}' has no images: add images: /path/to/your/images (or subsets: a list of folders)"
        )
    else:
        _check_folder(d, "dataset.images", Path(d.images).expanduser(), problems, bool(d.alpha_mask) and not d.masks)
    if d.subsets and d.get("masks"):
        problems.append(f"dataset.masks={d.masks}: with subsets each folder names its own masks; move it to its subset")
    elif not d.subsets:
        _check_masks("dataset.masks", d.get("masks"), problems)


def _check_masks(key: str, masks: str | None, problems: list[str]) -> None:
    """A mask folder that is not there (its files are matched to the images at launch: data/masks.py)."""
    if masks is not None and not Path(masks).expanduser().is_dir():
        problems.append(f"{key}={masks} does not exist; set it to the folder of your mask images (named as the images)")


# Keys removed because their measured effect was nil (the measurements stay in docs): one release of warning.
REMOVED_KEYS = {
    "kernels.combo_kernels": "inductor's combo kernels measured 0.306 against 0.307 s/step and compiled ~9 s longer "
    "(docs/performance.md#inductors-tuning-knobs)",
    "kernels.offload_views": "since lora_fold's padded rows it finds nothing more to move (docs/kernels.md#lora_fold)",
}


def _check_lycoris(net: DictConfig, problems: list[str]) -> None:
    """network=lokr | loha go through LyCORIS' kohya wrapper, which knows none of lora_flux's own options."""
    if net.algo is None:
        if net.factor != -1:
            problems.append(f"network.factor={net.factor}: a LoKr setting; use network=lokr (or drop it)")
        return
    if net.algo not in LYCORIS_ALGOS:
        problems.append(f"network.algo={net.algo}: choose network=lokr or network=loha (or network=lora)")
    if net.module != "lycoris.kohya":
        problems.append(f"network.module={net.module}: network.algo={net.algo} needs network.module=lycoris.kohya")
    elif importlib.util.find_spec("lycoris") is None:
        problems.append(f"network={net.algo} needs LyCORIS, which is not installed: pip install {LYCORIS}")
    if net.algo != "lokr" and net.factor != -1:
        problems.append(f"network.factor={net.factor}: a LoKr setting; network={net.algo} has none")
    for key, value, default in (
        ("train_blocks", net.train_blocks, "all"),
        ("split_qkv", net.split_qkv, False),
        ("train_t5xxl", net.train_t5xxl, False),
        ("loraplus_lr_ratio", net.loraplus_lr_ratio, None),
    ):
        if value != default:
            problems.append(
                f"network.{key}={value}: not supported with network={net.algo} (LyCORIS; only {default} was "
                "checked); drop it or use network=lora"
            )


def validate(cfg: DictConfig, *, family: str | None = None, search_dirs: list[Path] | None = None) -> list[str]:
    """Raise ConfigError with every problem; return warnings (printed, not fatal).

    `family` is the detected GPU family when known (hardware.family=auto); fp8 needs one that has it.
    """
    problems: list[str] = []
    warnings: list[str] = [
        f"{key}={OmegaConf.select(cfg, key)} is removed and ignored: {why}; drop it (the next release refuses it)"
        for key, why in REMOVED_KEYS.items()
        if OmegaConf.select(cfg, key, default=None) is not None
    ]
    if OmegaConf.is_missing(cfg, "dataset"):
        problems.append(no_dataset_message(search_dirs or []))
    else:
        _check_dataset(cfg.dataset, problems)
    backend = _check_backend(cfg, problems)

    net = cfg.network
    if net.rank <= 0:
        problems.append(f"network.rank={net.rank}: must be a positive integer (16 is a good start)")
    if net.alpha <= 0:
        problems.append(f"network.alpha={net.alpha}: must be positive (alpha = rank gives a LoRA scale of 1)")
    if net.train_blocks not in ("all", "single", "double"):
        problems.append(f"network.train_blocks={net.train_blocks}: choose all, single or double")
    if net.train_t5xxl and cfg.cache.text_encoder_outputs:
        problems.append("network.train_t5xxl=true needs cache.text_encoder_outputs=false (a trained T5 changes them)")
    _check_lycoris(net, problems)

    opt = cfg.optimizer
    if opt.name not in OPTIMIZERS:
        problems.append(f"optimizer.name={opt.name}: unknown; choose optimizer={' | optimizer='.join(OPTIMIZERS)}")
    if opt.lr <= 0:
        problems.append(f"optimizer.lr={opt.lr}: must be positive")
    if cfg.precision.mixed not in ("no", "fp16", "bf16"):
        problems.append(f"precision.mixed={cfg.precision.mixed}: choose no, fp16 or bf16")
    if cfg.precision.save not in ("float", "fp16", "bf16"):
        problems.append(f"precision.save={cfg.precision.save}: choose float, fp16 or bf16")

    mem = cfg.memory
    if mem.tier not in MEMORY_TIERS:
        problems.append(f"memory.tier={mem.tier}: choose memory={' | memory='.join(MEMORY_TIERS)}")
    if mem.blocks_to_swap and mem.cpu_offload_checkpointing:
        problems.append(
            "memory.blocks_to_swap and memory.cpu_offload_checkpointing cannot be combined (sd-scripts forbids it); "
            "set memory.cpu_offload_checkpointing=false or memory.blocks_to_swap=0"
        )
    if mem.blocks_to_swap < 0:
        problems.append(f"memory.blocks_to_swap={mem.blocks_to_swap}: must be 0 or more")
    elif backend != SDSCRIPTS:
        pass  # the other backend's translation fits the count to the model (flux_trainer/musubi/translate.py)
    elif mem.blocks_to_swap > (most := max_blocks_to_swap(*model_depth(cfg.model))):
        problems.append(
            f"memory.blocks_to_swap={mem.blocks_to_swap}: this model swaps at most {most} (sd-scripts keeps 2 double "
            "and 2 single blocks on the GPU)"
        )
    elif mem.blocks_to_swap == 1:
        problems.append(
            "memory.blocks_to_swap=1 swaps no double block (sd-scripts swaps n // 2 of them), and sd-scripts then "
            "leaves every double block on the CPU: choose 0 or 2 and more"
        )
    try:
        skip = checkpoint_skip_setting(mem.get("checkpoint_skip", CHECKPOINT_SKIP_AUTO))
    except ValueError as e:
        problems.append(str(e))
    else:
        if skip not in (0, CHECKPOINT_SKIP_AUTO) and (mem.blocks_to_swap or mem.cpu_offload_checkpointing):
            problems.append(
                f"memory.checkpoint_skip={skip} keeps activations on the GPU, against what memory.blocks_to_swap / "
                "memory.cpu_offload_checkpointing are for; set memory.checkpoint_skip=0 (or auto) with them"
            )

    hw = cfg.hardware.family
    if hw not in FAMILIES:
        problems.append(f"hardware.family={hw}: choose one of {', '.join(FAMILIES)}")
    effective_family = family if hw == "auto" else hw
    fp8 = mem.fp8_base if mem.fp8_base is not None else cfg.precision.fp8_base
    if fp8 and effective_family is not None and effective_family not in FP8_FAMILIES + ("auto",):
        problems.append(
            f"fp8 base weights (precision=fp8_base or memory={mem.tier}) need an Ampere (sm_80) or newer GPU; "
            f"this GPU family is {effective_family}: use precision=bf16 and a larger memory tier"
        )

    if problem := kernel_set_problem(cfg.kernels.set):
        problems.append(problem)
    if cfg.kernels.attention not in ("sdpa", "xformers"):
        problems.append(f"kernels.attention={cfg.kernels.attention}: choose sdpa or xformers")

    tr = cfg.train
    if tr.max_steps is None and tr.max_epochs is None:
        problems.append("train.max_steps and train.max_epochs are both null: set one of them")
    for key in ("max_steps", "max_epochs", "save_every_n_steps", "save_every_n_epochs", "save_last_n"):
        value = tr[key]
        if value is not None and value < 1:
            problems.append(f"train.{key}={value}: must be at least 1, or null")
    if tr.batch_size < 1 or tr.gradient_accumulation_steps < 1:
        problems.append("train.batch_size and train.gradient_accumulation_steps must be at least 1")
    if not OmegaConf.is_missing(cfg, "dataset") and (problem := output_name_problem(tr.output_name)):
        problems.append(problem)
    _check_loss_and_validation(cfg, problems, warnings)

    lg = cfg.logging
    if lg.profile_at is not None and (lg.profile_at < 1 or lg.profile_steps < 1):
        problems.append(
            f"logging.profile_at={lg.profile_at}, logging.profile_steps={lg.profile_steps}: both must be at least 1 "
            "(profile_at is the first profiled optimizer step; null turns profiling off)"
        )
    if lg.get("memory_snapshot_at") is not None and lg.memory_snapshot_at < 1:
        problems.append(
            f"logging.memory_snapshot_at={lg.memory_snapshot_at}: the optimizer step to record, at least 1 (null: off)"
        )
    gpus = cfg.launcher.gpus
    if not (gpus == "all" or (isinstance(gpus, int) and gpus >= 1)):
        problems.append(f"launcher.gpus={gpus}: a positive number or 'all'")
    if cfg.resume not in ("off", "auto") and not Path(cfg.resume).expanduser().is_dir():
        problems.append(f"resume={cfg.resume}: not a saved state folder; use resume=auto or resume=off")

    if cfg.sample.prompts and cfg.sample.every_n_steps is None and cfg.sample.every_n_epochs is None:
        warnings.append("sample.prompts is set but neither sample.every_n_steps nor every_n_epochs: no samples")

    model_type = cfg.model.get("model_type", "flux")
    if model_type not in MODEL_TYPES:
        problems.append(f"model.model_type={model_type}: unknown; choose {', '.join(MODEL_TYPES)}")
    elif not cfg.model.get("random_preset"):
        for part in parts_for(model_type):
            path = Path(str(cfg.model[part])).expanduser()
            if not path.is_file():
                msg = f"model.{part}: {path} does not exist; run `flux-train setup --models` or set model.{part}=PATH"
                (warnings if cfg.dry_run else problems).append(msg)
    if problems:
        raise ConfigError(problems)
    return warnings


def _check_backend(cfg: DictConfig, problems: list[str]) -> str | None:
    """The trainer the model's type names (flux_trainer.backend), and every key set that this trainer would not
    use; a Kontext dataset must name its reference images. None for an unknown model_type (reported elsewhere)."""
    model_type = str(cfg.model.get("model_type", "flux"))
    if model_type not in BACKENDS:
        return None
    backend = backend_for(model_type)
    problems += refusals(cfg, backend, str(cfg.model.name))
    if model_type == "flux2" and cfg.model.get("model_version") not in FLUX2_VERSIONS:
        problems.append(
            f"model.model_version={cfg.model.get('model_version')}: FLUX.2 needs one of {', '.join(FLUX2_VERSIONS)} "
            "(the model=flux2_* presets set it)"
        )
    if model_type == "kontext" and not OmegaConf.is_missing(cfg, "dataset") and not cfg.dataset.get("control_images"):
        problems.append(
            f"dataset '{cfg.dataset.name}': model={cfg.model.name} edits a reference image, and the dataset names "
            "none; add `control_images: /path/to/references` (one per image, same name) to its YAML"
        )
    _check_sample_references(cfg, model_type, problems)
    return backend


def _check_sample_references(cfg: DictConfig, model_type: str, problems: list[str]) -> None:
    """Kontext samples edit a reference image: one for every prompt or one per prompt, each an image that opens (a
    bad one would stop the run at its first sample, after the caching and the first steps). Other models take none."""
    s = cfg.sample
    refs = [str(r) for r in s.get("references") or []]
    if model_type != "kontext":
        if refs:
            problems.append(
                f"sample.references: model={cfg.model.name} samples from the prompt alone; only Kontext edits a "
                "reference image; remove sample.references"
            )
        return
    if s.prompts and not refs:
        problems.append(
            f"sample.prompts: model={cfg.model.name} samples by editing a reference image; add "
            "sample.references=[/path/to/reference.png] (one for every prompt, or one per prompt in their order)"
        )
        return
    if refs and len(refs) not in (1, len(s.prompts)):
        problems.append(
            f"sample.references: {len(refs)} images for {len(s.prompts)} prompts; give one for every prompt or one "
            "per prompt"
        )
    for ref in refs:
        path = Path(ref).expanduser()
        if not path.is_file():
            problems.append(f"sample.references: {ref} is not a file")
        elif path.suffix.lower() not in IMAGE_EXTENSIONS:
            problems.append(f"sample.references: {ref} is not an image ({', '.join(IMAGE_EXTENSIONS)})")
        elif (why := _unreadable_image(path)) is not None:
            problems.append(f"sample.references: {ref} does not open as an image ({why})")


def _unreadable_image(path: Path) -> str | None:
    from PIL import Image

    try:
        with Image.open(path) as im:
            im.verify()
    except Exception as exc:  # noqa: BLE001 - any failure to decode is the answer
        return f"{type(exc).__name__}: {str(exc)[:120]}"
    return None


def _check_loss_and_validation(cfg: DictConfig, problems: list[str], warnings: list[str]) -> None:
    tr = cfg.train
    if tr.loss_type not in LOSS_TYPES:
        problems.append(f"train.loss_type={tr.loss_type}: unknown; choose {', '.join(LOSS_TYPES)}")
    elif tr.loss_type in ("huber", "smooth_l1"):
        if tr.huber_schedule not in HUBER_SCHEDULES:
            why = " (snr needs a noise schedule FLUX's flow matching has not)" if tr.huber_schedule == "snr" else ""
            problems.append(f"train.huber_schedule={tr.huber_schedule}: choose {' or '.join(HUBER_SCHEDULES)}{why}")
        if not 0.0 < tr.huber_c <= 1.0:
            problems.append(f"train.huber_c={tr.huber_c}: must be above 0 and at most 1 (0.1 is sd-scripts' default)")
    for key in ("validate_every_n_steps", "max_validation_steps"):
        if tr[key] is not None and tr[key] < 1:
            problems.append(f"train.{key}={tr[key]}: must be at least 1, or null")
    if OmegaConf.is_missing(cfg, "dataset"):
        return
    d = cfg.dataset
    rates = [s.caption_dropout_rate for s in subsets_of(d) if 0 < s.caption_dropout_rate <= 1]
    if rates and cfg.cache.text_encoder_outputs:
        problems.append(
            f"dataset.caption_dropout_rate={max(rates)} needs cache.text_encoder_outputs=false "
            "(sd-scripts cannot drop a cached caption; the text encoders then stay loaded while training)"
        )
    if tr.prior_loss_weight < 0:
        problems.append(
            f"train.prior_loss_weight={tr.prior_loss_weight}: must be 0 or more (1.0: reg images as others)"
        )
    elif tr.prior_loss_weight != 1.0 and not any(s.is_reg for s in subsets_of(d)):
        warnings.append(
            f"train.prior_loss_weight={tr.prior_loss_weight} but no subset has is_reg: true; it weighs nothing"
        )
    if tr.validate_every_n_steps is not None and not d.validation_split:
        warnings.append(
            f"train.validate_every_n_steps={tr.validate_every_n_steps} but dataset.validation_split is 0: "
            "no validation loss; set dataset.validation_split=0.1"
        )


CHECKPOINT_SKIP_AUTO = "auto"


def checkpoint_skip_setting(value) -> str | int:
    """memory.checkpoint_skip as `auto` or a count of blocks; ValueError for anything else."""
    text = str(value).strip().lower()
    if text == CHECKPOINT_SKIP_AUTO:
        return CHECKPOINT_SKIP_AUTO
    if text.isdigit():
        return int(text)
    raise ValueError(f"memory.checkpoint_skip={value}: choose auto or a number of blocks (0 checkpoints every block)")


def kernel_set_problem(kernel_set: str) -> str | None:
    """What is wrong with kernels.set (None: nothing), before the model loads: unknown names, `-name` without auto."""
    try:
        parse_request(str(kernel_set), KERNEL_NAMES)  # the registry's names, without importing torch and the kernels
    except ValueError as e:
        return f"kernels.set={kernel_set}: {e}"
    return None
