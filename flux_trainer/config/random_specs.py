"""Shapes of the random model presets, and where each is generated. Pure data (stdlib only), so the config
layer can name the files without importing torch; `flux_trainer.sdscripts.random_model` writes them."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

PARTS = ("flux", "ae", "clip_l", "t5xxl")

# full: FLUX.1-dev shapes exactly; tiny: narrow widths and 1 double + 1 single block, for CPU runs.
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


def preset_key(preset: str) -> str:
    """`random-tiny-<hash of its shapes>`: a change of shape gets a new folder, never stale weights."""
    if preset not in PRESETS:
        raise KeyError(f"unknown random model preset {preset!r}; choose from {', '.join(PRESETS)}")
    digest = hashlib.sha256(json.dumps(PRESETS[preset], sort_keys=True).encode()).hexdigest()[:10]
    return f"random-{preset}-{digest}"


def preset_file(cache: Path, preset: str, part: str) -> Path:
    if part not in PARTS:
        raise KeyError(f"unknown model part {part!r}; choose from {', '.join(PARTS)}")
    return cache / preset_key(preset) / f"{part}.safetensors"
