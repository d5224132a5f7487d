"""Run config -> sd-scripts' training TOML and dataset TOML. Pure: config in, two documents out.

This is the only module that knows sd-scripts' flag names. Every key written here is checked against the
pinned parser's schema (`parser_schema.json`) before a run starts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from flux_trainer.backend.toml_doc import Document, Item, Table
from flux_trainer.data.subsets import Subset, resolutions_of, subsets_of

# Why each optimizer argument has the value it has; shown beside the value in sd_scripts.toml.
OPTIMIZER_ARG_REASONS = {
    "decouple": "AdamW-style decoupled weight decay (Prodigy authors' recommendation)",
    "weight_decay": "mild decay against LoRA weights growing without bound",
    "use_bias_correction": "Adam bias correction: Prodigy authors recommend it for diffusion fine-tuning",
    "safeguard_warmup": "keeps the estimated step size from blowing up early (Prodigy authors' advice)",
    "d_coef": "scale on Prodigy's estimated step size; 1.0 = as estimated",
    "betas": "Adam moment decay rates",
    "relative_step": "use our learning rate, not Adafactor's internal schedule",
    "scale_parameter": "no parameter-scale adaptation with a fixed learning rate",
    "warmup_init": "no Adafactor internal warm-up with a fixed learning rate",
}


@dataclass(frozen=True)
class RunPaths:
    """Everything in the TOML that depends on where the run lives, decided by the caller."""

    run_dir: Path
    tokenizer_dir: Path | None = None
    sample_prompts: Path | None = None  # written by the caller when cfg.sample.prompts is not empty
    resume_state: Path | None = None
    tracker_config: Path | None = None  # written by the caller (tracker_document) when TensorBoard is on
    # the folders sd-scripts reads (flux_trainer.data.stage), one per subset; None: the dataset's own
    images: Path | tuple[Path, ...] | None = None

    @property
    def output_dir(self) -> Path:
        return self.run_dir

    @property
    def logging_dir(self) -> Path:
        return self.run_dir / "tb"


def fp8_base(cfg: DictConfig) -> bool:
    """The memory tier may force fp8 base weights (small cards); otherwise the precision preset decides."""
    return bool(cfg.memory.fp8_base) if cfg.memory.fp8_base is not None else bool(cfg.precision.fp8_base)


def literal(value: Any) -> str:
    """A value as `ast.literal_eval` (sd-scripts' optimizer_args parser) reads it back."""
    if isinstance(value, (list, tuple)):
        return "(" + ",".join(literal(v) for v in value) + ("," if len(value) == 1 else "") + ")"
    return repr(value)


def optimizer_args(args: dict[str, Any]) -> list[Item]:
    items = []
    for key, value in args.items():
        text = f"{key}={literal(value)}"
        if text.count("=") != 1:
            raise ValueError(f"optimizer.args.{key}: sd-scripts splits on '=', so the value may not contain '='")
        items.append(Item(text, OPTIMIZER_ARG_REASONS.get(key, "")))
    return items


def lycoris_args(net: DictConfig) -> list[Item]:
    """`key=value` strings as LyCORIS' lycoris/kohya.py `create_network` reads them (`kwargs.get`, then int/float)."""
    items = [Item(f"algo={net.algo}", "LyCORIS algorithm; the LoRA file's ss_network_args names it")]
    if net.algo == "lokr":
        items.append(Item(f"factor={int(net.factor)}", "LoKr: Kronecker factor (-1: most balanced split)"))
    items.append(Item("conv_dim=0", "no convolution adapters (FLUX's blocks have none)"))
    return items


def network_args(net: DictConfig) -> list[Item]:
    """`key=value` strings exactly as networks/lora_flux.py reads them: booleans are compared to "True"."""
    if net.algo is not None:
        return lycoris_args(net)
    items = [Item(f"train_blocks={net.train_blocks}", "which FLUX blocks get LoRA: all | single | double")]
    if net.split_qkv:
        items.append(Item("split_qkv=True", "separate LoRA for q, k and v"))
    if net.train_t5xxl:
        items.append(Item("train_t5xxl=True", "LoRA on T5-XXL too (disables text-encoder output caching)"))
    if net.loraplus_lr_ratio is not None:
        items.append(Item(f"loraplus_lr_ratio={float(net.loraplus_lr_ratio)!r}", "LoRA+: B matrices learn faster"))
    return items


def training_document(cfg: DictConfig, paths: RunPaths) -> Document:
    doc = Document(
        header="sd-scripts training arguments, written by flux-train (flux_train_network.py --config_file).\n"
        "Every key is checked against the pinned sd-scripts parser; edit the Hydra config, not this file."
    )
    m = doc.table("model")
    chroma = cfg.model.get("model_type", "flux") == "chroma"
    m.add("model_type", "chroma" if chroma else None, "Chroma: T5 only, sd-scripts gives it a dummy CLIP-L")
    m.add("pretrained_model_name_or_path", str(cfg.model.flux), f"FLUX transformer ({cfg.model.name})")
    m.add("ae", str(cfg.model.ae))
    m.add("clip_l", None if chroma else str(cfg.model.clip_l))
    m.add("t5xxl", str(cfg.model.t5xxl))
    m.add("apply_t5_attn_mask", chroma or None, "Chroma's blocks read the caption's length from the T5 mask")
    m.add("t5xxl_max_token_length", cfg.model.t5xxl_max_token_length)
    m.add(
        "tokenizer_cache_dir", str(paths.tokenizer_dir) if paths.tokenizer_dir else None, "offline after the first run"
    )

    n = doc.table("network")
    n.add("network_module", cfg.network.module)
    n.add("network_dim", int(cfg.network.rank), "LoRA rank")
    n.add("network_alpha", float(cfg.network.alpha), "LoRA scale is alpha / rank")
    n.add("network_dropout", None if cfg.network.dropout is None else float(cfg.network.dropout))
    n.add("network_args", network_args(cfg.network))
    n.add("network_train_unet_only", not cfg.network.train_t5xxl, "text encoders frozen: their outputs can be cached")
    n.add("network_weights", cfg.network.weights)

    o = doc.table("optimizer")
    o.add("optimizer_type", cfg.optimizer.type)
    o.add("learning_rate", float(cfg.optimizer.lr))
    o.add("optimizer_args", optimizer_args(dict(cfg.optimizer.args)))
    o.add("lr_scheduler", cfg.optimizer.scheduler)
    o.add("lr_warmup_steps", int(cfg.optimizer.warmup_steps) or None)
    o.add("max_grad_norm", float(cfg.optimizer.max_grad_norm))

    p = doc.table("precision")
    p.add("mixed_precision", cfg.precision.mixed)
    p.add("save_precision", cfg.precision.save)
    p.add("fp8_base", fp8_base(cfg) or None, "frozen FLUX weights in fp8 e4m3")
    # a CPU's bf16 convolutions are ~300x slower than fp32 (2 cores: 3.9 s against 13 ms for one 64-channel 128² conv)
    p.add("no_half_vae", cfg.memory.tier == "cpu" or None, "the AE in fp32: bf16 convolutions crawl on a CPU")

    mem = doc.table("memory", comment=f"memory tier: {cfg.memory.tier}")
    mem.add("gradient_checkpointing", bool(cfg.memory.gradient_checkpointing) or None)
    mem.add("cpu_offload_checkpointing", bool(cfg.memory.cpu_offload_checkpointing) or None)
    mem.add("blocks_to_swap", int(cfg.memory.blocks_to_swap) or None, "blocks kept on the CPU between uses")
    mem.add("sdpa", cfg.kernels.attention == "sdpa" or None, "PyTorch scaled_dot_product_attention")
    mem.add("xformers", cfg.kernels.attention == "xformers" or None)

    c = doc.table(
        "caching", comment="encode images and captions once; training then needs neither AE nor text encoders"
    )
    c.add("cache_latents", bool(cfg.cache.latents) or None)
    c.add("cache_latents_to_disk", bool(cfg.cache.latents_to_disk) or None)
    c.add("cache_text_encoder_outputs", bool(cfg.cache.text_encoder_outputs) or None)
    c.add("cache_text_encoder_outputs_to_disk", bool(cfg.cache.text_encoder_outputs_to_disk) or None)
    c.add("vae_batch_size", int(cfg.cache.vae_batch_size))

    t = doc.table("training")
    t.add("max_train_steps", cfg.train.max_steps)
    t.add("max_train_epochs", cfg.train.max_epochs)
    t.add("gradient_accumulation_steps", int(cfg.train.gradient_accumulation_steps))
    t.add("seed", int(cfg.train.seed))
    shifted = cfg.train.timestep_sampling == "flux_shift"
    t.add("timestep_sampling", cfg.train.timestep_sampling, "resolution-dependent shift, as FLUX was trained" * shifted)
    t.add("model_prediction_type", cfg.train.model_prediction_type, "the model's output is the flow target as is")
    why = "0.0: Chroma is not guidance-distilled" if chroma else "1.0 for LoRA training on FLUX.1-dev"
    t.add("guidance_scale", float(cfg.train.guidance_scale), why)
    t.add("discrete_flow_shift", float(cfg.train.discrete_flow_shift))
    t.add("loss_type", cfg.train.loss_type)
    if any(s.is_reg for s in subsets_of(cfg.dataset)):
        t.add("prior_loss_weight", float(cfg.train.prior_loss_weight), "the loss of regularisation images times this")
    if cfg.train.loss_type in ("huber", "smooth_l1"):
        t.add("huber_c", float(cfg.train.huber_c))
        t.add("huber_schedule", cfg.train.huber_schedule, "sd-scripts' default, snr, fails on FLUX's scheduler")
    t.add("max_data_loader_n_workers", int(cfg.train.data_loader_workers))
    t.add("persistent_data_loader_workers", cfg.train.data_loader_workers > 0 or None)

    s = doc.table("saving")
    s.add("output_dir", str(paths.output_dir))
    s.add("output_name", cfg.train.output_name)
    s.add("save_model_as", "safetensors")
    s.add("save_every_n_steps", cfg.train.save_every_n_steps)
    s.add("save_every_n_epochs", cfg.train.save_every_n_epochs)
    if cfg.train.save_last_n and cfg.train.save_every_n_steps:
        keep = int(cfg.train.save_last_n) * int(cfg.train.save_every_n_steps)
        s.add("save_last_n_steps", keep, f"keep the last {cfg.train.save_last_n} snapshots")
        if cfg.train.save_state:
            s.add("save_last_n_steps_state", keep)
    s.add("save_state", bool(cfg.train.save_state) or None, "optimizer state too, so resume=auto loses nothing")
    s.add("save_state_on_train_end", bool(cfg.train.save_state) or None)
    s.add("resume", str(paths.resume_state) if paths.resume_state else None)

    lg = doc.table("logging")
    lg.add("logging_dir", str(paths.logging_dir) if cfg.logging.tensorboard else None)
    lg.add("log_with", "tensorboard" if cfg.logging.tensorboard else None)
    tracker = paths.tracker_config if cfg.logging.tensorboard else None
    lg.add("log_tracker_config", str(tracker) if tracker else None, "TensorBoard writer settings (tracker.toml)")

    if validation_split(cfg):
        v = doc.table("validation", comment=f"{cfg.dataset.validation_split} of the images held out (dataset.toml)")
        v.add("validate_every_n_steps", cfg.train.validate_every_n_steps, "and at every epoch's end")
        v.add("max_validation_steps", cfg.train.max_validation_steps)
        v.add("validation_seed", validation_seed(cfg), "the validation's noise and timesteps, the same every time")

    if paths.sample_prompts is not None:
        sp = doc.table("sampling")
        sp.add("sample_prompts", str(paths.sample_prompts))
        sp.add("sample_every_n_steps", cfg.sample.every_n_steps)
        sp.add("sample_every_n_epochs", cfg.sample.every_n_epochs)
        sp.add("sample_sampler", cfg.sample.sampler)
    return doc


def validation_split(cfg: DictConfig) -> float:
    return float(cfg.dataset.validation_split)


def validation_seed(cfg: DictConfig) -> int:
    return int(cfg.train.validation_seed if cfg.train.validation_seed is not None else cfg.train.seed)


def dataset_document(cfg: DictConfig, images: Path | Sequence[Path] | None = None) -> Document:
    """The dataset config: one sd-scripts dataset per resolution, each over every folder of the dataset. `images`:
    the folders sd-scripts reads instead of the dataset's own (their staged copies, one per subset in order)."""
    d = cfg.dataset
    subsets = subsets_of(d)
    staged = [images] if isinstance(images, Path) else list(images or [])
    if staged and len(staged) != len(subsets):
        raise ValueError(f"{len(staged)} staged folders for the {len(subsets)} folders of dataset '{d.name}'")
    doc = Document(header=f"sd-scripts dataset config for '{d.name}', written by flux-train (--dataset_config).")
    g = doc.table("general")
    g.add("caption_extension", d.caption_extension)
    g.add("shuffle_caption", False, "captions stay as written; also required for text-encoder output caching")
    g.add("keep_tokens", int(d.keep_tokens))
    for resolution in resolutions_of(d):
        ds = doc.table("datasets", array=True)
        ds.add("resolution", int(resolution))
        ds.add("batch_size", int(cfg.train.batch_size))
        ds.add("enable_bucket", bool(d.enable_bucket), "aspect-ratio buckets instead of square crops")
        ds.add("min_bucket_reso", int(d.min_bucket_reso))
        ds.add("max_bucket_reso", int(d.max_bucket_reso))
        ds.add(
            "bucket_reso_steps",
            64,
            "FLUX packs 2x2 latents of the AE's 8x downscale: multiples of 16 work, 64 buckets well",
        )
        ds.add("bucket_no_upscale", bool(d.bucket_no_upscale))
        if validation_split(cfg):
            ds.add("validation_split", validation_split(cfg), "held out for the validation loss")
            # sd-scripts builds the training and the validation set apart, each shuffling the images before it takes
            # its part: without a seed the two shuffles differ and the parts overlap
            ds.add("validation_seed", validation_seed(cfg), "the same shuffle for both parts: they do not overlap")
        for i, subset in enumerate(subsets):
            ds.children.append(subset_table(d, subset, staged[i] if staged else None))
    return doc


def subset_table(d: DictConfig, subset: Subset, staged: Path | None) -> Table:
    """One folder of the dataset as an sd-scripts DreamBooth subset."""
    sub = Table("datasets.subsets", array=True)
    if staged is None:
        sub.add("image_dir", subset.images)
    else:
        sub.add(
            "image_dir", str(staged), f"{subset.images}, staged in flux-train's cache: sd-scripts' caches land here"
        )
    sub.add("num_repeats", subset.repeats)
    if subset.is_reg:
        sub.add("is_reg", True, "regularisation images: their loss is weighted by prior_loss_weight")
    if subset.trigger:
        sub.add("caption_prefix", f"{subset.trigger},", "the trigger word starts every caption")
        sub.add("class_tokens", "", "images without a caption file get the trigger word alone")
    sub.add("flip_aug", bool(d.flip_aug))
    if subset.masks:
        sub.add("alpha_mask", True, f"masked loss: the staged images carry {subset.masks}'s masks as alpha")
    elif subset.alpha_mask:
        sub.add("alpha_mask", True, "masked loss: the alpha channel says where to learn (transparent: nowhere)")
    if subset.caption_dropout_rate:
        sub.add("caption_dropout_rate", subset.caption_dropout_rate, "steps trained on an empty caption")
    return sub


TENSORBOARD_MAX_QUEUE = 1000  # events the writer thread may have waiting before a log call blocks (torch: 10)
TENSORBOARD_FLUSH_SECS = 10  # how often the writer thread flushes the events file (torch: 120)


def tracker_document() -> Document:
    """accelerate's tracker settings, which sd-scripts reads from `log_tracker_config` (`init_kwargs` for
    `init_trackers`): keyword arguments for TensorBoard's SummaryWriter. sd-scripts logs ~10 scalars a step and
    flux-train's metrics ~15 more; with torch's default queue of 10 events the training loop waited for the writer
    thread at every step (H200 profile: ~1.6 ms a step, the device idle meanwhile). Events reach the file on the
    writer thread, flushed every 10 s so that a running TensorBoard sees them soon."""
    doc = Document(header="accelerate's tracker settings for this run, written by flux-train (sd-scripts reads it)")
    tb = doc.table("tensorboard", comment="keyword arguments of TensorBoard's SummaryWriter")
    tb.add("max_queue", TENSORBOARD_MAX_QUEUE, "events waiting for the writer thread before logging blocks the step")
    tb.add("flush_secs", TENSORBOARD_FLUSH_SECS, "seconds between flushes of the events file")
    return doc


def translate(cfg: DictConfig, paths: RunPaths) -> tuple[Document, Document]:
    """The two documents sd-scripts reads: training arguments and the dataset config."""
    return training_document(cfg, paths), dataset_document(cfg, paths.images)
