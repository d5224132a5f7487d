"""The typed schema of one flux-train run.

Dataclasses registered in Hydra's ConfigStore sit under the YAML in `configs/`, so a typo in any key fails
at composition and names the key ("Key 'rnk' not in 'NetworkConfig'"). Field names are ours, not
sd-scripts': `flux_trainer.sdscripts.translate` is the only place that maps them to sd-scripts flags.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING


@dataclass
class HubFile:
    """Where `flux-train setup --models` gets a model file: a hub repository and a file in it."""

    repo_id: str = ""
    filename: str = ""


@dataclass
class ModelConfig:
    # flux_dev | flux_schnell | chroma | random | random_tiny | random_chroma | random_chroma_tiny (random presets
    # are generated weights, never a real model)
    name: str = MISSING
    # the architecture, which also picks the trainer (flux_trainer.backend.BACKENDS): flux (FLUX.1) | chroma (T5 only:
    # clip_l is null) train on sd-scripts; flux2 (FLUX.2 klein / dev: one text encoder) | kontext (FLUX.1 Kontext,
    # reference images in dataset.control_images) train on musubi-tuner
    model_type: str = "flux"
    flux: str = MISSING  # the transformer .safetensors (FLUX.1, Chroma, FLUX.2 or Kontext; BFL layout)
    ae: str = MISSING  # autoencoder .safetensors
    clip_l: str | None = MISSING  # CLIP-L text encoder .safetensors; null for Chroma and FLUX.2
    t5xxl: str | None = MISSING  # T5-XXL encoder .safetensors; null for FLUX.2
    # FLUX.2 only: its text encoder (Qwen3 4B / 8B for klein, Mistral 3 for dev), the first file of a split set
    text_encoder: str | None = None
    # FLUX.2 only: which one (musubi-tuner's --model_version): dev | klein-4b | klein-base-4b | klein-9b | klein-base-9b
    model_version: str | None = None
    # random presets: the generated set's shape, written once into the model cache (random_tiny / random)
    random_preset: str | None = None
    # tokens of T5 context; None = sd-scripts' default (512 dev, 256 schnell)
    t5xxl_max_token_length: int | None = None
    hub: dict[str, HubFile] = field(default_factory=dict)


@dataclass
class SubsetConfig:
    """One folder of a dataset that lists several (`subsets:`); a key left null takes the dataset's value (a
    regularisation folder's trigger excepted: reg images are the class, not the character)."""

    images: str = MISSING  # a folder of images; captions beside them
    trigger: str | None = None
    repeats: int | None = None
    caption_dropout_rate: float | None = None
    is_reg: bool = False  # regularisation images, their loss weighted by train.prior_loss_weight
    alpha_mask: bool | None = None
    masks: str | None = None  # a folder of loss masks named as the images (white: learned, black: not)


@dataclass
class DatasetConfig:
    name: str = MISSING
    # a folder of images; captions beside them as NAME.txt. Or leave it out and list folders in `subsets`
    images: str | None = None
    trigger: str | None = None  # put in front of every caption; the caption of images without a .txt
    # a number, or a list of them: one sd-scripts dataset per resolution over the same folders
    resolution: Any = 1024
    subsets: list[SubsetConfig] = field(default_factory=list)  # several folders instead of `images`
    # FLUX.1 Kontext: a folder of reference images, one per image, matched by name (photo1.png for photo1.jpg)
    control_images: str | None = None
    # masked loss from each image's alpha channel (opaque: learned, transparent: not); every image needs one
    alpha_mask: bool = False
    # masked loss from a folder of mask images named as the images (white: learned, black: not; data/masks.py)
    masks: str | None = None
    repeats: int = 10
    caption_extension: str = ".txt"
    enable_bucket: bool = True  # aspect-ratio buckets, so images are not cropped square
    min_bucket_reso: int = 256
    max_bucket_reso: int = 2048
    bucket_no_upscale: bool = True
    flip_aug: bool = False  # mirror images at random: off, it breaks asymmetric characters and text
    keep_tokens: int = 0
    # fraction of the images held out for the validation loss (0: none; at most 0.5): sd-scripts splits them off
    # after a shuffle seeded by train.validation_seed, and logs loss/validation/* (train.validate_every_n_steps)
    validation_split: float = 0.0
    # train this fraction of steps on an empty caption (sd-scripts' subset option); needs
    # cache.text_encoder_outputs=false, as sd-scripts cannot drop a cached caption
    caption_dropout_rate: float = 0.0


@dataclass
class NetworkConfig:
    module: str = "networks.lora_flux"
    rank: int = 16
    alpha: float = 16.0
    dropout: float | None = None
    train_blocks: str = "all"  # all | single | double
    split_qkv: bool = False
    train_t5xxl: bool = False
    loraplus_lr_ratio: float | None = None
    weights: str | None = None  # start from an existing LoRA file
    algo: str | None = None  # LyCORIS algorithm (network=lokr | network=loha, module lycoris.kohya); None: lora_flux
    factor: int = -1  # LoKr only: Kronecker factor of each weight's shape; -1: LyCORIS' most balanced split


@dataclass
class OptimizerConfig:
    name: str = MISSING  # prodigy | adamw | adamw8bit | adafactor
    type: str = MISSING  # the optimizer class sd-scripts instantiates
    lr: float = MISSING
    args: dict[str, Any] = field(default_factory=dict)  # keyword arguments of the optimizer class
    scheduler: str = "constant"
    warmup_steps: int = 0
    max_grad_norm: float = 1.0


@dataclass
class PrecisionConfig:
    name: str = "bf16"
    mixed: str = "bf16"  # no | fp16 | bf16
    save: str = "bf16"  # float | fp16 | bf16
    fp8_base: bool = False  # frozen FLUX weights stored as fp8 (sm_89 and newer)


@dataclass
class MemoryConfig:
    tier: str = "auto"  # auto | vram8 | vram12 | vram16 | vram24 | vram32 | vram48 | vram80
    gradient_checkpointing: bool = True
    cpu_offload_checkpointing: bool = False
    blocks_to_swap: int = 0
    fp8_base: bool | None = None  # None: the precision preset decides
    # with gradient checkpointing: blocks that keep their activations instead (auto: as many as the card's memory
    # holds, measured at the first step; 0: every block checkpointed, as sd-scripts does; N: that many)
    checkpoint_skip: str = "auto"
    # the tier has room for CUDA graphs' pool beside checkpointing: kernels.cuda_graphs=auto replays the blocks there
    cuda_graphs: bool | None = None  # None (memory=auto before the tier is chosen): the tier decides
    # T5-XXL cast to fp8 before it encodes the captions (9.5 GB in bf16 does not fit an 8 GB card; sd-scripts runs an
    # fp8 T5 as its own fp8 T5 file), once, when the text-encoder outputs are cached
    t5xxl_fp8: bool | None = None


@dataclass
class HardwareConfig:
    # `hardware=NAME` (configs/hardware/NAME.yaml): plan for that card instead of the one detected; a real run on
    # another card is refused, `dry_run=true` writes the run dir that card would run. auto: the detected card.
    name: str = "auto"
    family: str = "auto"  # auto | blackwell_consumer | blackwell | hopper | ada | ampere | cpu
    card: str | None = None  # the name the card reports (torch.cuda.get_device_name)
    match: str | None = None  # a regex: a detected card whose name matches it is this card
    capability: list[int] | None = None  # CUDA compute capability, [major, minor]
    vram_gib: float | None = None  # the card's memory as PyTorch reports it (total_memory / 2**30)


@dataclass
class KernelsConfig:
    set: str = "auto"  # auto | off | a comma list of flux_kernels names (attention,qk_norm_rope,...) | auto,name,-name
    attention: str = "sdpa"  # sdpa | xformers
    cuda_graphs: str = "auto"  # auto | true | false: the compiled blocks replay from CUDA graphs (see validate)
    fp8_keep_transposed: str = "auto"  # auto | true | false: fp8_matmul keeps its weights' transposes (see validate)
    # removed, measured to buy nothing: accepted for one release with a warning (config.validate.REMOVED_KEYS)
    combo_kernels: bool | None = None
    offload_views: bool | None = None


@dataclass
class LoggingConfig:
    root: str = "runs"  # every run dir lives under here; `tensorboard --logdir <root>` compares them
    tensorboard: bool = True
    profile_at: int | None = None  # profile from this optimizer step: <run>/profile/ (trace, time by kernel kind)
    profile_steps: int = 3  # how many steps the profile covers
    profile_python: bool = False  # the trace also records the Python calls (where the host's time goes; larger)
    # record every CUDA allocation of this optimizer step: <run>/memory/ (a snapshot for pytorch.org/memory_viz, and
    # what was live at the step's peak by where it was allocated)
    memory_snapshot_at: int | None = None


@dataclass
class SampleConfig:
    prompts: list[str] = field(default_factory=list)
    every_n_steps: int | None = None
    every_n_epochs: int | None = None
    sampler: str = "euler"
    steps: int = 20
    width: int = 1024
    height: int = 1024
    guidance: float = 3.5
    seed: int = 42
    # Kontext: the reference image each sample edits, one for every prompt or one per prompt (in their order)
    references: list[str] = field(default_factory=list)


@dataclass
class TrainConfig:
    output_name: str = MISSING
    # FLUX.2 / Kontext only (musubi-tuner): also write NAME.comfy.safetensors, the LoRA in the diffusion_model lora_A/B
    # keys ComfyUI (and diffusers for FLUX.2) load, beside musubi-tuner's own file (docs/models.md, "The LoRA file")
    comfy_copy: bool = True
    max_steps: int | None = 1500
    max_epochs: int | None = None
    batch_size: int = 1
    gradient_accumulation_steps: int = 1
    save_every_n_steps: int | None = 250
    save_every_n_epochs: int | None = None
    save_last_n: int | None = 4  # keep this many LoRA snapshots and states
    save_state: bool = True  # optimizer state too, so `resume=auto` loses nothing
    seed: int = 42
    timestep_sampling: str = "flux_shift"
    model_prediction_type: str = "raw"
    guidance_scale: float = 1.0
    discrete_flow_shift: float = 3.1582
    loss_type: str = "l2"  # l2 | l1 | huber | smooth_l1
    prior_loss_weight: float = 1.0  # the loss of regularisation images (a dataset subset with is_reg) times this
    # huber and smooth_l1 only: the threshold, and how it changes with the timestep (constant | exponential; sd-scripts'
    # snr schedule needs a scheduler with alphas_cumprod, which FLUX's flow matching has not)
    huber_c: float = 0.1
    huber_schedule: str = "constant"
    # with dataset.validation_split: the validation loss every N optimizer steps too (null: at each epoch's end only)
    validate_every_n_steps: int | None = None
    max_validation_steps: int | None = None  # validation batches per validation (null: every held-out image)
    validation_seed: int | None = None  # the split's shuffle and the validation noise; null: train.seed
    data_loader_workers: int = 2
    pin_memory: bool = True  # batches in page-locked host memory, copied to the GPU without a sync (CUDA only)
    staged_copy: bool = True  # the base model to the GPU through page-locked buffers on several threads (CUDA only)
    sync_free: bool = True  # the loop reads the loss and logs sd-scripts' norm means without waiting for the step


@dataclass
class CacheConfig:
    latents: bool = True
    latents_to_disk: bool = True
    text_encoder_outputs: bool = True
    text_encoder_outputs_to_disk: bool = True
    vae_batch_size: int = 1


@dataclass
class LauncherConfig:
    name: str = "local"
    gpus: Any = 1  # a number, or "all"
    nodes: int = 1
    node_rank: int = 0
    main_address: str = "127.0.0.1"
    main_port: int = 29500
    cpu_threads_per_process: int = 2
    direct: bool = True  # one process: started with accelerate's environment, without its launcher process


@dataclass
class RunConfig:
    model: ModelConfig = MISSING
    dataset: DatasetConfig = MISSING  # not in the defaults list: `+dataset=NAME`
    network: NetworkConfig = field(default_factory=NetworkConfig)
    optimizer: OptimizerConfig = MISSING
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    kernels: KernelsConfig = field(default_factory=KernelsConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    sample: SampleConfig = field(default_factory=SampleConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    launcher: LauncherConfig = field(default_factory=LauncherConfig)
    sd_scripts: str | None = None  # checkout; else FLUX_TRAIN_SD_SCRIPTS; else the cache folder
    musubi_tuner: str | None = None  # checkout (FLUX.2, Kontext); else FLUX_TRAIN_MUSUBI_TUNER; else the cache folder
    tokenizer_dir: str | None = None  # sd-scripts' tokenizer_cache_dir; else FLUX_TRAIN_TOKENIZER_DIR
    model_cache: str | None = None  # where random presets are generated; else FLUX_TRAIN_MODEL_CACHE
    resume: str = "off"  # off | auto | a state folder
    dry_run: bool = False


def register_configs() -> None:
    """Put the schema where `configs/config.yaml`'s defaults list finds it (`config_schema`)."""
    ConfigStore.instance().store(name="config_schema", node=RunConfig)
