"""Environment profiles per GPU family, with mocked devices: what is set, where, and that the user's values win."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flux_trainer.launch.device import DeviceInfo, family_for
from flux_trainer.launch.profiles import TF32_ENV, environment_profile, profile_json, profile_lines

CACHE = Path("/cache/flux-trainer")

CARDS = {
    "rtx5090": ("NVIDIA GeForce RTX 5090", (12, 0), 31.4),
    "b200": ("NVIDIA B200", (10, 0), 178.4),
    "h100": ("NVIDIA H100 80GB HBM3", (9, 0), 79.2),
    "rtx4090": ("NVIDIA GeForce RTX 4090", (8, 9), 23.6),
    "rtx3060": ("NVIDIA GeForce RTX 3060", (8, 6), 11.8),
    "a100": ("NVIDIA A100-SXM4-80GB", (8, 0), 79.2),
    "t4": ("Tesla T4", (7, 5), 14.6),
}


def card(key: str, count: int = 1) -> DeviceInfo:
    name, cap, vram = CARDS[key]
    return DeviceInfo(
        name=name,
        index=0,
        capability=cap,
        family=family_for(cap, name),
        vram_gib=vram,
        count=count,
        bf16=cap >= (8, 0),
        fp8=cap >= (8, 9),
        torch_version="2.8.0",
        torch_cuda="12.8",
    )


def profile(info: DeviceInfo, user_env=None, gpus: int = 1):
    return environment_profile(info, user_env or {}, gpus=gpus, cache_dir=CACHE, cpu_threads=4)


@pytest.mark.parametrize("key", sorted(CARDS))
def test_every_cuda_family_gets_expandable_segments(key):
    env = profile(card(key)).env
    assert "expandable_segments:True" in env["PYTORCH_CUDA_ALLOC_CONF"].split(",")
    assert env["CUDA_MODULE_LOADING"] == "LAZY"
    assert env["TORCHINDUCTOR_CACHE_DIR"] == str(CACHE / "torchinductor")
    assert env["TRITON_CACHE_DIR"] == str(CACHE / "triton")
    assert env["TOKENIZERS_PARALLELISM"] == "false"
    assert env["OMP_NUM_THREADS"] == "4"
    assert "NVIDIA_TF32_OVERRIDE" not in env  # it can only switch TF32 off


@pytest.mark.parametrize(
    ("key", "small"),
    [("rtx3060", True), ("rtx4090", True), ("t4", True), ("rtx5090", False), ("h100", False), ("b200", False)],
)
def test_gc_threshold_only_on_cards_up_to_24_gb(key, small):
    conf = profile(card(key)).env["PYTORCH_CUDA_ALLOC_CONF"]
    assert ("garbage_collection_threshold:0.8" in conf) is small


@pytest.mark.parametrize(
    ("key", "arch"),
    [
        ("rtx5090", "12.0"),
        ("b200", "10.0"),
        ("h100", "9.0"),
        ("rtx4090", "8.9"),
        ("rtx3060", "8.6"),
        ("a100", "8.0"),
        ("t4", "7.5"),
    ],
)
def test_arch_list_is_the_cards_own(key, arch):
    assert profile(card(key)).env["TORCH_CUDA_ARCH_LIST"] == arch


@pytest.mark.parametrize(
    ("key", "tf32"),
    [("rtx5090", True), ("b200", True), ("h100", True), ("rtx4090", True), ("a100", True), ("t4", False)],
)
def test_tf32_switch_only_where_tensor_cores_have_tf32(key, tf32):
    env = profile(card(key)).env
    assert (env.get(TF32_ENV) == "1") is tf32


@pytest.mark.parametrize(
    ("key", "gpus", "disabled"),
    [("rtx4090", 2, True), ("rtx5090", 4, True), ("rtx4090", 1, False), ("h100", 8, False), ("a100", 2, False)],
)
def test_nccl_p2p_off_only_for_consumer_multi_gpu(key, gpus, disabled):
    env = profile(card(key, count=gpus), gpus=gpus).env
    assert (env.get("NCCL_P2P_DISABLE") == "1") is disabled
    assert (env.get("NCCL_IB_DISABLE") == "1") is disabled


@pytest.mark.parametrize(
    ("key", "cached"),
    [("rtx5090", True), ("b200", True), ("h100", True), ("rtx4090", False), ("a100", False), ("t4", False)],
)
def test_flash_attn_4_disk_cache_only_where_it_runs(key, cached):
    env = profile(card(key)).env
    assert (env.get("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED") == "1") is cached
    sm = "sm{}{}".format(*CARDS[key][1])
    assert env.get("FLASH_ATTENTION_CUTE_DSL_CACHE_DIR") == (str(CACHE / "flash_attn_cute" / sm) if cached else None)


def test_cpu_gets_no_cuda_variables():
    env = profile(DeviceInfo.cpu(torch_version="2.13.0+cpu")).env
    for name in (
        "PYTORCH_CUDA_ALLOC_CONF",
        TF32_ENV,
        "TORCH_CUDA_ARCH_LIST",
        "NCCL_P2P_DISABLE",
        "TRITON_CACHE_DIR",
        "CUDA_MODULE_LOADING",
        "FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED",
    ):
        assert name not in env
    assert env["TOKENIZERS_PARALLELISM"] == "false" and env["OMP_NUM_THREADS"] == "4"


def test_user_value_wins_and_is_reported_with_ours():
    p = profile(card("rtx4090"), {"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync", "HOME": "/root"})
    assert p.env["PYTORCH_CUDA_ALLOC_CONF"] == "backend:cudaMallocAsync"
    assert "HOME" not in p.env  # only what the profile is about
    rec = next(r for r in p.records if r.name == "PYTORCH_CUDA_ALLOC_CONF")
    assert rec.source == "user" and rec.value == "backend:cudaMallocAsync"
    assert rec.profile_value == "expandable_segments:True,garbage_collection_threshold:0.8"
    others = [r for r in p.records if r.name != "PYTORCH_CUDA_ALLOC_CONF"]
    assert others and all(r.source == "profile" and r.profile_value is None for r in others)
    assert any("(yours; profile: expandable_segments" in line for line in profile_lines(p))


def test_user_alias_of_the_allocator_variable_is_respected():
    p = profile(card("h100"), {"PYTORCH_ALLOC_CONF": "expandable_segments:False"})
    assert "PYTORCH_CUDA_ALLOC_CONF" not in p.env  # setting both would conflict
    assert p.env["PYTORCH_ALLOC_CONF"] == "expandable_segments:False"


def test_every_record_has_a_one_line_reason_and_env_matches_records():
    p = profile(card("rtx5090", count=2), gpus=2)
    assert {r.name: r.value for r in p.records} == p.env
    for r in p.records:
        assert r.reason and "\n" not in r.reason and len(r.reason) < 240


def test_profile_json_round_trips():
    info = card("h100")
    p = profile(info)
    data = json.loads(json.dumps(profile_json(p, info)))
    assert data["device"]["name"] == info.name and data["device"]["family"] == "hopper"
    assert data["env"] == p.env
    assert [r["name"] for r in data["records"]] == [r.name for r in p.records]
    assert all(r["source"] == "profile" for r in data["records"])
