"""FLOPs count: a tiny config against a per-layer hand count, full-size FLUX.1-dev against GPU.md's numbers."""

import pytest

from flux_trainer.metrics.flops import PEAK_BF16_TFLOPS, flux_step_flops, img_tokens_for, mfu, peak_bf16_tflops


def mm(n: int, k: int, p: int) -> int:
    """FLOPs of an (n x k) @ (k x p) matmul."""
    return 2 * n * k * p


def lora(n: int, d_in: int, d_out: int, r: int) -> int:
    return mm(n, d_in, r) + mm(n, r, d_out)


# Tiny FLUX: hidden 8, mlp 16, 1 double + 1 single block, 4 image + 2 text tokens, LoRA rank 2.
H, M, TI, TT, R = 8, 16, 4, 2, 2
T = TI + TT
TINY = dict(hidden=H, depth=1, depth_single=1, mlp_ratio=2.0, img_tokens=TI, txt_tokens=TT, lora_rank=R)

# Written out layer by layer, independently of the implementation's loops.
# fmt: off
DOUBLE_TOKENS = (
    mm(TI, H, 3 * H) + mm(TI, H, H) + mm(TI, H, M) + mm(TI, M, H)  # img: qkv, proj, mlp.0, mlp.2
    + mm(TT, H, 3 * H) + mm(TT, H, H) + mm(TT, H, M) + mm(TT, M, H)  # txt: the same
)
DOUBLE_MOD = mm(1, H, 6 * H) + mm(1, H, 6 * H)  # img_mod.lin, txt_mod.lin on the vector
SINGLE_TOKENS = mm(T, H, 3 * H + M) + mm(T, H + M, H)  # linear1, linear2
SINGLE_MOD = mm(1, H, 3 * H)
ATTENTION = 2 * (mm(T, H, T) + mm(T, T, H))  # QK^T and AV, two blocks
LORA = (
    lora(TI, H, 3 * H, R) + lora(TI, H, H, R) + lora(TI, H, M, R) + lora(TI, M, H, R)
    + lora(TT, H, 3 * H, R) + lora(TT, H, H, R) + lora(TT, H, M, R) + lora(TT, M, H, R)
    + lora(1, H, 6 * H, R) * 2
    + lora(T, H, 3 * H + M, R) + lora(T, H + M, H, R) + lora(1, H, 3 * H, R)
)
# fmt: on
EMBEDDERS = (mm(1, 256, H) + mm(1, H, H)) * 2 + mm(1, 768, H) + mm(1, H, H)  # time, guidance, vector
FINAL_TOKENS = mm(TI, H, 64)
IN_OUT = EMBEDDERS + mm(TI, 64, H) + mm(TT, 4096, H) + FINAL_TOKENS + mm(1, H, 2 * H)


def test_tiny_config_matches_hand_count():
    f = flux_step_flops(**TINY)
    assert (DOUBLE_TOKENS, SINGLE_TOKENS, ATTENTION, LORA) == (4096 + 2048, 3840 + 2304, 2304, 4800)  # the arithmetic
    forward = DOUBLE_TOKENS + DOUBLE_MOD + SINGLE_TOKENS + SINGLE_MOD + ATTENTION + LORA + IN_OUT
    backward = DOUBLE_TOKENS + SINGLE_TOKENS + FINAL_TOKENS + 2.5 * ATTENTION + 2 * LORA
    assert f.forward == forward
    assert f.backward == backward
    assert f.recompute == 0
    assert f.total == forward + backward
    assert f.parts == {
        "linear": DOUBLE_TOKENS + DOUBLE_MOD + SINGLE_TOKENS + SINGLE_MOD,
        "attention": ATTENTION,
        "lora": LORA,
        "in_out": IN_OUT,
    }


def test_tiny_checkpointing_batch_and_options():
    recompute = DOUBLE_TOKENS + DOUBLE_MOD + SINGLE_TOKENS + SINGLE_MOD + ATTENTION + LORA + EMBEDDERS
    f1 = flux_step_flops(**TINY, gradient_checkpointing=True)
    assert f1.recompute == recompute
    assert f1.total == f1.forward + f1.backward + recompute
    f3 = flux_step_flops(**TINY, gradient_checkpointing=True, batch=3)
    assert (f3.forward, f3.backward, f3.recompute) == (3 * f1.forward, 3 * f1.backward, 3 * f1.recompute)
    no_lora = flux_step_flops(**{**TINY, "lora_rank": 0})
    assert f1.forward - no_lora.forward == LORA
    no_guidance = flux_step_flops(**TINY, guidance_embed=False)
    assert f1.forward - no_guidance.forward == mm(1, 256, H) + mm(1, H, H)
    bwd2 = flux_step_flops(**TINY, attention_backward_factor=2.0)
    assert f1.backward - bwd2.backward == 0.5 * ATTENTION


def test_flux_dev_1024_matches_gpu_md():
    """GPU.md: forward ~74 (linear 59.5, attention 14.9), step ~171, with checkpointing ~245 TFLOP."""
    tokens = img_tokens_for(1024, 1024)
    f = flux_step_flops(img_tokens=tokens, txt_tokens=512)
    assert tokens == 4096
    assert f.parts["linear"] / 1e12 == pytest.approx(59.5, abs=0.05)
    assert f.parts["attention"] / 1e12 == pytest.approx(14.9, abs=0.05)
    assert f.forward / 1e12 == pytest.approx(74.8, abs=0.05)  # + LoRA 0.38, in/out 0.02
    assert f.total / 1e12 == pytest.approx(172.2, abs=0.05)
    ckpt = flux_step_flops(gradient_checkpointing=True)
    assert ckpt.total / 1e12 == pytest.approx(246.9, abs=0.05)
    frozen = flux_step_flops(lora_rank=0)  # GPU.md's count has no adapters
    assert frozen.total / 1e12 == pytest.approx(171.1, abs=0.05)
    assert flux_step_flops(lora_rank=0, gradient_checkpointing=True).total / 1e12 == pytest.approx(245.4, abs=0.05)
    # Floors at the measured 790 TFLOP/s: 0.22 s and 0.31 s per step.
    assert frozen.total / 790e12 == pytest.approx(0.22, abs=0.005)


def test_img_tokens_for():
    assert img_tokens_for(512, 512) == 1024
    assert img_tokens_for(768, 1344) == 48 * 84
    for bad in [(1000, 1024), (0, 512), (-16, 512)]:
        with pytest.raises(ValueError, match="multiples of 16"):
            img_tokens_for(*bad)


def test_peak_table_and_mfu():
    assert peak_bf16_tflops("NVIDIA H200") == 790.0
    assert peak_bf16_tflops("NVIDIA H200", prefer_measured=False) == 989.0
    assert peak_bf16_tflops("NVIDIA H100 PCIe") == 756.0  # the longer key wins over "H100"
    assert peak_bf16_tflops("NVIDIA H100 80GB HBM3") == 989.0
    assert peak_bf16_tflops("NVIDIA GeForce RTX 4090") == 165.2
    assert peak_bf16_tflops("NVIDIA GeForce RTX 5090") == 209.5
    assert peak_bf16_tflops("NVIDIA A100-SXM4-80GB") == 312.0
    assert peak_bf16_tflops("NVIDIA L40S") == 362.0
    assert peak_bf16_tflops("Tesla T4") is None
    assert all(p.source and p.spec > 0 for p in PEAK_BF16_TFLOPS.values())
    assert mfu(250.0, 790.0) == pytest.approx(0.3165, abs=1e-4)
    with pytest.raises(ValueError):
        mfu(1.0, 0.0)
