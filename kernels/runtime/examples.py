"""What the registry's probe runs each kernel's fast op and reference on: tiny, odd, FLUX-like (head_dim 128), nothing
zero. Each `example(device, dtype)` returns the op's arguments, the tensors that take gradients marked so.
"""

from __future__ import annotations

import torch

from flux_kernels.memory import selective_checkpoint as sac
from flux_kernels.ops import reference
from flux_kernels.patches import fp8


def _rand(*shape, device, dtype, gen, scale=1.0, offset=0.0, grad=True) -> torch.Tensor:
    t = (torch.randn(*shape, generator=gen) * scale + offset).to(device, dtype)
    return t.requires_grad_(grad)


def qk_example(device, dtype, B=2, H=3, D=128, lt=3, li=5):
    """Two streams as in the double block, q/k as strided views of a qkv projection output."""
    gen = torch.Generator().manual_seed(0)
    segs = []
    for L in (lt, li):
        qkv = _rand(B, L, 3 * H * D, device=device, dtype=dtype, gen=gen)
        q, k, _ = qkv.unflatten(-1, (3, H, D)).permute(2, 0, 3, 1, 4)
        ws = [_rand(D, device=device, dtype=dtype, gen=gen, scale=0.2, offset=1.0) for _ in range(2)]
        segs.append((q, k, *ws))
    return segs, reference.make_pe(1, lt + li, D, device=device, generator=gen)


def single_qkv_example(device, dtype, B=2, H=3, D=128, L=7, mlp=40):
    """linear1's output of a single block ([B, L, 3 * H * D + mlp]: qkv then the MLP input) as a non-leaf, as the
    block hands it over; the norm scales frozen, as in a LoRA run."""
    gen = torch.Generator().manual_seed(0)
    lin1 = _rand(B, L, 3 * H * D + mlp, device=device, dtype=dtype, gen=gen) * 1.0
    scales = [_rand(D, device=device, dtype=dtype, gen=gen, scale=0.2, offset=1.0, grad=False) for _ in range(2)]
    return lin1, *scales, reference.make_pe(B, L, D, device=device, generator=gen), H, 3 * H * D


def double_qkv_example(device, dtype, B=2, H=3, D=128, lt=3, li=5):
    """The double block's two qkv outputs (txt, img: [B, L, 3 * H * D]) as non-leaves, each with its frozen QKNorm
    scales, and RoPE over both streams' tokens."""
    gen = torch.Generator().manual_seed(0)
    streams = []
    for L in (lt, li):
        qkv = _rand(B, L, 3 * H * D, device=device, dtype=dtype, gen=gen) * 1.0
        streams += [qkv, *(_rand(D, device=device, dtype=dtype, gen=gen, scale=0.2, offset=1.0, grad=False)
                           for _ in range(2))]  # fmt: skip
    return *streams, reference.make_pe(B, lt + li, D, device=device, generator=gen), H


def modulate_example(device, dtype, B=2, L=7, C=96):
    gen = torch.Generator().manual_seed(0)
    x = _rand(B, L, C, device=device, dtype=dtype, gen=gen, scale=2.0, offset=0.5)
    mod = _rand(B, 1, 3 * C, device=device, dtype=dtype, gen=gen, scale=0.5)
    shift, scale, _ = mod.chunk(3, dim=-1)  # strided views, as Modulation returns them
    return x, shift, scale


def gated_example(device, dtype, B=2, L=7, C=96):
    gen = torch.Generator().manual_seed(0)
    x = _rand(B, L, C, device=device, dtype=dtype, gen=gen)
    gate = _rand(B, 1, 2 * C, device=device, dtype=dtype, gen=gen).chunk(2, dim=-1)[1]
    return x, gate, _rand(B, L, C, device=device, dtype=dtype, gen=gen)


def gated_modulate_example(device, dtype, B=2, L=7, C=96):
    gen = torch.Generator().manual_seed(0)
    x = _rand(B, L, C, device=device, dtype=dtype, gen=gen, scale=2.0, offset=0.5)
    y = _rand(B, L, C, device=device, dtype=dtype, gen=gen)
    mod = _rand(B, 1, 6 * C, device=device, dtype=dtype, gen=gen, scale=0.5)
    _, _, gate, shift, scale, _ = mod.chunk(6, dim=-1)  # the double block's mod1.gate, mod2.shift, mod2.scale
    return x, gate, y, shift, scale


def fp8_example(device, dtype, M=5, K=fp8.WIDE_ROWS + 16, N=fp8.WIDE_ROWS + 16):
    """Activations [2, M, K] and a weight quantised per row (exercises the scale folding in backward); rows wider
    than fp8.WIDE_ROWS, so the forward and the input gradient quantise through the Triton row kernel where it runs."""
    gen = torch.Generator().manual_seed(0)
    x = _rand(2, M, K, device=device, dtype=dtype, gen=gen, offset=0.1)
    w8, scale = fp8.quantize_weight(torch.randn(N, K, generator=gen) * 0.05)
    bias = _rand(N, device=device, dtype=dtype, gen=gen, scale=0.1, grad=False)
    return x, w8.to(device), scale.to(device), bias


def lora_norms_example(device, dtype, out=40, inp=72, r=4):
    gen = torch.Generator().manual_seed(0)
    up, down, d_up, d_down = (_rand(*s, device=device, dtype=dtype, gen=gen, grad=False)
                              for s in ((out, r), (r, inp), (out, r), (r, inp)))  # fmt: skip
    return up, down, d_up, d_down, 0.5


def lora_fold_example(device, dtype, M=37, K=24, N=160, r=4):
    """Two LoRA'd Linears on [2, M, K] activations, K -> N -> K: one widening (B folded), one narrowing (A folded),
    as where they are installed."""
    gen = torch.Generator().manual_seed(0)
    x = _rand(2, M, K, device=device, dtype=dtype, gen=gen)
    layers = []
    for n, k, s in ((N, K, 0.75), (K, N, 0.5)):
        w = _rand(n, k, device=device, dtype=dtype, gen=gen, scale=k**-0.5, grad=False)
        bias = _rand(n, device=device, dtype=dtype, gen=gen, scale=0.1, grad=False)
        a = _rand(r, k, device=device, dtype=dtype, gen=gen, scale=k**-0.5)
        b = _rand(n, r, device=device, dtype=dtype, gen=gen, scale=0.3)
        layers += [w, bias, a, b, s]
    return (x, *layers)


def sac_example(device, dtype, L=37, C=64, heads=2):
    """A checkpointed attention + wide-input matmul region (the ops the policy keeps) on [1, L, C] activations."""
    gen = torch.Generator().manual_seed(0)
    x = _rand(1, L, C, device=device, dtype=dtype, gen=gen)
    w_qkv = _rand(3 * C, C, device=device, dtype=dtype, gen=gen, scale=C**-0.5)
    w_up = _rand(sac.RATIO * C, C, device=device, dtype=dtype, gen=gen, scale=C**-0.5)
    w_down = _rand(C, sac.RATIO * C, device=device, dtype=dtype, gen=gen, scale=(sac.RATIO * C) ** -0.5)
    return x, w_qkv, w_up, w_down, heads


def offload_example(device, dtype, L=37, C=64):
    """[2, L, C] activations through two MLP-like regions (what the offload probe's groups save)."""
    gen = torch.Generator().manual_seed(0)
    x = _rand(2, L, C, device=device, dtype=dtype, gen=gen)
    w_up = _rand(4 * C, C, device=device, dtype=dtype, gen=gen, scale=C**-0.5)
    w_down = _rand(C, 4 * C, device=device, dtype=dtype, gen=gen, scale=(4 * C) ** -0.5)
    return x, w_up, w_down


def prologue_example(device, dtype, B=2, L=7):
    """Fractional timesteps in [0, 1) and positions on 3 axes (the model's own axes_dim / theta come at install)."""
    gen = torch.Generator().manual_seed(0)
    t = torch.rand(B, generator=gen).to(device, dtype).requires_grad_()
    ids = (torch.randn(B, L, 3, generator=gen) * 20).to(device, dtype).requires_grad_()
    return t, ids


def chroma_example(device, dtype, H=3, D=128, li=5, lt=4):
    """q, k, v [2, H, li + lt, D] (image tokens first, then text, as Chroma joins them) and which tokens are kept:
    every image token, and of the text all of the first caption's, 2 of the second's (padding in the batch)."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (_rand(2, H, li + lt, D, device=device, dtype=dtype, gen=gen) for _ in range(3))
    txt = torch.arange(lt)[None, :] < torch.tensor([lt, 2])[:, None]
    keep = torch.cat((torch.ones(2, li, dtype=torch.bool), txt), dim=1).to(device)
    return q, k, v, keep
