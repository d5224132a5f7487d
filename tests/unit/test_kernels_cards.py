"""Each card's kernel choice from its description alone (mocked device properties): RTX 5090 (Blackwell sm_120) and
RTX 4090 (Ada sm_89) get fp8 matmuls through torch._scaled_mm and every kernel auto has; an RTX 3090 (Ampere) no fp8
matmuls; FlashAttention-4's backward only from sm_90; what was verified where is said plainly."""

from __future__ import annotations

import pytest
import torch

from flux_kernels.runtime import cards
from flux_kernels.runtime.device import triton_available

RTX5090 = {"type": "cuda", "name": "NVIDIA GeForce RTX 5090", "capability": (12, 0), "vram_gib": 31.4}
RTX4090 = {"type": "cuda", "name": "NVIDIA GeForce RTX 4090", "capability": (8, 9), "vram_gib": 23.6}
RTX3090 = {"type": "cuda", "name": "NVIDIA GeForce RTX 3090", "capability": (8, 6), "vram_gib": 23.7}
H100 = {"type": "cuda", "name": "NVIDIA H100 80GB HBM3", "capability": (9, 0), "vram_gib": 79.2}
CPU = {"type": "cpu", "name": "cpu"}


def choices(card, request="auto"):
    return {c.name: c for c in cards.kernels_on(card, request)}


@pytest.mark.parametrize("card", [RTX5090, RTX4090, H100], ids=["rtx5090", "rtx4090", "h100"])
def test_fp8_cards_get_every_kernel_of_auto_fp8_matmuls_included(card):
    got = choices(card)
    assert got["fp8_matmul"].applies == hasattr(torch, "_scaled_mm")  # fp8 through torch._scaled_mm
    for name in ("attention", "compile_blocks", "selective_checkpoint", "block_swap", "single_qkv"):
        assert got[name].applies, (name, got[name].reason)
    assert not got["coalesced_reduce"].applies  # one process: nothing to coalesce, on any card


def test_ampere_has_no_fp8_matmuls_and_keeps_the_rest():
    got = choices(RTX3090)
    assert not got["fp8_matmul"].applies and "sm_89" in got["fp8_matmul"].reason
    assert got["compile_blocks"].applies and got["block_swap"].applies


def test_triton_kernels_named_apply_from_sm_80_where_triton_is_installed():
    for card in (RTX5090, RTX4090, RTX3090):
        got = choices(card, "qk_norm_rope,modulate")
        assert got["qk_norm_rope"].applies == triton_available() and got["modulate"].applies == triton_available()
    old = {"type": "cuda", "name": "Tesla T4", "capability": (7, 5)}
    assert not choices(old, "qk_norm_rope")["qk_norm_rope"].applies  # no bf16 tensor cores


def test_flash_attention_4_backward_from_sm_90_only():
    def can(card):
        return {c.name: c for c in cards.attention_on(card)}["cudnn_fa4"]

    assert can(RTX5090).applies and can(H100).applies
    assert not can(RTX4090).applies and "sm_90" in can(RTX4090).reason
    names = {c.name for c in cards.attention_on(RTX4090) if c.applies}
    assert {"sdpa", "sdpa_cudnn", "sdpa_flash", "sdpa_efficient"} <= names and "sage" not in names  # no backward


def test_nothing_applies_without_cuda_but_the_plain_pytorch_ones():
    got = choices(CPU)
    assert not got["fp8_matmul"].applies and not got["compile_blocks"].applies and not got["block_swap"].applies
    assert all(not c.applies for c in cards.attention_on(CPU) if c.name.startswith("sdpa_cudnn"))


def test_what_was_verified_where_is_said_plainly():
    assert cards.verified(H100).startswith("verified on H100 / H200")
    for card in (RTX5090, RTX4090):
        line = cards.verified(card)
        assert "chosen by capability" in line and "not run here" in line and "H100 / H200" in line
    line = cards.summary(RTX5090)
    assert line.startswith("kernels on NVIDIA GeForce RTX 5090 (sm_120):") and "fp8_matmul" in line
    assert "not: coalesced_reduce" in line and "chosen by capability" in line
