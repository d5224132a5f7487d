"""FLOPs of one FLUX.1 LoRA training step, and what fraction of the GPU's peak that is (MFU).

Why count by hand: s/step alone does not say whether a run is slow because the GPU is slow or because the step
wastes it. TFLOP/s against a known peak does. The count follows sd-scripts' FLUX model (``library/flux_models.py``)
and its LoRA (``networks/lora_flux.py``, default: every ``nn.Linear`` inside the double and single blocks).

Notation: h = hidden size, m = mlp_ratio * h, T = img + txt tokens per sample, b = batch, r = LoRA rank.
A matmul of an (n x k) by a (k x p) matrix costs 2*n*k*p FLOPs. Elementwise work (norms, RoPE, GELU, modulation,
residuals) is memory-bound and left out; so are the loss and the optimizer (LoRA parameters only).

Forward, per sample:

* double block (19 in FLUX.1), for each stream separately (img with T_img tokens, txt with T_txt):
  qkv 2*T*h*3h + proj 2*T*h*h + mlp in 2*T*h*m + mlp out 2*T*m*h  (= 24*T*h^2 at m = 4h);
  modulation on the vector, once per sample per stream: 2*h*6h.
* single block (38), over the joint sequence: linear1 (qkv + mlp in) 2*T*h*(3h+m), linear2 2*T*(h+m)*h
  (= 24*T*h^2 at m = 4h); modulation 2*h*3h.
* attention, every block, over the joint img+txt sequence: QK^T 2*T^2*h + AV 2*T^2*h = 4*T^2*h.
* in/out: img_in 2*T_img*64*h, txt_in 2*T_txt*4096*h, final linear 2*T_img*h*64, final adaLN 2*h*2h,
  time/vector/guidance embedders (256 -> h -> h, 768 -> h -> h) once per sample.
* LoRA on each adapted linear (in -> out, rank r): down 2*T*in*r + up 2*T*r*out = 2*T*(in+out)*r
  (T = 1 for the modulation linears, which act on the vector).

Backward:

* frozen base linears on tokens (inside the blocks, and the final linear): only the input gradient
  (dX = dY W^T) is needed, no weight gradient: 1x forward. Frozen linears whose input needs no gradient cost
  nothing: img_in/txt_in (latents, cached text embeddings), the embedders, and the modulation / final adaLN
  linears on the vector (built from those embedders). Their LoRA adapters still get weight gradients.
* LoRA linears: input gradient and weight gradient: 2x forward.
* attention: 2.5x forward. FlashAttention-style kernels (SDPA flash / cuDNN, which sd-scripts' ``--sdpa`` gets)
  recompute QK^T and then do dV, dP, dQ, dK: 5 matmuls of the forward's size against 2.
* gradient checkpointing (sd-scripts: every block plus the embedders) recomputes one forward of those; the
  in/out linears are not checkpointed and are not recomputed.

At FLUX.1-dev, 1024x1024, batch 1, rank 16 this gives forward 74.8 TFLOP (block linears 59.5, attention 14.9,
LoRA 0.38, in/out 0.02), a step without checkpointing 172.2 and with checkpointing 246.9 TFLOP. GPU.md's
74.4 / 171 / 245 are the same count without the LoRA terms (``lora_rank=0`` gives 74.4 / 171.1 / 245.4): the
adapters add 0.4 / 1.1 / 1.5 TFLOP, under 1%.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# FLUX.1 fixed widths (flux_models.configs["dev"]): packed latent channels, T5 width, CLIP pooled width, timestep
# embedding width. They only enter the small in/out terms.
LATENT_CHANNELS = 64
T5_DIM = 4096
CLIP_DIM = 768
TIME_EMBED_DIM = 256


@dataclass(frozen=True)
class StepFlops:
    """FLOPs of one training step (all samples of the batch). ``parts`` is the forward split by kind."""

    forward: float
    backward: float
    recompute: float
    total: float
    parts: dict[str, float] = field(default_factory=dict)


def img_tokens_for(resolution_h: int, resolution_w: int) -> int:
    """Image tokens for a pixel resolution: the VAE downsamples by 8, then FLUX packs 2x2 latent patches."""
    if resolution_h <= 0 or resolution_w <= 0 or resolution_h % 16 or resolution_w % 16:
        raise ValueError(
            f"resolution {resolution_h}x{resolution_w}: FLUX needs positive multiples of 16 (8x VAE, then 2x2 "
            "patches); sd-scripts' buckets use multiples of 64"
        )
    return (resolution_h // 16) * (resolution_w // 16)


def _lin(tokens: float, d_in: float, d_out: float) -> float:
    return 2.0 * tokens * d_in * d_out


def _lora(tokens: float, d_in: float, d_out: float, rank: int) -> float:
    return 2.0 * tokens * (d_in + d_out) * rank


def flux_step_flops(
    hidden: int = 3072,
    depth: int = 19,
    depth_single: int = 38,
    mlp_ratio: float = 4.0,
    img_tokens: int = 4096,
    txt_tokens: int = 512,
    batch: int = 1,
    lora_rank: int = 16,
    gradient_checkpointing: bool = False,
    guidance_embed: bool = True,
    attention_backward_factor: float = 2.5,
) -> StepFlops:
    """Count the FLOPs of one FLUX LoRA training step (formula in the module docstring).

    ``lora_rank=0`` counts a step with no adapters (useful to compare with the frozen-model numbers).
    """
    h, m, r = float(hidden), float(int(hidden * mlp_ratio)), lora_rank
    ti, tt = float(img_tokens), float(txt_tokens)
    t = ti + tt

    # Linears of one stream of a double block, and of a single block: (in, out) per adapted linear.
    double_linears = [(h, 3 * h), (h, h), (h, m), (m, h)]
    single_linears = [(h, 3 * h + m), (h + m, h)]
    double_mod, single_mod = (h, 6 * h), (h, 3 * h)

    # Token linears (activations need their input gradient) apart from the modulation linears on the vector
    # (whose input, built from frozen embedders of inputs without gradient, needs none).
    block_tokens = depth * sum(_lin(ti, i, o) + _lin(tt, i, o) for i, o in double_linears)
    block_tokens += depth_single * sum(_lin(t, i, o) for i, o in single_linears)
    block_mod = depth * 2 * _lin(1, *double_mod) + depth_single * _lin(1, *single_mod)
    block_linear = block_tokens + block_mod

    attention = (depth + depth_single) * 4.0 * t * t * h

    lora = 0.0
    if r > 0:
        double_lora = sum(_lora(ti, i, o, r) + _lora(tt, i, o, r) for i, o in double_linears)
        double_lora += 2 * _lora(1, *double_mod, r)
        single_lora = sum(_lora(t, i, o, r) for i, o in single_linears) + _lora(1, *single_mod, r)
        lora = depth * double_lora + depth_single * single_lora

    embedders = _lin(1, TIME_EMBED_DIM, h) + _lin(1, h, h) + _lin(1, CLIP_DIM, h) + _lin(1, h, h)
    if guidance_embed:
        embedders += _lin(1, TIME_EMBED_DIM, h) + _lin(1, h, h)
    img_in, txt_in = _lin(ti, LATENT_CHANNELS, h), _lin(tt, T5_DIM, h)
    final_tokens = _lin(ti, h, LATENT_CHANNELS)
    in_out = embedders + img_in + txt_in + final_tokens + _lin(1, h, 2 * h)

    b = float(batch)
    forward = b * (block_linear + attention + lora + in_out)
    # Input gradients of frozen token linears (1x); the vector-side and input-side linears need none.
    backward = b * (block_tokens + final_tokens + attention_backward_factor * attention + 2.0 * lora)
    recompute = b * (block_linear + attention + lora + embedders) if gradient_checkpointing else 0.0
    parts = {"linear": b * block_linear, "attention": b * attention, "lora": b * lora, "in_out": b * in_out}
    return StepFlops(forward, backward, recompute, forward + backward + recompute, parts)


@dataclass(frozen=True)
class PeakTflops:
    """Dense bf16 tensor-core peak of one GPU (FP32 accumulate, no sparsity), in TFLOP/s.

    ``spec`` is the vendor's number; ``measured`` is a large bf16 matmul timed on a real card, when we have one.
    MFU against ``measured`` says how much of what the card really delivers a step uses; against ``spec`` it is
    comparable with published MFU figures. Keep them apart.
    """

    spec: float
    measured: float | None
    source: str


# Matched as substrings of torch.cuda.get_device_name(), longest key first ("H100 PCIe" before "H100").
PEAK_BF16_TFLOPS: dict[str, PeakTflops] = {
    "H200": PeakTflops(989.0, 790.0, "NVIDIA H200 datasheet (1,979 with sparsity); measured: GPU.md, lent H200"),
    "H100 PCIe": PeakTflops(756.0, None, "NVIDIA H100 datasheet, PCIe (1,513 with sparsity)"),
    "H100": PeakTflops(989.0, None, "NVIDIA H100 datasheet, SXM (1,979 with sparsity)"),
    "A100": PeakTflops(312.0, None, "NVIDIA A100 datasheet (624 with sparsity)"),
    "L40S": PeakTflops(362.0, None, "NVIDIA L40S datasheet, 362.05 (733 with sparsity)"),
    "RTX 4090": PeakTflops(165.2, None, "NVIDIA Ada whitepaper, BF16 with FP32 accumulate (330.3 with sparsity)"),
    "RTX 5090": PeakTflops(209.5, None, "NVIDIA Blackwell RTX whitepaper, BF16 with FP32 accumulate"),
}


def peak_bf16_tflops(gpu_name: str, prefer_measured: bool = True) -> float | None:
    """Peak TFLOP/s for a device name, or None for a card not in the table (then MFU is not logged)."""
    for key in sorted(PEAK_BF16_TFLOPS, key=len, reverse=True):
        if key.lower() in gpu_name.lower():
            peak = PEAK_BF16_TFLOPS[key]
            return peak.measured if prefer_measured and peak.measured is not None else peak.spec
    return None


def mfu(tflops_per_s: float, peak: float) -> float:
    """Model FLOPs utilisation as a fraction (0.32, not 32): achieved TFLOP/s over peak TFLOP/s."""
    if peak <= 0:
        raise ValueError(f"peak TFLOP/s must be positive, got {peak}")
    return tflops_per_s / peak
