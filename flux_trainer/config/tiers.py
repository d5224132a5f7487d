"""Memory tiers: which tier a card gets (`memory=auto`), and the tier file merged under the user's own keys."""

from __future__ import annotations

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


def resolve_memory(cfg: DictConfig, info) -> str | None:
    """memory=auto: the tier file for this card's VRAM, under any memory.* key the user set on the command line
    (a value that differs from auto.yaml's placeholder is the user's and is kept). Returns the line that says which
    tier it chose (None where the user named one)."""
    if cfg.memory.tier != "auto":
        return None
    tier = tier_for_vram(info.vram_gib if info.family != "cpu" else None)
    memory_dir = shipped_config_dir() / "memory"
    placeholders = OmegaConf.load(memory_dir / "auto.yaml")
    users = {k: v for k, v in cfg.memory.items() if k != "tier" and placeholders.get(k) != v}
    cfg.memory = OmegaConf.merge(cfg.memory, OmegaConf.load(memory_dir / f"{tier}.yaml"), users)
    has = f"has {info.vram_gib:.0f} GiB" if info.vram_gib and info.family != "cpu" else "is no GPU"
    return f"memory=auto: {info.name} {has} -> memory={tier}"
