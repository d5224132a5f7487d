"""`flux-train doctor --speed`: is this card as fast as it should be?

Two measurements, each against what the card is known to deliver (`flux_trainer.metrics.flops.PEAK_BF16_TFLOPS`,
the measured rate where there is one, else the datasheet's):

* a bf16 matmul of 8192^3, CUDA events, median of 10: the card's raw tensor-core rate;
* one FLUX single-stream block (hidden 3072, 24 heads, 4096 image + 512 text tokens, frozen bf16 weights, input
  gradient as in LoRA training) forward + backward: what a training step is made of (big linears, attention,
  norms, GELU). Its FLOPs are counted with `flux_step_flops` (one single block, no LoRA).

Either below half of what is expected is a warning. What it catches: a throttled or power-capped card, a slow
attention path, a debug environment (CUDA_LAUNCH_BLOCKING), a card shared with another process. A card missing
from the peak table is measured and reported without a verdict.
"""

from __future__ import annotations

from flux_trainer.doctor.core import PASS, SKIP, WARN, CheckResult, one_line
from flux_trainer.launch.device import DeviceInfo
from flux_trainer.metrics.flops import flux_step_flops, peak_bf16_tflops

GROUP = "speed"
MATMUL_N = 8192
# An eager FLUX block at 1024^2 is large matmuls plus attention plus memory-bound elementwise work; half of the
# card's matmul rate is what it should reach (the whole sd-scripts step reaches ~1/3 of it, GPU.md).
BLOCK_EFFICIENCY = 0.5
WARN_BELOW = 0.5  # warn when a measurement is under this fraction of what is expected


def _time_ms(fn, warmup: int, reps: int) -> float:
    """Median milliseconds of `fn` with CUDA events (the GPU's own clock: no host-side launch overhead)."""
    import torch

    from flux_kernels.runtime.timing import median_ms

    return median_ms(fn, torch.device("cuda"), warmup, reps)


def verdict(check: str, measured: float, expected: float | None, what: str, data: dict) -> CheckResult:
    """pass / warn against the expected TFLOP/s; no verdict (pass, said so) for a card without a reference."""
    data = {**data, "tflops": round(measured, 1), "expected_tflops": expected}
    if expected is None:
        return CheckResult(check, PASS, f"{what}: {measured:.0f} TFLOP/s (no reference for this card)", "", GROUP, data)
    ratio = measured / expected
    data["fraction_of_expected"] = round(ratio, 3)
    text = f"{what}: {measured:.0f} TFLOP/s, {ratio:.0%} of the {expected:.0f} expected"
    if ratio < WARN_BELOW:
        return CheckResult(
            check,
            WARN,
            text,
            "check `nvidia-smi -q -d PERFORMANCE,POWER,CLOCK` (throttling, power cap), other processes on the GPU, "
            "CUDA_LAUNCH_BLOCKING",
            GROUP,
            data,
        )
    return CheckResult(check, PASS, text, "", GROUP, data)


def matmul_speed(info: DeviceInfo, n: int = MATMUL_N, reps: int = 10, device=None, timer=None) -> CheckResult:
    """bf16 n^3 matmul TFLOP/s against the card's peak. `device` and `timer(fn, warmup, reps) -> ms` are for tests."""
    import torch

    dev = torch.device("cuda", info.index) if device is None else torch.device(device)
    timer = timer or _time_ms

    def measure() -> float:
        a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
        b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
        return timer(lambda: a @ b, 3, reps)

    try:
        ms = measure()
    except Exception as e:  # noqa: BLE001 - out of memory on a busy card, a broken build: reported, not raised
        return CheckResult("bf16 matmul speed", WARN, f"could not measure: {one_line(e)}", "free the GPU", GROUP)
    finally:
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    tflops = 2.0 * n**3 / (ms * 1e-3) / 1e12
    return verdict(
        "bf16 matmul speed", tflops, peak_bf16_tflops(info.name), f"{n}^3 bf16 in {ms:.2f} ms", {"ms": round(ms, 3)}
    )


class FluxSingleBlock:
    """sd-scripts' `SingleStreamBlock` math in plain PyTorch (modulation, LayerNorm, fused qkv+mlp linear, QK
    RMSNorm, RoPE, SDPA, tanh-GELU, output linear, gated residual), weights as plain tensors. Built here so the
    speed check needs no sd-scripts checkout and measures the card, not a code path."""

    def __init__(self, hidden: int, heads: int, device, dtype, seed: int = 0):
        import torch

        self.hidden, self.heads, self.mlp = hidden, heads, 4 * hidden
        gen = torch.Generator().manual_seed(seed)

        def w(*shape, scale=0.02):
            return (torch.randn(*shape, generator=gen) * scale).to(device, dtype)

        self.w_mod, self.b_mod = w(3 * hidden, hidden), w(3 * hidden)
        self.w1, self.b1 = w(3 * hidden + self.mlp, hidden), w(3 * hidden + self.mlp)
        self.w2, self.b2 = w(hidden, hidden + self.mlp), w(hidden)
        head_dim = hidden // heads
        self.q_scale = 1 + w(head_dim, scale=0.1)
        self.k_scale = 1 + w(head_dim, scale=0.1)

    def rope(self, tokens: int, device, dtype):
        import torch

        d = self.hidden // self.heads
        pos = torch.arange(tokens, device=device, dtype=torch.float32)[:, None]
        freqs = pos / 10000 ** (torch.arange(0, d, 2, device=device, dtype=torch.float32) / d)
        return freqs.cos().to(dtype), freqs.sin().to(dtype)

    def __call__(self, x, vec, cos, sin):
        import torch
        import torch.nn.functional as F

        B, L, h = x.shape
        shift, scale, gate = F.linear(F.silu(vec), self.w_mod, self.b_mod)[:, None, :].chunk(3, dim=-1)
        x_mod = (1 + scale) * F.layer_norm(x, (h,), eps=1e-6) + shift
        qkv, mlp = torch.split(F.linear(x_mod, self.w1, self.b1), [3 * h, self.mlp], dim=-1)
        q, k, v = qkv.view(B, L, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        q = F.rms_norm(q.float(), (q.shape[-1],), eps=1e-6).to(x.dtype) * self.q_scale
        k = F.rms_norm(k.float(), (k.shape[-1],), eps=1e-6).to(x.dtype) * self.k_scale

        def rot(t):
            t1, t2 = t[..., 0::2], t[..., 1::2]
            return torch.stack((t1 * cos - t2 * sin, t1 * sin + t2 * cos), dim=-1).flatten(-2)

        attn = F.scaled_dot_product_attention(rot(q), rot(k), v).transpose(1, 2).reshape(B, L, h)
        out = F.linear(torch.cat((attn, F.gelu(mlp, approximate="tanh")), dim=-1), self.w2, self.b2)
        return x + gate * out


def block_step_flops(hidden: int, heads: int, img_tokens: int, txt_tokens: int) -> float:
    """FLOPs of one single block forward + backward with frozen weights (input gradient only), from the same
    count as the training-step metric: linears 1x forward again, attention 2.5x."""
    f = flux_step_flops(
        hidden=hidden,
        depth=0,
        depth_single=1,
        img_tokens=img_tokens,
        txt_tokens=txt_tokens,
        lora_rank=0,
        guidance_embed=False,
    )
    return 2.0 * f.parts["linear"] + 3.5 * f.parts["attention"]


def block_step(hidden: int, heads: int, tokens: int, device, dtype, batch: int = 1):
    """A callable running one forward + backward of `FluxSingleBlock` on fixed random inputs (also used by tests
    on the CPU at a tiny size); returns (step, block, x)."""
    import torch

    block = FluxSingleBlock(hidden, heads, device, dtype)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(batch, tokens, hidden, generator=gen).to(device, dtype).requires_grad_()
    vec = torch.randn(batch, hidden, generator=gen).to(device, dtype)
    grad = torch.randn(batch, tokens, hidden, generator=gen).to(device, dtype)
    cos, sin = block.rope(tokens, device, dtype)

    def step():
        out = block(x, vec, cos, sin)
        (dx,) = torch.autograd.grad(out, x, grad)
        return out, dx

    return step, block, x


def block_speed(
    info: DeviceInfo,
    hidden: int = 3072,
    heads: int = 24,
    reps: int = 10,
    tokens: tuple[int, int] | None = None,
    device=None,
    timer=None,
) -> CheckResult:
    """One FLUX single block at 1024^2 (512^2 on cards under 20 GiB), forward + backward, against
    BLOCK_EFFICIENCY x the card's peak. `tokens` (image, text), `device` and `timer` are for tests."""
    import torch

    img, txt = tokens or ((4096, 512) if info.vram_gib >= 20 else (1024, 512))
    dev = torch.device("cuda", info.index) if device is None else torch.device(device)
    timer = timer or _time_ms

    def measure() -> float:
        step, _, _ = block_step(hidden, heads, txt + img, dev, torch.bfloat16)
        return timer(step, 3, reps)

    try:
        ms = measure()
    except Exception as e:  # noqa: BLE001
        return CheckResult("flux block speed", WARN, f"could not measure: {one_line(e)}", "free the GPU", GROUP)
    finally:
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    flops = block_step_flops(hidden, heads, img, txt)
    peak = peak_bf16_tflops(info.name)
    expected = peak * BLOCK_EFFICIENCY if peak is not None else None
    what = f"single block fwd+bwd, {img}+{txt} tokens, {flops / 1e12:.2f} TFLOP in {ms:.2f} ms"
    data = {"ms": round(ms, 3), "tflop_per_step": round(flops / 1e12, 3), "tokens": [img, txt]}
    return verdict("flux block speed", flops / (ms * 1e-3) / 1e12, expected, what, data)


def speed_checks(info: DeviceInfo) -> list[CheckResult]:
    if not info.is_gpu:
        return [CheckResult("speed", SKIP, "no CUDA GPU: nothing to measure", "", GROUP)]
    import torch

    if not torch.cuda.is_available():
        return [CheckResult("speed", SKIP, "CUDA is not available in this process", "", GROUP)]
    return [matmul_speed(info), block_speed(info)]
