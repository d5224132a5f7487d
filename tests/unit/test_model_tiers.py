"""A memory tier on a smaller model than FLUX.1 (FLUX.2 klein 4B / 9B): the tier's memory keys for that size, the
user's own keys kept, FLUX.1, Chroma and Kontext untouched (config.tiers.fit_tier_to_model, through plan.resolve)."""

from __future__ import annotations

import pytest

from flux_trainer.config.tiers import MODEL_TIERS, SIZES, fit_tier_to_model
from flux_trainer.plan import resolve
from tests.cards import RTX4090

KLEIN = {"4b": "flux2_klein_base_4b", "9b": "flux2_klein_base_9b"}


def memory_of(cfg) -> dict:
    return {k: cfg.memory[k] for k in ("fp8_base", "blocks_to_swap", "t5xxl_fp8")}


@pytest.mark.parametrize(("size", "tier"), [(s, t) for s, tiers in MODEL_TIERS.items() for t in tiers])
def test_each_klein_size_runs_its_own_settings_at_each_tier(compose, size, tier):
    cfg = compose("+dataset=mychar", f"model={KLEIN[size]}", f"memory={tier}")
    fit_tier_to_model(cfg)
    assert memory_of(cfg) == MODEL_TIERS[size][tier]
    assert cfg.memory.tier == tier and cfg.memory.gradient_checkpointing is True  # the rest is the tier file's


def test_every_klein_version_has_a_size():
    from flux_trainer.musubi.translate import MAX_BLOCKS_TO_SWAP

    klein = {v for v in MAX_BLOCKS_TO_SWAP if v.startswith("klein")}
    assert klein == set(SIZES)
    for size, tiers in MODEL_TIERS.items():  # never more than musubi-tuner swaps for that size
        most = min(n for v, n in MAX_BLOCKS_TO_SWAP.items() if SIZES.get(v) == size)
        assert all(t["blocks_to_swap"] <= most for t in tiers.values())


def test_a_key_the_user_set_stays_theirs(compose):
    cfg = compose("+dataset=mychar", "model=flux2_klein_base_4b", "memory=vram12", "memory.blocks_to_swap=5")
    line = fit_tier_to_model(cfg)
    assert cfg.memory.blocks_to_swap == 5 and cfg.memory.fp8_base is False  # theirs kept, the size's fp8 off
    assert line == "memory=vram12 on flux2_klein_base_4b (4B): fp8_base=False"


@pytest.mark.parametrize("model", ["flux_dev", "chroma", "flux_kontext", "flux2_dev"])
def test_other_models_keep_the_tier_file(compose, model):
    cfg = compose("+dataset=mychar", f"model={model}", "memory=vram12")
    before = memory_of(cfg)
    assert fit_tier_to_model(cfg) is None and memory_of(cfg) == before


def test_the_plan_fits_the_tier_memory_auto_chose(compose, monkeypatch):
    monkeypatch.setattr("flux_trainer.launch.device.arch_supported", lambda info: (True, ""))
    plan = resolve(compose("+dataset=mychar", "dry_run=true", "model=flux2_klein_base_4b"), RTX4090)
    assert plan.tier == "vram24" and memory_of(plan.cfg) == MODEL_TIERS["4b"]["vram24"]
    assert "memory=vram24 on flux2_klein_base_4b (4B): fp8_base=False" in plan.said
    mine = resolve(compose("+dataset=mychar", "dry_run=true", "model=flux2_klein_base_9b", "memory.blocks_to_swap=3"),
                   RTX4090)  # fmt: skip
    assert mine.cfg.memory.blocks_to_swap == 3 and mine.cfg.memory.fp8_base is True
