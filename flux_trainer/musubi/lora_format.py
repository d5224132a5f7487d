"""A copy of a FLUX.2 / Kontext LoRA in the keys ComfyUI (and diffusers, for FLUX.2) load, beside musubi-tuner's file.

musubi-tuner saves kohya's format: `lora_unet_<module, dots as underscores>.lora_down.weight`, `.lora_up.weight`
and `.alpha`. Its converter (`convert_lora.py --target other`) is meant to write the `diffusion_model.<module>.lora_A
/ .lora_B` format that ComfyUI and diffusers load, but for FLUX's block names it writes `img_attn_qkv` for
`img_attn.qkv` (its HunyuanVideo fix-ups), so ComfyUI skips every attention key ("lora key not loaded",
musubi-tuner#905). We therefore map the names ourselves, from the format's spec (docs/models.md, "The LoRA file"):
the module is looked up in the closed set of names a FLUX block has, never guessed by swapping underscores, and a
name outside it stops the copy (one line), so no trained key is ever dropped. alpha/rank is folded into the two
matrices (each times its square root, as musubi-tuner's converter does), because diffusers' FLUX.2 loader takes no
`.alpha` keys in this format. The metadata is kept; its two weight hashes are recomputed with musubi-tuner's own
function when the checkout is given (else left out, never stale).
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

COMFY_SUFFIX = ".comfy.safetensors"
KOHYA_PREFIX = "lora_unet_"
TARGET_PREFIX = "diffusion_model."
FORMAT_KEY = "flux_train_lora_format"  # metadata: what this copy is, and of which file
HASH_KEYS = ("sshs_model_hash", "sshs_legacy_hash")
# the Linear layers of FLUX's blocks (BFL layout; FLUX.1 Kontext and FLUX.2 alike, FLUX.2 lacks the *_mod / modulation
# ones), as kohya writes them -> as the model's state dict names them
DOUBLE_BLOCK = {
    f"{side}_{part}": f"{side}_{module}"
    for side in ("img", "txt")
    for part, module in (
        ("attn_qkv", "attn.qkv"),
        ("attn_proj", "attn.proj"),
        ("mlp_0", "mlp.0"),
        ("mlp_2", "mlp.2"),
        ("mod_lin", "mod.lin"),
    )
}
SINGLE_BLOCK = {"linear1": "linear1", "linear2": "linear2", "modulation_lin": "modulation.lin"}
BLOCKS = {"double_blocks": DOUBLE_BLOCK, "single_blocks": SINGLE_BLOCK}
KOHYA_NAME = re.compile(r"^lora_unet_(double_blocks|single_blocks)_(\d+)_(\w+)$")
KOHYA_PARTS = ("lora_down.weight", "lora_up.weight", "alpha")


class LoraFormatError(ValueError):
    """The trained file holds a key the format has no place for: no copy is written (nothing is dropped)."""


@dataclass(frozen=True)
class Converted:
    """The copy's tensors, and how many trained modules they hold (two keys each: nothing dropped)."""

    tensors: dict[str, Any]
    modules: int  # trained modules, each now two keys


def module_of(kohya_name: str) -> str:
    """`lora_unet_double_blocks_0_img_attn_qkv` -> `double_blocks.0.img_attn.qkv` (the DiT's own module name)."""
    m = KOHYA_NAME.match(kohya_name)
    inner = BLOCKS[m.group(1)].get(m.group(3)) if m else None
    if inner is None:
        raise LoraFormatError(
            f"LoRA module {kohya_name}: not a layer of a FLUX double or single block, so flux-train cannot name it "
            f"for ComfyUI; the trained file is fine (set train.comfy_copy=false to skip the copy)"
        )
    return f"{m.group(1)}.{m.group(2)}.{inner}"


def to_comfy(state: Mapping[str, Any]) -> Converted:
    """musubi-tuner's LoRA state dict -> `diffusion_model.<module>.lora_A.weight` / `.lora_B.weight`, alpha folded.

    Every key of `state` is accounted for: a key that is not a LoRA part of a block layer raises LoraFormatError."""
    import torch

    modules: dict[str, dict[str, Any]] = {}
    for key, tensor in state.items():
        name, _, part = key.partition(".")
        if part not in KOHYA_PARTS:
            raise LoraFormatError(
                f"LoRA key {key}: not a LoRA down/up/alpha tensor (only plain LoRA files are converted); the "
                "trained file is fine (set train.comfy_copy=false to skip the copy)"
            )
        modules.setdefault(name, {})[part] = tensor
    out: dict[str, Any] = {}
    for name, parts in modules.items():
        target = TARGET_PREFIX + module_of(name)
        if "lora_down.weight" not in parts or "lora_up.weight" not in parts:
            raise LoraFormatError(f"LoRA module {name}: has {sorted(parts)}, not both lora_down and lora_up")
        down, up = parts["lora_down.weight"], parts["lora_up.weight"]
        rank = down.shape[0]
        alpha = float(parts["alpha"]) if "alpha" in parts else float(rank)  # kohya: no alpha means alpha = rank
        root = math.sqrt(alpha / rank)
        out[f"{target}.lora_A.weight"] = (down.to(torch.float32) * root).to(down.dtype).contiguous()
        out[f"{target}.lora_B.weight"] = (up.to(torch.float32) * root).to(up.dtype).contiguous()
    return Converted(out, len(modules))


def comfy_path(lora: Path) -> Path:
    """`name.safetensors` -> `name.comfy.safetensors`, beside it."""
    return lora.with_name(lora.name.removesuffix(".safetensors") + COMFY_SUFFIX)


def musubi_hashes(checkout: str | Path) -> Callable[[dict, dict], tuple[str, str]] | None:
    """musubi-tuner's own weight-hash function (the two `sshs_*` metadata values), imported from the checkout."""
    if not checkout:
        return None
    from flux_trainer.musubi.checkout import import_module

    return import_module(str(checkout), "utils.model_utils").precalculate_safetensors_hashes


def write_comfy_copy(
    lora: Path, *, hashes: Callable[[dict, dict], tuple[str, str]] | None = None
) -> tuple[Path, Converted]:
    """Read `lora`, write its ComfyUI copy beside it (whole or not at all), return the copy's path."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(lora), framework="pt") as f:
        state = {k: f.get_tensor(k) for k in f.keys()}
        metadata = dict(f.metadata() or {})
    converted = to_comfy(state)
    for key in HASH_KEYS:
        metadata.pop(key, None)
    if hashes is not None:
        metadata[HASH_KEYS[0]], metadata[HASH_KEYS[1]] = hashes(converted.tensors, metadata)
    metadata[FORMAT_KEY] = f"comfyui diffusion_model lora_A/lora_B, alpha folded in; from {lora.name}"
    target = comfy_path(lora)
    partial = target.with_name(target.name + ".partial")
    try:
        save_file(converted.tensors, str(partial), metadata=metadata)
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)
    return target, converted


def summary_lines(lora: Path, model_type: str) -> list[str]:
    """The run's closing lines for a FLUX.2 / Kontext LoRA: which file loads where (docs/models.md, "The LoRA file")."""
    flux2 = model_type == "flux2"
    lines = [
        f"LoRA: {lora} (kohya keys, as musubi-tuner saves them: musubi-tuner, ComfyUI, diffusers"
        + (" from 0.38)" if flux2 else ")")
    ]
    copy = comfy_path(lora)
    if copy.is_file():
        lines.append(
            f"LoRA for ComfyUI: {copy} (diffusion_model lora_A/B keys, alpha folded in: ComfyUI"
            + (", diffusers from 0.36)" if flux2 else ")")
        )
    return lines
