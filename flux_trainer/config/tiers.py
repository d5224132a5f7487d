"""Memory tiers: which tier a card gets (`memory=auto`), the tier file merged under the user's own keys, and what a
tier runs for a smaller model than FLUX.1 (FLUX.2 [klein]).

The tier files (configs/memory/vramNN.yaml) are sized for FLUX.1's 12B transformer. FLUX.2 klein 4B (3.9B, 7.3 GiB
in bf16) and 9B (about twice that) need far less: with FLUX.1's values every klein 4B tier swapped musubi-tuner's
most (13 blocks) and ran 2.05-2.18 s/step at a torch peak of 3.4 GiB, against 0.176 s/step unswapped at vram80
(H200, 2026-11-28, docs/models.md). So on these models a tier's memory keys come from MODEL_TIERS, and a memory.*
key given on the command line with a value other than the tier file's stays the user's (as memory=auto keeps them).
Kontext has FLUX.1's sizes and keeps the tier files."""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig, OmegaConf

from flux_trainer.config.paths import shipped_config_dir

# memory=auto: the largest tier whose VRAM (GiB, as PyTorch reports the card's memory) the card has. A card sold as
# N GB reports less (RTX 4090 23.65 GiB, L40S 44.39, RTX 3070 7.78: configs/hardware/), hence the thresholds.
TIER_VRAM = (
    ("vram80", 78),
    ("vram48", 44),
    ("vram32", 30),
    ("vram24", 22),
    ("vram16", 15),
    ("vram12", 11),
    ("vram8", 7),
)
TIERS = tuple(tier for tier, _ in TIER_VRAM)  # largest first


def tier_for_vram(vram_gib: float | None) -> str:
    """The tier for a card of `vram_gib` (None: no GPU, `cpu`); a card below the smallest tier's size gets the
    smallest, whose block swap leaves the least on the card."""
    if vram_gib is None:
        return "cpu"
    for tier, need in TIER_VRAM:
        if vram_gib >= need:
            return tier
    return TIERS[-1]


def users_keys(memory: DictConfig, tier_file: str) -> dict[str, Any]:
    """The memory.* keys the user set: those whose value differs from the shipped `configs/memory/<tier_file>.yaml`
    (auto.yaml's placeholders, or the named tier's values)."""
    shipped = OmegaConf.load(shipped_config_dir() / "memory" / f"{tier_file}.yaml")
    return {k: v for k, v in memory.items() if k != "tier" and shipped.get(k) != v}


def resolve_memory(cfg: DictConfig, info) -> str | None:
    """memory=auto: the tier file for this card's VRAM, under any memory.* key the user set on the command line
    (a value that differs from auto.yaml's placeholder is the user's and is kept). Returns the line that says which
    tier it chose (None where the user named one)."""
    if cfg.memory.tier != "auto":
        return None
    tier = tier_for_vram(info.vram_gib if info.family != "cpu" else None)
    users = users_keys(cfg.memory, "auto")
    cfg.memory = OmegaConf.merge(cfg.memory, OmegaConf.load(shipped_config_dir() / "memory" / f"{tier}.yaml"), users)
    has = f"has {info.vram_gib:.0f} GiB" if info.vram_gib and info.family != "cpu" else "is no GPU"
    return f"memory=auto: {info.name} {has} -> memory={tier}"


# model_version -> size, and per size the tier's memory keys (the rest stays the tier file's). Chosen from the
# card peaks measured at each tier's size less 0.5 GiB (docs/models.md#flux2-memory-tiers): the text encoder's
# caching (Qwen3 4B / 8B, its own process before training) is the peak where it runs in bf16.
SIZES = {"klein-4b": "4b", "klein-base-4b": "4b", "klein-9b": "9b", "klein-base-9b": "9b"}
MODEL_TIERS: dict[str, dict[str, dict[str, Any]]] = {
    "4b": {
        # fp8 weights, 6 blocks swapped from pinned memory, the text encoder in fp8 (2026-11-29): 0.474 s/step
        # compiled, plain musubi-tuner 0.449, card 6.6 GiB on both; 13 swapped (the most) 0.559-0.581 at 7.4; nothing
        # swapped 0.240 but 8.2 GiB on the card (torch 5.9): over 7.5
        "vram8": {"fp8_base": True, "blocks_to_swap": 6, "t5xxl_fp8": True},
        # bf16 weights (7.3 GiB), every block checkpointed, nothing swapped: 0.240 s/step, card 11.24 GiB
        "vram12": {"fp8_base": False, "blocks_to_swap": 0, "t5xxl_fp8": False},
        "vram16": {"fp8_base": False, "blocks_to_swap": 0, "t5xxl_fp8": False},
        "vram24": {"fp8_base": False, "blocks_to_swap": 0, "t5xxl_fp8": False},
    },
    "9b": {
        # fp8 weights, the most blocks swapped (16) and the text encoder (Qwen3 8B) in fp8, whose bf16 caching
        # alone went over 11.5 GiB: 0.949 s/step against plain's 0.948, card 9.4 GiB uncompiled (kernels=auto with
        # blocks swapped; compiled: 11.6, over); 8 swapped peaked at 12.0 GiB on the card compiled (torch 9.4)
        "vram12": {"fp8_base": True, "blocks_to_swap": 16, "t5xxl_fp8": True},
        # fp8 weights, 8 blocks swapped: 12.0 GiB on the card (0.826 s/step); the bf16 text encoder's caching 15.3.
        # Nothing swapped peaked at 15.7 GiB (vram24's run, 0.463 s/step): over 15.5
        "vram16": {"fp8_base": True, "blocks_to_swap": 8, "t5xxl_fp8": False},
        "vram24": {"fp8_base": True, "blocks_to_swap": 0, "t5xxl_fp8": False},
    },
}


def model_tier(cfg: DictConfig) -> dict[str, Any] | None:
    """This model's entry for the run's tier (None: the tier file's values stand)."""
    size = SIZES.get(str(cfg.model.get("model_version")))
    if cfg.model.get("model_type") != "flux2" or size is None:
        return None
    return MODEL_TIERS[size].get(str(cfg.memory.tier))


def fit_tier_to_model(cfg: DictConfig) -> str | None:
    """The tier's memory keys for this model's size merged over the tier file's (in place), under the keys the
    user set (a value other than the tier file's). Returns the line that says what changed, None where nothing did."""
    entry = model_tier(cfg)
    if not entry:
        return None
    users = users_keys(cfg.memory, str(cfg.memory.tier))
    changed = {k: v for k, v in entry.items() if k not in users and cfg.memory.get(k) != v}
    if not changed:
        return None
    cfg.memory = OmegaConf.merge(cfg.memory, changed)
    keys = ", ".join(f"{k}={v}" for k, v in changed.items())
    return f"memory={cfg.memory.tier} on {cfg.model.name} ({SIZES[str(cfg.model.model_version)].upper()}): {keys}"
