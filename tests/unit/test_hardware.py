"""`hardware=NAME`: a run planned for a named card on any machine (dry_run), the card's tier and environment in the run
dir; a real run on another card refused with both names; every card's kernel choice from its capability alone."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import tomli
from omegaconf import OmegaConf

from flux_trainer.cli import main
from flux_trainer.config import ConfigError
from flux_trainer.config.paths import shipped_config_dir
from flux_trainer.launch.device import DeviceInfo
from flux_trainer.plan import resolve
from tests.cards import H200, RTX4090
from tests.unit.test_cli import run_dirs

# card -> the tier memory=auto gives it (a card sold as N GB reports less than N GiB: RTX 3070 7.78, L40S 44.39)
CARD_TIERS = {
    "rtx3060": "vram12",
    "rtx3070": "vram8",
    "rtx3080": "vram8",
    "rtx3090": "vram24",
    "rtx4060": "vram8",
    "rtx4060ti16": "vram16",
    "rtx4070": "vram12",
    "rtx4080": "vram16",
    "rtx4090": "vram24",
    "rtx5080": "vram16",
    "rtx5090": "vram32",
    "l40s": "vram48",
    "a100": "vram80",
    "h100": "vram80",
    "h200": "vram80",
}


def card_names() -> list[str]:
    return sorted(p.stem for p in (shipped_config_dir() / "hardware").glob("*.yaml") if p.stem != "auto")


def test_every_shipped_card_is_in_the_table():
    assert card_names() == sorted(CARD_TIERS)


@pytest.mark.parametrize("name", sorted(CARD_TIERS))
def test_a_named_card_is_planned_on_a_machine_without_it(workdir, capsys, name):
    """dry_run on this CPU machine writes the run dir that card would run: its tier, its family's environment."""
    preset = OmegaConf.load(shipped_config_dir() / "hardware" / f"{name}.yaml")
    assert main(["+dataset=mychar", "model=random", f"hardware={name}", "dry_run=true"]) == 0
    (run,) = run_dirs(workdir)
    cfg = OmegaConf.load(run / "config.yaml")
    assert cfg.memory.tier == CARD_TIERS[name]
    env = json.loads((run / "env.json").read_text())
    assert env["device"]["name"] == preset.card and env["device"]["capability"] == list(preset.capability)
    major, minor = preset.capability
    assert env["env"]["TORCH_CUDA_ARCH_LIST"].startswith(f"{major}.{minor}")
    flat = {k: v for t in tomli.loads((run / "sd_scripts.toml").read_text()).values() for k, v in t.items()}
    tier = OmegaConf.load(shipped_config_dir() / "memory" / f"{CARD_TIERS[name]}.yaml")
    assert flat.get("blocks_to_swap", 0) == tier.blocks_to_swap
    assert bool(flat.get("fp8_base", False)) == bool(tier.fp8_base)
    out = capsys.readouterr().out
    assert f"hardware={name}: planned for {preset.card}" in out and "this machine: no CUDA GPU" in out


@pytest.mark.parametrize(("name", "size"), [("rtx4060", "4b"), ("rtx3060", "4b"), ("rtx4080", "9b"), ("rtx3060", "9b")])
def test_a_klein_run_planned_for_a_card_gets_its_size_s_tier_and_kernels(workdir, capsys, name, size):
    """FLUX.2 klein on a named card: the tier's settings for the model's size (config.tiers.MODEL_TIERS) in
    musubi-tuner's TOML, and the kernel line names only the kernels musubi-tuner's training takes."""
    from flux_trainer.backend.options import MUSUBI_KERNELS
    from flux_trainer.config.tiers import MODEL_TIERS

    model = {"4b": "flux2_klein_base_4b", "9b": "flux2_klein_base_9b"}[size]
    assert main(["+dataset=mychar", f"model={model}", f"hardware={name}", "dry_run=true"]) == 0
    (run,) = run_dirs(workdir)
    want = MODEL_TIERS[size][CARD_TIERS[name]]
    flat = {k: v for t in tomli.loads((run / "musubi_tuner.toml").read_text()).values() for k, v in t.items()}
    assert flat.get("blocks_to_swap", 0) == want["blocks_to_swap"] and bool(flat.get("fp8_base")) == want["fp8_base"]
    assert flat.get("use_pinned_memory_for_block_swap", False) == bool(want["blocks_to_swap"])
    (line,) = [x for x in capsys.readouterr().out.splitlines() if "kernels on " in x]
    named = line.split("): ", 1)[1].split(";")[0].split(", ")
    assert named and set(named) <= set(MUSUBI_KERNELS) and "attention" in named
    assert "; attention backends it can run: " in line  # flux_trainer/musubi/attention.py calls them
    # auto leaves the compile out where blocks are swapped (flux_trainer.musubi.kernel_install.WITH_SWAP)
    assert ("compile_blocks" in named) == (not want["blocks_to_swap"]), (named, want)


def test_a_real_run_on_another_card_is_refused_naming_both(workdir, capsys):
    assert main(["+dataset=mychar", "model=random_tiny", "hardware=rtx5090"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "hardware=rtx5090" in err and "NVIDIA GeForce RTX 5090" in err
    assert "no CUDA GPU" in err and "dry_run=true" in err
    assert not (workdir / "runs").exists()


def test_planning_on_the_named_card_uses_the_card_found(compose, monkeypatch):
    monkeypatch.setattr("flux_trainer.launch.device.arch_supported", lambda info: (True, ""))
    plan = resolve(compose("+dataset=mychar", "model=random", "hardware=rtx4090"), RTX4090)
    assert plan.device is RTX4090 and plan.tier == "vram24"  # its own torch build and architecture list
    assert any("is that card" in line for line in plan.said)
    with pytest.raises(ConfigError) as refused:
        resolve(compose("+dataset=mychar", "model=random", "hardware=rtx4090"), H200)
    assert "NVIDIA GeForce RTX 4090" in str(refused.value) and "NVIDIA H200" in str(refused.value)
    # same name, another capability: not that card
    odd = replace(RTX4090, capability=(8, 6))
    with pytest.raises(ConfigError):
        resolve(compose("+dataset=mychar", "model=random", "hardware=rtx4090"), odd)


def test_a_named_card_planned_elsewhere_takes_the_launcher_s_gpu_count(compose):
    plan = resolve(compose("+dataset=mychar", "hardware=h100", "launcher.gpus=2", "dry_run=true"), H200)
    assert plan.device.name == "NVIDIA H100 80GB HBM3" and plan.device.count == 2 and plan.gpus == 2
    assert plan.device.arch_list == ()  # that machine's torch build is not this one's: not checked here


def test_a_card_of_the_user_s_own(workdir, capsys):
    """configs/hardware/NAME.yaml in the user's config dir names a card flux-train does not ship."""
    own = workdir / "configs" / "hardware" / "rtx6000ada.yaml"
    own.parent.mkdir(parents=True)
    own.write_text("name: rtx6000ada\ncard: NVIDIA RTX 6000 Ada Generation\nfamily: ada\ncapability: [8, 9]\n"
                   "vram_gib: 47.5\n")  # fmt: skip
    assert main(["+dataset=mychar", "model=random", "hardware=rtx6000ada", "dry_run=true"]) == 0
    (run,) = run_dirs(workdir)
    assert OmegaConf.load(run / "config.yaml").memory.tier == "vram48"
    bad = workdir / "configs" / "hardware" / "half.yaml"
    bad.write_text("name: half\ncard: Some Card\n")
    assert main(["+dataset=mychar", "model=random", "hardware=half", "dry_run=true"]) == 2
    err = capsys.readouterr().err
    assert "hardware=half" in err and "capability" in err and "vram_gib" in err


def test_a_detected_card_matches_by_name_pattern():
    from flux_trainer.launch.device import is_card, named_device

    here = DeviceInfo.cpu()
    ti = named_device("rtx4060ti16", "NVIDIA GeForce RTX 4060 Ti", (8, 9), 15.7, 1, here)
    plain = named_device("rtx4060", "NVIDIA GeForce RTX 4060", (8, 9), 7.6, 1, here)
    found = replace(RTX4090, name="NVIDIA GeForce RTX 4060 Ti")
    assert is_card(ti, "RTX 4060 Ti", found)
    assert not is_card(plain, "RTX 4060(?! Ti)", found)  # the 8 GB card's pattern leaves the Ti out
    assert not is_card(plain, None, DeviceInfo.cpu())


def test_presets_say_what_the_card_is():
    for name in card_names():
        preset = OmegaConf.load(shipped_config_dir() / "hardware" / f"{name}.yaml")
        assert preset.name == name and preset.card.startswith("NVIDIA") and len(preset.capability) == 2
        assert 7 <= preset.vram_gib <= 141, name
        assert Path(shipped_config_dir() / "hardware" / f"{name}.yaml").read_text().startswith("# flux-train")


def test_the_8gb_tier_casts_t5_to_fp8_to_encode_the_captions(workdir):
    """T5-XXL in bf16 (9.5 GB) does not fit an 8 GB card when sd-scripts moves it there to cache the captions'
    embeddings: memory.t5xxl_fp8 reaches the training process, which casts it (sd-scripts runs an fp8 T5 itself)."""
    import torch

    from flux_trainer.sdscripts.runner import RunnerSpec, t5_to_fp8

    assert main(["+dataset=mychar", "model=random", "hardware=rtx4060", "dry_run=true"]) == 0
    assert main(["+dataset=mychar", "model=random", "hardware=rtx3060", "dry_run=true"]) == 0
    eight, twelve = run_dirs(workdir)
    assert RunnerSpec.read(eight).t5xxl_fp8 is True and RunnerSpec.read(twelve).t5xxl_fp8 is False
    t5 = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4)).to(torch.bfloat16)
    t5.dtype = torch.bfloat16  # sd-scripts' T5 has a dtype property: the cast is skipped when it says fp8 already
    t5_to_fp8(t5)
    assert all(p.dtype == torch.float8_e4m3fn for p in t5.parameters())


def test_a_dry_run_for_a_named_card_says_which_kernels_it_gets_and_what_was_verified(workdir, capsys):
    assert main(["+dataset=mychar", "model=random", "hardware=rtx5090", "dry_run=true"]) == 0
    out = capsys.readouterr().out
    assert "kernels on NVIDIA GeForce RTX 5090 (sm_120):" in out and "chosen by capability" in out
    assert main(["+dataset=mychar", "model=random", "hardware=h100", "dry_run=true"]) == 0
    assert "verified on H100 / H200" in capsys.readouterr().out


def test_the_doctor_row_for_a_card_passes_where_verified_and_warns_elsewhere():
    from flux_trainer.doctor.core import PASS, SKIP, WARN
    from flux_trainer.doctor.gpu import kernels_for_card

    assert kernels_for_card(H200).status == PASS
    row = kernels_for_card(RTX4090)
    assert row.status == WARN and "fp8_matmul" in row.data["kernels"] and "probes each kernel" in row.fix
    assert kernels_for_card(DeviceInfo.cpu()).status == SKIP
