"""Which of our config keys each backend honours, so a key the chosen trainer would ignore is refused, not lost.

Both trainers read the same RunConfig, but not every key means something to both: sd-scripts has no reference images
or FLUX.2 timestep shift; flux-train's musubi-tuner backend does not (yet) translate sd-scripts' loss variants,
validation split, LyCORIS or flux_kernels' FLUX.1 block kernels (the attention backend choice, regional compile and
the optimizer's steps it does: musubi/kernel_install.py). A key set to anything but its default on a backend that
does not honour it is one line naming the key, its value, the model, and what to do. Presets set several of these
keys (the memory tiers set checkpoint_skip, cuda_graphs, t5xxl_fp8): those are read by both backends (or are
harmless when not), so they are not listed here.
"""

from __future__ import annotations

from typing import Any

from flux_trainer.backend import MUSUBI, SDSCRIPTS, TRAINER_NAMES

# key -> (its default, the backends that honour another value)
ONLY: dict[str, tuple[Any, tuple[str, ...]]] = {
    # FLUX.2 / Kontext only
    "model.text_encoder": (None, (MUSUBI,)),
    "model.model_version": (None, (MUSUBI,)),
    "dataset.control_images": (None, (MUSUBI,)),
    "train.comfy_copy": (True, (MUSUBI,)),  # sd-scripts' FLUX.1 file is the one ComfyUI loads: no copy to turn off
    # sd-scripts only (flux_trainer/sdscripts/translate.py maps them; the musubi backend does not)
    "network.train_blocks": ("all", (SDSCRIPTS,)),
    "network.split_qkv": (False, (SDSCRIPTS,)),
    "network.train_t5xxl": (False, (SDSCRIPTS,)),
    "network.loraplus_lr_ratio": (None, (SDSCRIPTS,)),
    "network.algo": (None, (SDSCRIPTS,)),
    "train.model_prediction_type": ("raw", (SDSCRIPTS,)),
    "train.guidance_scale": (1.0, (SDSCRIPTS,)),
    "train.loss_type": ("l2", (SDSCRIPTS,)),
    "train.prior_loss_weight": (1.0, (SDSCRIPTS,)),
    "train.validate_every_n_steps": (None, (SDSCRIPTS,)),
    "dataset.validation_split": (0.0, (SDSCRIPTS,)),
    "dataset.alpha_mask": (False, (SDSCRIPTS,)),
    "dataset.masks": (None, (SDSCRIPTS,)),
    "dataset.caption_dropout_rate": (0.0, (SDSCRIPTS,)),
    "dataset.flip_aug": (False, (SDSCRIPTS,)),
    "dataset.keep_tokens": (0, (SDSCRIPTS,)),
    "logging.profile_at": (None, (SDSCRIPTS,)),
    "logging.memory_snapshot_at": (None, (SDSCRIPTS,)),
    "cache.latents": (True, (SDSCRIPTS,)),  # musubi-tuner trains from its caches only: false is sd-scripts'
    "cache.text_encoder_outputs": (True, (SDSCRIPTS,)),
}
# values of a key that one backend alone knows
ONLY_VALUES: dict[tuple[str, Any], tuple[str, ...]] = {
    ("train.timestep_sampling", "flux2_shift"): (MUSUBI,),
}
# flux_kernels' kernels that musubi-tuner's training takes (flux_trainer/musubi/kernel_install.py installs them, in this
# order): the optimizer's steps (musubi-tuner builds prodigyopt's Prodigy and torch's AdamW too), the attention backend
# choice (in the blocks' plain self-attention, flux_trainer/musubi/attention.py) and regional compile
MUSUBI_KERNELS = ("prodigy_step", "adamw_step", "attention", "compile_blocks")


def musubi_kernels(kernel_set: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(what to try, what was named) of a `kernels.set` on musubi-tuner's models. ValueError (one line) for an
    unknown name or a kernel that patches sd-scripts' FLUX.1 model."""
    from flux_kernels.runtime.request import KERNEL_NAMES, parse_request

    request = parse_request(kernel_set, KERNEL_NAMES)
    other = [n for n in request.named if n not in MUSUBI_KERNELS]
    if other:
        raise ValueError(
            f"{', '.join(other)} patch sd-scripts' FLUX.1 model and do not apply to musubi-tuner's FLUX.2 / Kontext; "
            "use kernels=auto, kernels=off or kernels=compile"
        )
    return tuple(n for n in MUSUBI_KERNELS if request.wants(n, True)), request.named


def musubi_kernel_problem(kernel_set: str) -> str | None:
    """The config check's line for a `kernels.set` musubi-tuner's models cannot take, or None."""
    try:
        musubi_kernels(kernel_set)
    except ValueError as exc:
        return f"kernels.set={kernel_set}: {exc}"
    return None


def _get(cfg: Any, dotted: str) -> Any:
    node = cfg
    for part in dotted.split("."):
        if node is None or part not in node:
            return None
        node = node[part]
    return node


def _plain(value: Any) -> Any:
    try:
        from omegaconf import OmegaConf

        return OmegaConf.to_container(value) if OmegaConf.is_config(value) else value
    except ImportError:  # pragma: no cover - omegaconf is a dependency
        return value


def refusals(cfg: Any, backend: str, model: str) -> list[str]:
    """One line per key `cfg` sets that `backend` would not honour (empty: every setting means something there)."""
    trainer = TRAINER_NAMES[backend]
    other = {SDSCRIPTS: "a FLUX.1 or Chroma model", MUSUBI: "a FLUX.2 or Kontext model"}
    problems = []
    for key, (default, honoured) in ONLY.items():
        if backend in honoured or key.startswith("dataset.") and "dataset" not in cfg:
            continue
        value = _plain(_get(cfg, key))
        if value is None or value == default:
            continue
        whom = other[honoured[0]]
        problems.append(
            f"{key}={value}: model={model} trains on {trainer}, where flux-train does not use it (only {whom} "
            f"does); remove it or choose such a model"
        )
    for (key, value), honoured in ONLY_VALUES.items():
        if backend not in honoured and _get(cfg, key) == value:
            problems.append(
                f"{key}={value}: model={model} trains on {trainer}, which has no {value}; choose another "
                f"{key.split('.')[-1]} (flux_shift for FLUX.1)"
            )
    if backend == MUSUBI:
        for i, subset in enumerate(_get(cfg, "dataset.subsets") or []):
            for key, default in (("alpha_mask", None), ("masks", None)):
                if subset.get(key) not in (default, False):
                    problems.append(
                        f"dataset.subsets[{i}].{key}={subset.get(key)}: model={model} trains on {trainer}, which "
                        "has no masked loss; remove it or choose a FLUX.1 or Chroma model"
                    )
        problem = musubi_kernel_problem(str(_get(cfg, "kernels.set") or "auto"))
        if problem:
            problems.append(problem)
        module = str(_get(cfg, "network.module") or "")
        if module and module != "networks.lora_flux":
            problems.append(
                f"network.module={module}: model={model} trains musubi-tuner's own LoRA module for it; use network=lora"
            )
    return problems
