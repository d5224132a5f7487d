"""Shapes of the random model presets trained through musubi-tuner, and where each is generated. Pure data (stdlib
only), so the config layer can name the files without importing torch; `flux_trainer.musubi.random_model` writes
them and teaches musubi-tuner's loaders the tiny shapes.

FLUX.2 [klein] sets are our own (DiT, AE, Qwen3 text encoder, musubi-tuner's file layouts). FLUX.1 Kontext has
FLUX.1-dev's architecture and file formats, so its presets ARE sd-scripts' random sets (`full`, `tiny` in
`flux_trainer.config.random_specs`): one set of files on disk serves both trainers.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

FLUX2_PARTS = ("dit", "vae", "text_encoder")
# the deepest Qwen3 layer FLUX.2 reads (musubi-tuner's OUTPUT_LAYERS_QWEN3 = [9, 18, 27]): a text encoder needs more
QWEN3_MIN_LAYERS = 28
STANDIN_QWEN3 = "Qwen_Qwen3-4B"  # folder under flux_trainer/standin_tokenizers; serves Qwen3-4B and -8B alike

# full: klein base 4B exactly (musubi-tuner's Klein4BParams, its AutoEncoderParams, its Qwen3-4B config), and klein
# base 9B exactly (Klein9BParams, the same AE, its Qwen3-8B config, whose embedding is not tied: the loader still
# fills lm_head from it, so the file has no lm_head either); a test checks each against the checkout. tiny: 1 double
# + 1 single block of width 256, a 32-wide AE and a 64-wide, 28-layer Qwen3 with a 512-token vocabulary (the stand-in
# tokenizer has 505), for CPU runs in seconds.
FLUX2_PRESETS: dict[str, dict] = {
    "random_flux2_klein_4b": {
        "model_version": "klein-base-4b",
        "dit": {
            "in_channels": 128,
            "context_in_dim": 7680,
            "hidden_size": 3072,
            "num_heads": 24,
            "depth": 5,
            "depth_single_blocks": 20,
            "axes_dim": [32, 32, 32, 32],
            "mlp_ratio": 3.0,
            "use_guidance_embed": False,
        },
        "vae": {"ch": 128, "ch_mult": [1, 2, 4, 4], "num_res_blocks": 2, "z_channels": 32},
        "text_encoder": {
            "hidden_size": 2560,
            "intermediate_size": 9728,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "num_hidden_layers": 36,
            "vocab_size": 151936,
        },
        "tokenizer": STANDIN_QWEN3,
    },
    "random_flux2_klein_9b": {
        "model_version": "klein-base-9b",
        "dit": {
            "in_channels": 128,
            "context_in_dim": 12288,
            "hidden_size": 4096,
            "num_heads": 32,
            "depth": 8,
            "depth_single_blocks": 24,
            "axes_dim": [32, 32, 32, 32],
            "mlp_ratio": 3.0,
            "use_guidance_embed": False,
        },
        "vae": {"ch": 128, "ch_mult": [1, 2, 4, 4], "num_res_blocks": 2, "z_channels": 32},
        "text_encoder": {
            "hidden_size": 4096,
            "intermediate_size": 12288,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "num_hidden_layers": 36,
            "vocab_size": 151936,
            "tie_word_embeddings": False,
        },
        "tokenizer": STANDIN_QWEN3,
    },
    "random_flux2_klein_tiny": {
        "model_version": "klein-base-4b",
        "dit": {
            "in_channels": 128,  # 4 x the AE's 32 latent channels: fixed by musubi-tuner's latent packing
            "context_in_dim": 192,  # 3 Qwen3 layers stacked: 3 x 64
            "hidden_size": 256,
            "num_heads": 2,
            "depth": 1,
            "depth_single_blocks": 1,
            "axes_dim": [32, 32, 32, 32],  # sums to hidden_size / num_heads
            "mlp_ratio": 3.0,
            "use_guidance_embed": False,
        },
        "vae": {"ch": 32, "ch_mult": [1, 2, 4, 4], "num_res_blocks": 1, "z_channels": 32},
        "text_encoder": {
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 32,
            "num_hidden_layers": QWEN3_MIN_LAYERS,
            "vocab_size": 512,
        },
        "tokenizer": STANDIN_QWEN3,
    },
}
# Kontext presets: the sd-scripts random set of the same architecture
KONTEXT_PRESETS: dict[str, str] = {"random_kontext": "full", "random_kontext_tiny": "tiny"}
FULL_SIZE = {"flux2": "random_flux2_klein_4b", "kontext": "random_kontext"}
# the full-size FLUX.2 preset of each size musubi-tuner hard-codes (by --model_version's size): its shapes need no patch
FULL_FLUX2_BY_SIZE = {"4b": "random_flux2_klein_4b", "9b": "random_flux2_klein_9b"}


def preset_family(preset: str) -> str:
    """'flux2' or 'kontext': which musubi-tuner scripts and loaders read the preset's files."""
    if preset in FLUX2_PRESETS:
        return "flux2"
    if preset in KONTEXT_PRESETS:
        return "kontext"
    names = ", ".join([*FLUX2_PRESETS, *KONTEXT_PRESETS])
    raise KeyError(f"unknown musubi-tuner random model preset {preset!r}; choose from {names}")


def flux2_preset_key(preset: str) -> str:
    """`random-<preset>-<hash of its shapes>`: a change of shape gets a new folder, never stale weights."""
    preset_family(preset)
    digest = hashlib.sha256(json.dumps(FLUX2_PRESETS[preset], sort_keys=True).encode()).hexdigest()[:10]
    return f"random-{preset}-{digest}"


def flux2_preset_file(cache: Path, preset: str, part: str) -> Path:
    if part not in FLUX2_PARTS:
        raise KeyError(f"unknown FLUX.2 model part {part!r}; choose from {', '.join(FLUX2_PARTS)}")
    return Path(cache) / flux2_preset_key(preset) / f"{part}.safetensors"


def flux2_needs_patch(spec: dict) -> bool:
    """True when a FLUX.2 set's shapes (spec.json, or a preset's entry) differ from those musubi-tuner's loaders
    hard-code for its --model_version (klein 4B's or 9B's): then `random_model.install_random_model` must teach them
    the set's shapes."""
    size = str(spec.get("model_version", "")).rsplit("-", 1)[-1]
    full = FLUX2_PRESETS[FULL_FLUX2_BY_SIZE.get(size, FULL_SIZE["flux2"])]
    return any(spec[part] != full[part] for part in FLUX2_PARTS)
