"""The plan: a run's config validated once and resolved once, then only read.

compose (Hydra) -> `resolve` -> `Plan` -> translate, launch, metrics. Resolving: every problem of the config at once
(config.validate), the card's architecture against the installed PyTorch, `memory=auto` turned into the card's tier
(config.tiers), the kernels' run-wide switches decided (flux_kernels.runtime.policy, phrased here in our keys), paths
made absolute, the tokenizer folder and the process count chosen. The resolved config is then read-only: a later
layer that tried to change it would fail loudly instead of deciding something again.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from flux_kernels.runtime import policy
from flux_kernels.runtime.request import parse_request
from flux_trainer.backend import SDSCRIPTS, backend_for
from flux_trainer.config import ConfigError
from flux_trainer.config.paths import cache_root
from flux_trainer.config.random_specs import parts_for
from flux_trainer.config.tiers import fit_tier_to_model, resolve_memory
from flux_trainer.config.validate import tier_gib, validate

TOKENIZER_ENV = "FLUX_TRAIN_TOKENIZER_DIR"


@dataclass(frozen=True)
class KernelPlan:
    set: str
    cuda_graphs: bool
    cuda_graphs_asked: bool  # `true` typed (or set by a kernels preset): a failure to install them is an error
    fp8_keep_transposed: bool

    def for_runner(self) -> dict[str, Any]:
        return {
            "set": self.set,
            "cuda_graphs": self.cuda_graphs,
            "cuda_graphs_asked": self.cuda_graphs_asked,
            "fp8_keep_transposed": self.fp8_keep_transposed,
        }


@dataclass(frozen=True)
class Plan:
    cfg: DictConfig  # validated and resolved (tier merged, paths absolute); read-only
    device: Any  # flux_trainer.launch.device.DeviceInfo
    kernels: KernelPlan
    tokenizer_dir: Path
    runs_root: Path
    gpus: int  # processes on this node (0: the CPU)
    backend: str = SDSCRIPTS  # the trainer (flux_trainer.backend): sdscripts | musubi, from model.model_type
    said: list[str] = field(default_factory=list)  # warnings and choices, for the run's header

    @property
    def tier(self) -> str:
        return str(self.cfg.memory.tier)

    @property
    def tier_gib(self) -> float | None:
        return tier_gib(self.tier)

    @property
    def random_preset(self) -> str | None:
        return self.cfg.model.get("random_preset")


def resolve(cfg: DictConfig, info, *, search_dirs: list[Path] | None = None) -> Plan:
    """Validate and resolve `cfg` for the card `info` (in place: the caller's config becomes the plan's, then
    read-only). Raises ConfigError with every problem."""
    from flux_trainer.launch.device import arch_supported

    info, named = planned_device(cfg, info)
    said = [named] if named else []
    said += [f"warning: {w}" for w in validate(cfg, family=info.family, search_dirs=search_dirs)]
    if info.family != "cpu":
        ok, why = arch_supported(info)
        if not ok:
            raise ConfigError(why)
    if chosen := resolve_memory(cfg, info):
        said.append(chosen)
    if fitted := fit_tier_to_model(cfg):
        said.append(fitted)
    kernels = KernelPlan(
        set=str(cfg.kernels.set),
        cuda_graphs=cuda_graphs_decision(cfg, gpu=info.is_gpu),
        cuda_graphs_asked=cuda_graphs_setting(cfg) == "true",
        fp8_keep_transposed=fp8_keep_transposed_decision(cfg),
    )
    absolute_paths(cfg)
    plan = Plan(
        cfg=cfg,
        device=info,
        kernels=kernels,
        tokenizer_dir=tokenizer_dir(cfg),
        runs_root=Path(cfg.logging.root).expanduser().absolute(),
        gpus=processes(cfg, info),
        backend=backend_for(str(cfg.model.get("model_type", "flux"))),
        said=said,
    )
    OmegaConf.set_readonly(cfg, True)
    return plan


def named_card(cfg: DictConfig, detected):
    """The card `hardware=NAME` describes (configs/hardware/NAME.yaml) as if detected, with launcher.gpus of them;
    None with hardware=auto. ConfigError for a file that does not describe a card."""
    from flux_trainer.launch.device import named_device

    hw = cfg.hardware
    name = str(hw.get("name", "auto"))
    if name == "auto":
        return None
    missing = [key for key in ("card", "capability", "vram_gib") if hw.get(key) is None]
    if missing:
        raise ConfigError(f"hardware={name}: its config names no {', '.join(missing)} (see configs/hardware/h100.yaml)")
    capability = list(hw.capability)
    if len(capability) != 2 or not all(isinstance(v, int) and v >= 0 for v in capability):
        raise ConfigError(f"hardware={name}: capability={capability}: give [major, minor], e.g. [8, 9]")
    gpus = str(cfg.launcher.gpus)
    return named_device(
        name, str(hw.card), (capability[0], capability[1]), float(hw.vram_gib), int(gpus) if gpus.isdigit() else 1,
        detected,
    )  # fmt: skip


def planned_device(cfg: DictConfig, detected):
    """The card a run is planned for, and the line saying so (None with hardware=auto): `hardware=NAME` names a card
    (configs/hardware/NAME.yaml). On that card, the detected one (its own torch build, count); elsewhere with
    dry_run=true, the named card as if detected, so the run dir is the one that card would run; a real run on
    another card is refused, naming both."""
    from flux_trainer.launch.device import is_card

    hw = cfg.hardware
    name = str(hw.get("name", "auto"))
    named = named_card(cfg, detected)
    if named is None:
        return detected, None
    if is_card(named, hw.get("match"), detected):
        return detected, f"hardware={name}: this machine's {detected.describe()} is that card"
    if cfg.dry_run:
        here = detected.describe() if detected.is_gpu else "no CUDA GPU"
        return named, f"hardware={name}: planned for {named.describe()} (this machine: {here})"
    here = f"this machine has {detected.describe()}" if detected.is_gpu else "this machine has no CUDA GPU"
    raise ConfigError(
        f"hardware={name} plans for an {named.name}, but {here}: train on that card, drop hardware={name} to "
        f"train on this one, or add dry_run=true to write that card's run dir only"
    )


# ---- the kernels' switches, in our keys ----


def kernel_request(cfg: DictConfig):
    """kernels.set parsed; an invalid one (validate() reports it) as `off`."""
    try:
        return parse_request(str(cfg.kernels.set))
    except ValueError:
        return parse_request("off")


def run_shape(cfg: DictConfig, gpu: bool = True) -> policy.RunShape:
    mem = cfg.memory
    request = kernel_request(cfg)
    return policy.RunShape(
        gpu=gpu,
        compiles_blocks=request.wants("compile_blocks", in_auto=True),
        gradient_checkpointing=bool(mem.gradient_checkpointing),
        weights_move=bool(mem.blocks_to_swap or mem.cpu_offload_checkpointing),
        swap_in_place=bool(mem.blocks_to_swap) and request.wants("block_swap", in_auto=True),
        offloads_checkpoints=bool(mem.cpu_offload_checkpointing),
        samples=renders_samples(cfg),
        gradient_accumulation_steps=int(cfg.train.gradient_accumulation_steps),
        graphs_fit=bool(mem.get("cuda_graphs", False)),
        varying_text=str(cfg.model.get("model_type", "flux")) == "chroma",
    )


def renders_samples(cfg: DictConfig) -> bool:
    """The run renders sample images (prompts given: at their period, and sd-scripts' last one at the end)."""
    return bool((cfg.get("sample") or {}).get("prompts"))


def _switch(cfg: DictConfig, key: str) -> str:
    try:
        return policy.setting(cfg.kernels.get(key, "auto"))
    except ValueError:
        raise ConfigError(f"kernels.{key}={cfg.kernels.get(key)}: choose auto, true or false") from None


def cuda_graphs_setting(cfg: DictConfig) -> str:
    """kernels.cuda_graphs as auto, true or false (Hydra reads `true` as a bool)."""
    return _switch(cfg, "cuda_graphs")


def cuda_graphs_decision(cfg: DictConfig, gpu: bool = True) -> bool:
    """kernels.cuda_graphs decided (flux_kernels.runtime.policy.cuda_graphs); `true` where the graphs cannot run is
    one line per reason, naming the keys that stand in the way."""
    try:
        return policy.cuda_graphs(_switch(cfg, "cuda_graphs"), run_shape(cfg, gpu))
    except policy.GraphsBlocked as blocked:
        request = kernel_request(cfg)
        # the user may not have typed it: the kernels=offload preset sets it
        offload = request.wants("activation_offload", in_auto=False)
        origin = " (kernels=offload sets it; choose another kernels set here)" if offload else ""
        what = f"kernels.set={cfg.kernels.set}" if request.auto or request.named else "kernels=off"
        reasons = {
            policy.NO_GPU: "no CUDA GPU",
            policy.NO_COMPILED_BLOCKS: f"{what} compiles no blocks to replay",
            policy.WEIGHTS_MOVE: "memory.cpu_offload_checkpointing moves what the graphs read between CPU and GPU"
            if cfg.memory.cpu_offload_checkpointing
            else "memory.blocks_to_swap without the block_swap kernel: sd-scripts' own swap moves the weights the "
            "graphs read",
            policy.ACCUMULATION: "train.gradient_accumulation_steps > 1: a replay would overwrite the gradients "
            "being summed",
        }
        raise ConfigError([f"kernels.cuda_graphs=true{origin}: {reasons[b]}" for b in blocked.blockers]) from None


def cuda_graphs_note(cfg: DictConfig, gpu: bool = True) -> str | None:
    """One line for the run's header where `kernels.cuda_graphs=auto` leaves the graphs off only because the run
    renders samples on a tier that swaps blocks (a slower step the user may not expect), else None."""
    if not gpu or _switch(cfg, "cuda_graphs") != "auto":
        return None
    shape = run_shape(cfg, gpu)
    if not shape.samples or policy.cuda_graphs("auto", shape):
        return None
    if not policy.cuda_graphs("auto", dataclasses.replace(shape, samples=False)):
        return None
    return (
        f"CUDA graphs off (a slower step): sample.prompts on memory={cfg.memory.tier}, which swaps blocks, and the "
        "graphs' memory left the samples' decode too little on a 16 GB card; kernels.cuda_graphs=true keeps them"
    )


def fp8_keep_transposed_decision(cfg: DictConfig) -> bool:
    """kernels.fp8_keep_transposed decided (flux_kernels.runtime.policy.fp8_keep_transposed)."""
    return policy.fp8_keep_transposed(_switch(cfg, "fp8_keep_transposed"), run_shape(cfg))


# ---- paths and processes ----


def tokenizer_dir(cfg: DictConfig) -> Path:
    """sd-scripts' tokenizer_cache_dir: the config key, $FLUX_TRAIN_TOKENIZER_DIR, the packaged stand-ins for
    random presets (no download), else <cache>/tokenizers (sd-scripts fetches the real ones there once)."""
    if cfg.tokenizer_dir:
        return Path(cfg.tokenizer_dir).expanduser().absolute()
    if os.environ.get(TOKENIZER_ENV):
        return Path(os.environ[TOKENIZER_ENV]).expanduser().absolute()
    if cfg.model.get("random_preset"):
        return Path(__file__).parent / "standin_tokenizers"
    return cache_root() / "tokenizers"


def absolute_paths(cfg: DictConfig) -> None:
    """sd-scripts runs in a child process: give it absolute paths, whatever the cwd."""
    for part in parts_for(cfg.model.get("model_type", "flux")):
        cfg.model[part] = str(Path(str(cfg.model[part])).expanduser().absolute())
    if cfg.dataset.images is not None:
        cfg.dataset.images = str(Path(cfg.dataset.images).expanduser().absolute())
    if cfg.dataset.get("control_images"):
        cfg.dataset.control_images = str(Path(cfg.dataset.control_images).expanduser().absolute())
    for subset in cfg.dataset.subsets:
        subset.images = str(Path(subset.images).expanduser().absolute())
    cfg.sample.references = [str(Path(str(r)).expanduser().absolute()) for r in cfg.sample.get("references") or []]


def processes(cfg: DictConfig, info) -> int:
    if info.family == "cpu":
        return 0
    return info.count if cfg.launcher.gpus == "all" else int(cfg.launcher.gpus)
