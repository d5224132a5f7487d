"""Run config -> musubi-tuner's dataset TOML, its training TOML, and the arguments of its two caching scripts.

Pure: the plan's config and the run's folders in, documents and argument dicts out. This is the only module that
knows musubi-tuner's flag names. One run is three steps of musubi-tuner (latents cached, text-encoder outputs
cached, then training); every key of each is checked against that script's parser in the committed schema
(parser_schema.json) before anything runs, and by the live parsers when the checkout is present (live_check.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from flux_trainer.backend.samples import SAMPLE_FILE
from flux_trainer.backend.toml_doc import Document, Item
from flux_trainer.data.subsets import resolutions_of
from flux_trainer.musubi.parser_schema import SCRIPTS, check_script_keys
from flux_trainer.musubi.stage import MusubiFolders

# musubi-tuner's LoRA module per architecture (docs/flux_2.md, docs/flux_kontext.md)
NETWORK_MODULES = {"flux2": "networks.lora_flux_2", "kontext": "networks.lora_flux"}
# the most blocks its block swap takes with fp8 weights (docs/flux_2.md's table; Kontext from FLUX.1's 19 double and
# 38 single blocks: n // 2 double and 2 (n - n // 2) + 1 single swapped, each kind keeping 2 on the GPU)
MAX_BLOCKS_TO_SWAP = {"dev": 29, "klein-4b": 13, "klein-base-4b": 13, "klein-9b": 16, "klein-base-9b": 16}
KONTEXT_MAX_BLOCKS_TO_SWAP = 34
# our optimizer.type -> what musubi-tuner imports: it knows AdamW, AdamW8bit and Adafactor by name and imports any
# other `module.Class` (a bare name is looked up in torch.optim, where Prodigy is not)
OPTIMIZER_TYPES = {"Prodigy": "prodigyopt.Prodigy"}
# FLUX.2 dev's text encoder (Mistral 3) has no fp8 mode in musubi-tuner
NO_FP8_TEXT_ENCODER = ("dev",)


@dataclass(frozen=True)
class MusubiRun:
    """The three steps' inputs: script module names in order, the dataset TOML, each step's flags."""

    scripts: tuple[str, str, str]
    dataset: Document
    cache_latents: dict[str, Any]
    cache_text_encoder: dict[str, Any]
    train: Document

    def problems(self) -> list[str]:
        """Every flag of every step against its script's committed parser schema (empty when all are clean)."""
        latents, text, train = self.scripts
        return [
            *check_script_keys(latents, self.cache_latents),
            *check_script_keys(text, self.cache_text_encoder),
            *check_script_keys(train, self.train.flat()),
        ]


def fp8_base(cfg: DictConfig) -> bool:
    """The memory tier may force fp8 base weights (small cards); otherwise the precision preset decides."""
    return bool(cfg.memory.fp8_base) if cfg.memory.fp8_base is not None else bool(cfg.precision.fp8_base)


def blocks_to_swap(cfg: DictConfig) -> tuple[int, str | None]:
    """The memory tier's block count fitted to this model (musubi-tuner asserts past its maximum), and a line saying
    so when it was lowered."""
    asked = int(cfg.memory.blocks_to_swap or 0)
    model_type = str(cfg.model.model_type)
    version = cfg.model.get("model_version")
    most = KONTEXT_MAX_BLOCKS_TO_SWAP if model_type == "kontext" else MAX_BLOCKS_TO_SWAP.get(str(version), 0)
    if asked <= most:
        return asked, None
    return most, f"memory.blocks_to_swap={asked}: {cfg.model.name} swaps at most {most}; {most} swapped"


def text_encoder_fp8(cfg: DictConfig) -> bool:
    """memory.t5xxl_fp8 (a small card's tier): the text encoder encodes in fp8 where musubi-tuner can."""
    return bool(cfg.memory.get("t5xxl_fp8")) and cfg.model.get("model_version") not in NO_FP8_TEXT_ENCODER


def model_flags(cfg: DictConfig) -> dict[str, Any]:
    """The text encoders' flags, the same in the text-encoder cache and the trainer (which reads them for samples)."""
    m = cfg.model
    if m.model_type == "flux2":
        return {"model_version": str(m.model_version), "text_encoder": str(m.text_encoder)}
    return {"text_encoder1": str(m.t5xxl), "text_encoder2": str(m.clip_l)}


def dataset_document(cfg: DictConfig, folders: list[MusubiFolders]) -> Document:
    """musubi-tuner's dataset config: one [[datasets]] per folder and resolution (each with its own cache folder, as
    musubi-tuner requires), the shared values in [general]."""
    d = cfg.dataset
    doc = Document(header="musubi-tuner dataset config, written by flux-train (--dataset_config)")
    g = doc.table("general")
    g.add("caption_extension", str(d.caption_extension))
    g.add("batch_size", int(cfg.train.batch_size))
    g.add("enable_bucket", bool(d.enable_bucket), "aspect-ratio buckets, so images are not cropped square")
    g.add("bucket_no_upscale", bool(d.bucket_no_upscale))
    resolutions = [int(r) for r in resolutions_of(d)]
    for folder in folders:
        for res in resolutions:
            ds = doc.table("datasets", array=True)
            ds.add("resolution", [res, res])
            ds.add(
                "image_directory", str(folder.images), "the staged images, captions with the trigger word written in"
            )
            ds.add("cache_directory", str(folder.cache / str(res) if len(resolutions) > 1 else folder.cache))
            ds.add("num_repeats", int(d.repeats))
            if folder.control is not None:
                ds.add("control_directory", str(folder.control), "the reference images, named as their images")
    return doc


def cache_latents_flags(cfg: DictConfig, dataset_toml: Path) -> dict[str, Any]:
    flags: dict[str, Any] = {
        "dataset_config": str(dataset_toml),
        "vae": str(cfg.model.ae),
        "batch_size": int(cfg.cache.vae_batch_size),
        "skip_existing": True,  # the cache folder is keyed by what its files are made from (stage.py)
    }
    if cfg.model.model_type == "flux2":
        flags["model_version"] = str(cfg.model.model_version)
    return flags


def cache_text_encoder_flags(cfg: DictConfig, dataset_toml: Path) -> dict[str, Any]:
    flags: dict[str, Any] = {"dataset_config": str(dataset_toml), **model_flags(cfg), "skip_existing": True}
    if text_encoder_fp8(cfg):
        flags["fp8_text_encoder" if cfg.model.model_type == "flux2" else "fp8_t5"] = True
    return flags


def optimizer_args(args: dict[str, Any]) -> list[Item]:
    """`key=value` strings as musubi-tuner's get_optimizer reads them (split on '=', ast.literal_eval)."""
    items = []
    for key, value in args.items():
        text = f"{key}={value!r}" if not isinstance(value, (list, tuple)) else f"{key}={tuple(value)!r}"
        if text.count("=") != 1:
            raise ValueError(f"optimizer.args.{key}: musubi-tuner splits on '=', so the value may not contain '='")
        items.append(Item(text))
    return items


def training_document(cfg: DictConfig, run_dir: Path, resume: Path | None = None) -> tuple[Document, list[str]]:
    """The trainer's TOML (--config_file; --dataset_config is given on its command line) and lines to show.
    `resume`: the state folder to continue from (app.resume_state chose it)."""
    m, tr, said = cfg.model, cfg.train, []
    doc = Document(header=f"musubi-tuner {SCRIPTS[str(m.model_type)][2]}.py --config_file, written by flux-train")
    t = doc.table("model")
    t.add("dit", str(m.flux))
    t.add("vae", str(m.ae))
    for key, value in model_flags(cfg).items():
        t.add(key, value)
    t.add("sdpa", cfg.kernels.attention == "sdpa" or None, "PyTorch's scaled-dot-product attention")
    t.add("xformers", cfg.kernels.attention == "xformers" or None)

    n = doc.table("network")
    n.add("network_module", NETWORK_MODULES[str(m.model_type)], "musubi-tuner's LoRA module for this architecture")
    n.add("network_dim", int(cfg.network.rank))
    n.add("network_alpha", float(cfg.network.alpha))
    n.add("network_dropout", None if cfg.network.dropout is None else float(cfg.network.dropout))
    n.add("network_weights", cfg.network.weights)

    o = doc.table("optimizer")
    o.add("optimizer_type", OPTIMIZER_TYPES.get(str(cfg.optimizer.type), str(cfg.optimizer.type)))
    o.add("learning_rate", float(cfg.optimizer.lr))
    o.add("optimizer_args", optimizer_args(dict(cfg.optimizer.args)) or None)
    o.add("lr_scheduler", str(cfg.optimizer.scheduler))
    o.add("lr_warmup_steps", int(cfg.optimizer.warmup_steps) or None)
    o.add("max_grad_norm", float(cfg.optimizer.max_grad_norm))

    p = doc.table("precision")
    p.add("mixed_precision", str(cfg.precision.mixed))
    p.add("save_precision", str(cfg.precision.save))
    fp8 = fp8_base(cfg)
    p.add("fp8_base", fp8 or None, "frozen transformer weights in fp8")
    p.add("fp8_scaled", fp8 or None, "with per-weight scales (musubi-tuner recommends it with fp8_base)")

    mem = doc.table("memory")
    mem.add("gradient_checkpointing", bool(cfg.memory.gradient_checkpointing) or None)
    mem.add("gradient_checkpointing_cpu_offload", bool(cfg.memory.cpu_offload_checkpointing) or None)
    swap, line = blocks_to_swap(cfg)
    mem.add("blocks_to_swap", swap or None, "blocks kept on the CPU between uses (the memory tier)")
    mem.add(
        "use_pinned_memory_for_block_swap", bool(swap) or None,
        "page-locked host copies: musubi-tuner's default copies from pageable memory, several times slower",
    )  # fmt: skip
    if line:
        said.append(line)

    t = doc.table("training")
    t.add("timestep_sampling", str(tr.timestep_sampling))
    t.add("weighting_scheme", "none")
    t.add("max_train_steps", tr.max_steps)
    t.add("max_train_epochs", tr.max_epochs)
    t.add("gradient_accumulation_steps", int(tr.gradient_accumulation_steps))
    t.add("seed", int(tr.seed))
    t.add("max_data_loader_n_workers", int(tr.data_loader_workers))
    t.add("persistent_data_loader_workers", tr.data_loader_workers > 0 or None)

    s = doc.table("save")
    s.add("output_dir", str(run_dir))
    s.add("output_name", str(tr.output_name))
    s.add("save_every_n_steps", tr.save_every_n_steps)
    s.add("save_every_n_epochs", tr.save_every_n_epochs)
    if tr.save_last_n and tr.save_every_n_steps:
        keep = int(tr.save_last_n) * int(tr.save_every_n_steps)
        s.add("save_last_n_steps", keep, f"keep the last {tr.save_last_n} snapshots")
        if tr.save_state:
            s.add("save_last_n_steps_state", keep)
    s.add("save_state", bool(tr.save_state) or None, "optimizer and data position too, so resume=auto loses nothing")
    s.add("resume", str(resume) if resume is not None else None, "the saved state this run continues from")

    if cfg.sample.prompts:
        sp = doc.table("sample")
        sp.add("sample_prompts", str(run_dir / SAMPLE_FILE), "one prompt a line (flux-train's sample.prompts)")
        sp.add("sample_every_n_steps", cfg.sample.every_n_steps)
        sp.add("sample_every_n_epochs", cfg.sample.every_n_epochs)
        # the trainer encodes the prompts itself, before training: in fp8 where the tier caches the captions so
        sp.add("fp8_text_encoder", (m.model_type == "flux2" and text_encoder_fp8(cfg)) or None)

    lg = doc.table("logging")
    if cfg.logging.tensorboard:
        lg.add("log_with", "tensorboard")
        lg.add("logging_dir", str(run_dir / "tb"))
    return doc, said


def translate(
    cfg: DictConfig, run_dir: Path, folders: list[MusubiFolders], resume: Path | None = None
) -> tuple[MusubiRun, list[str]]:
    """The whole run for musubi-tuner, and lines to show (a block count lowered to the model's maximum)."""
    dataset_toml = run_dir / "dataset.toml"
    train, said = training_document(cfg, run_dir, resume)
    run = MusubiRun(
        scripts=SCRIPTS[str(cfg.model.model_type)],
        dataset=dataset_document(cfg, folders),
        cache_latents=cache_latents_flags(cfg, dataset_toml),
        cache_text_encoder=cache_text_encoder_flags(cfg, dataset_toml),
        train=train,
    )
    return run, said


def argv_of(flags: dict[str, Any]) -> list[str]:
    """Flags as a script's command line: `--flag` for True (False and None left out), a list as several values."""
    out: list[str] = []
    for key, value in flags.items():
        if value is None or value is False:
            continue
        out.append(f"--{key}")
        if value is True:
            continue
        out += [str(v) for v in value] if isinstance(value, (list, tuple)) else [str(value)]
    return out
