"""The plan: a config validated and resolved once (tier, kernel switches, paths, processes), then read-only; and
the kernels' switch policy it asks, which knows no config."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from omegaconf.errors import ReadonlyConfigError

from flux_kernels.runtime import policy
from flux_trainer.config import ConfigError
from flux_trainer.plan import resolve
from tests.cards import H200 as CARD
from tests.cards import RTX4090

H200 = replace(CARD, count=2)  # two cards: launcher.gpus=all takes both


def test_resolve_picks_the_tier_decides_the_kernels_and_freezes_the_config(compose, monkeypatch):
    monkeypatch.setattr("flux_trainer.launch.device.arch_supported", lambda info: (True, ""))
    cfg = compose("+dataset=mychar", "dry_run=true", "model.flux=rel/flux.safetensors", "launcher.gpus=all")
    plan = resolve(cfg, H200)
    assert (plan.tier, plan.tier_gib, plan.gpus) == ("vram80", 80.0, 2)  # launcher.gpus=all: both cards
    assert plan.kernels.cuda_graphs and plan.kernels.fp8_keep_transposed and not plan.kernels.cuda_graphs_asked
    assert any(line.startswith("memory=auto: NVIDIA H200") for line in plan.said)
    assert Path(plan.cfg.model.flux).is_absolute() and plan.cfg.model.flux.endswith("rel/flux.safetensors")
    assert plan.runs_root.is_absolute() and plan.cfg is cfg
    with pytest.raises(ReadonlyConfigError):
        plan.cfg.memory.tier = "vram12"  # a later layer cannot decide again


def test_a_smaller_card_trades_memory_so_the_switches_stay_off_unless_its_tier_has_room(compose, monkeypatch):
    """vram24 checkpoints and has room for CUDA graphs' pool (memory.cuda_graphs); the fp8 weights' transposes stay
    off; a tier without the room (or a user who says so) replays nothing; the swapping tiers replay through block_swap
    (vram8 measured no faster)."""
    monkeypatch.setattr("flux_trainer.launch.device.arch_supported", lambda info: (True, ""))
    plan = resolve(compose("+dataset=mychar", "dry_run=true"), RTX4090)
    assert plan.tier == "vram24" and plan.gpus == 1
    assert plan.kernels.cuda_graphs and not plan.kernels.cuda_graphs_asked and not plan.kernels.fp8_keep_transposed
    mine = resolve(compose("+dataset=mychar", "dry_run=true", "memory.cuda_graphs=false"), RTX4090)  # typed
    assert mine.tier == "vram24" and not mine.kernels.cuda_graphs  # the user's key kept over the tier's
    for tier, graphs in (("vram16", True), ("vram12", True), ("vram8", False)):  # block_swap keeps the addresses
        got = resolve(compose("+dataset=mychar", "dry_run=true", f"memory={tier}"), RTX4090).kernels
        assert got.cuda_graphs is graphs and not got.fp8_keep_transposed, tier
    accumulating = compose("+dataset=mychar", "dry_run=true", "train.gradient_accumulation_steps=2")
    assert not resolve(accumulating, RTX4090).kernels.cuda_graphs  # auto: off where something blocks them


def test_cuda_graphs_asked_where_they_cannot_run_names_every_reason_in_our_keys(compose, monkeypatch):
    monkeypatch.setattr("flux_trainer.launch.device.arch_supported", lambda info: (True, ""))
    cfg = compose(
        "+dataset=mychar",
        "dry_run=true",
        "kernels.cuda_graphs=true",
        "memory=vram12",
        "kernels.set='auto,-block_swap'",
        "train.gradient_accumulation_steps=2",
    )
    with pytest.raises(ConfigError) as refused:
        resolve(cfg, H200)
    problems = refused.value.problems
    assert any("memory.blocks_to_swap without the block_swap kernel" in p for p in problems), problems
    assert any("train.gradient_accumulation_steps > 1" in p for p in problems), problems
    assert all(p.startswith("kernels.cuda_graphs=true") for p in problems)


def test_cuda_graphs_over_swapped_blocks_with_block_swap_but_not_sd_scripts_swap(compose, monkeypatch):
    """flux_kernels' block_swap runs every block from the same card buffers, so the graphs can replay over swapped
    blocks; sd-scripts' own swap (block_swap taken out) and CPU-offloaded checkpointing still block them."""
    monkeypatch.setattr("flux_trainer.launch.device.arch_supported", lambda info: (True, ""))
    ok = resolve(compose("+dataset=mychar", "dry_run=true", "memory=vram12", "kernels.cuda_graphs=true"), H200)
    assert ok.kernels.cuda_graphs and ok.kernels.cuda_graphs_asked
    for extra in ("kernels.set='auto,-block_swap'", "memory.cpu_offload_checkpointing=true"):
        overrides = ["memory=vram12", "kernels.cuda_graphs=true", extra]
        if "cpu_offload" in extra:
            overrides[0] = "memory=vram24"
        with pytest.raises(ConfigError) as refused:
            resolve(compose("+dataset=mychar", "dry_run=true", *overrides), H200)
        assert any("memory." in p for p in refused.value.problems), refused.value.problems


SHAPE = policy.RunShape(gpu=True, compiles_blocks=True, gradient_checkpointing=False, weights_move=False)


@pytest.mark.parametrize(
    ("change", "blockers"),
    [
        ({}, []),
        ({"gpu": False}, [policy.NO_GPU]),
        ({"compiles_blocks": False}, [policy.NO_COMPILED_BLOCKS]),
        ({"weights_move": True}, [policy.WEIGHTS_MOVE]),
        ({"gradient_accumulation_steps": 4}, [policy.ACCUMULATION]),
        ({"gpu": False, "weights_move": True}, [policy.NO_GPU, policy.WEIGHTS_MOVE]),
        ({"weights_move": True, "swap_in_place": True}, []),  # block_swap: each block at the same addresses
        ({"weights_move": True, "swap_in_place": True, "offloads_checkpoints": True}, [policy.WEIGHTS_MOVE]),
    ],
)
def test_policy_blockers(change, blockers):
    shape = replace(SHAPE, **change)
    assert policy.cuda_graph_blockers(shape) == blockers
    assert policy.cuda_graphs("auto", shape) is (not blockers)
    assert policy.cuda_graphs("false", shape) is False
    if blockers:
        with pytest.raises(policy.GraphsBlocked) as blocked:
            policy.cuda_graphs("true", shape)
        assert blocked.value.blockers == blockers
    else:
        assert policy.cuda_graphs(True, shape) is True  # a config's bool reads as "true"


def test_policy_auto_stays_off_where_memory_is_traded_and_bad_values_are_refused():
    checkpointed = replace(SHAPE, gradient_checkpointing=True)
    assert policy.cuda_graphs("auto", checkpointed) is False and policy.cuda_graphs("true", checkpointed) is True
    assert policy.fp8_keep_transposed("auto", SHAPE) is True
    assert policy.fp8_keep_transposed("auto", checkpointed) is False
    assert policy.fp8_keep_transposed("TRUE", checkpointed) is True
    with pytest.raises(ValueError, match="choose auto, true or false"):
        policy.fp8_keep_transposed("sometimes", SHAPE)
