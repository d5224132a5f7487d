"""Shapes of the random model presets, and where each is generated. Pure data (stdlib only), so the config
layer can name the files without importing torch; `flux_trainer.sdscripts.random_model` writes them."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

PARTS = ("flux", "ae", "clip_l", "t5xxl")  # FLUX.1's files
# the files each model_type reads: Chroma has no CLIP-L (sd-scripts feeds it a dummy); FLUX.2 one text encoder (Qwen3
# for klein, Mistral 3 for dev; `text_encoder`); FLUX.1 Kontext FLUX.1's four
PARTS_BY_TYPE: dict[str, tuple[str, ...]] = {
    "flux": PARTS,
    "chroma": ("flux", "ae", "t5xxl"),
    "flux2": ("flux", "ae", "text_encoder"),
    "kontext": PARTS,
}
MODEL_TYPES = tuple(PARTS_BY_TYPE)


def parts_for(model_type: str) -> tuple[str, ...]:
    """The model files a model type reads."""
    if model_type not in PARTS_BY_TYPE:
        raise KeyError(f"unknown model_type {model_type!r}; choose from {', '.join(MODEL_TYPES)}")
    return PARTS_BY_TYPE[model_type]


# full: FLUX.1-dev shapes exactly; tiny: narrow widths and 1 double + 1 single block, for CPU runs. chroma and
# chroma_tiny: the same for Chroma (`model_type: chroma`, no CLIP-L); chroma's flux entry is sd-scripts'
# chroma_params exactly, which its loader hard-codes (a test checks), so sd-scripts itself reads the full set.
PRESETS: dict[str, dict] = {
    "full": {
        "flux": {
            "hidden_size": 3072,
            "num_heads": 24,
            "mlp_ratio": 4.0,
            "depth": 19,
            "depth_single_blocks": 38,
            "in_channels": 64,
            "context_in_dim": 4096,
            "vec_in_dim": 768,
            "axes_dim": [16, 56, 56],
            "guidance_embed": True,
        },
        "ae": {"ch": 128, "ch_mult": [1, 2, 4, 4], "num_res_blocks": 2, "z_channels": 16},
        "clip_l": {
            "hidden_size": 768,
            "num_hidden_layers": 12,
            "num_attention_heads": 12,
            "intermediate_size": 3072,
            "projection_dim": 768,
            "vocab_size": 49408,
        },
        "t5xxl": {"d_model": 4096, "d_ff": 10240, "d_kv": 64, "num_heads": 64, "num_layers": 24, "vocab_size": 32128},
    },
    "tiny": {
        "flux": {
            "hidden_size": 256,
            "num_heads": 2,
            "mlp_ratio": 4.0,
            "depth": 1,
            "depth_single_blocks": 1,
            "in_channels": 64,
            "context_in_dim": 64,
            "vec_in_dim": 64,
            "axes_dim": [16, 56, 56],
            "guidance_embed": True,
        },
        "ae": {"ch": 32, "ch_mult": [1, 2, 4, 4], "num_res_blocks": 1, "z_channels": 16},
        "clip_l": {
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "intermediate_size": 128,
            "projection_dim": 64,
            "vocab_size": 49408,
        },
        "t5xxl": {"d_model": 64, "d_ff": 128, "d_kv": 32, "num_heads": 2, "num_layers": 2, "vocab_size": 32128},
    },
}
PRESETS["chroma"] = {
    "model_type": "chroma",
    "flux": {  # FLUX.1's transformer shapes without the CLIP-L vector and the guidance embedding
        **{k: PRESETS["full"]["flux"][k] for k in ("hidden_size", "num_heads", "mlp_ratio", "depth")},
        **{k: PRESETS["full"]["flux"][k] for k in ("depth_single_blocks", "in_channels", "context_in_dim", "axes_dim")},
        "approximator_in_dim": 64,
        "approximator_depth": 5,
        "approximator_hidden_size": 5120,
    },
    "ae": PRESETS["full"]["ae"],
    "t5xxl": PRESETS["full"]["t5xxl"],
}
PRESETS["chroma_tiny"] = {
    "model_type": "chroma",
    "flux": {
        **{k: PRESETS["tiny"]["flux"][k] for k in ("hidden_size", "num_heads", "mlp_ratio", "depth")},
        **{k: PRESETS["tiny"]["flux"][k] for k in ("depth_single_blocks", "in_channels", "context_in_dim")},
        "axes_dim": [16, 56, 56],
        "approximator_in_dim": 64,  # fixed by Chroma's embedding of timestep, guidance and block index (16+16+32)
        "approximator_depth": 1,
        "approximator_hidden_size": 64,
    },
    "ae": PRESETS["tiny"]["ae"],
    "t5xxl": PRESETS["tiny"]["t5xxl"],
}
# FLUX fields sd-scripts does read from the checkpoint (block counts, dev vs schnell): they never need our loader.
_FLUX_FROM_CHECKPOINT = ("depth", "depth_single_blocks", "guidance_embed")
# the preset at the width sd-scripts' loaders hard-code, per model type
FULL_SIZE = {"flux": "full", "chroma": "chroma"}


def preset_model_type(preset: str) -> str:
    return PRESETS[preset].get("model_type", "flux")


def preset_parts(preset: str) -> tuple[str, ...]:
    """The part files a preset has: no CLIP-L for Chroma."""
    return parts_for(preset_model_type(preset))


def preset_key(preset: str) -> str:
    """`random-tiny-<hash of its shapes>`: a change of shape gets a new folder, never stale weights."""
    if preset not in PRESETS:
        raise KeyError(f"unknown random model preset {preset!r}; choose from {', '.join(PRESETS)}")
    digest = hashlib.sha256(json.dumps(PRESETS[preset], sort_keys=True).encode()).hexdigest()[:10]
    return f"random-{preset}-{digest}"


def needs_custom_loader(spec: dict) -> bool:
    """True when a set's widths (spec.json, or a preset's entry) differ from the full size of its model type, which
    sd-scripts' loaders hard-code: its FLUX loader reads only the block counts and dev/schnell from the checkpoint,
    its Chroma loader nothing at all. Then flux-train's own loader must build the modules."""
    model_type = spec.get("model_type", "flux")
    full = PRESETS[FULL_SIZE[model_type]]
    from_checkpoint = _FLUX_FROM_CHECKPOINT if model_type == "flux" else ()
    for part in parts_for(model_type):
        have = {k: v for k, v in spec[part].items() if not (part == "flux" and k in from_checkpoint)}
        want = {k: v for k, v in full[part].items() if not (part == "flux" and k in from_checkpoint)}
        if have != want:
            return True
    return False


def preset_file(cache: Path, preset: str, part: str) -> Path:
    if part not in preset_parts(preset):
        parts = preset_parts(preset)
        raise KeyError(f"unknown model part {part!r} for preset {preset}; choose from {', '.join(parts)}")
    return cache / preset_key(preset) / f"{part}.safetensors"
