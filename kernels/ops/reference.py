"""Plain-PyTorch references: the same operations, in the same order and dtypes, as sd-scripts' FLUX model
(`library/flux_models.py` at the pinned commit), so that on the reference path a patched block computes
bit for bit what sd-scripts computes. They are the fallback on every device and the tests' ground truth.

Shapes as in FLUX: q, k, v are [B, H, L, D] (head_dim D = 128), `pe` is [B or 1, 1, L, D/2, 2, 2] fp32 rotation
matrices from `EmbedND`, hidden states are [B, L, C] (C = 3072) and modulation vectors [B, 1, C].
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

EPS = 1e-6  # sd-scripts hard-codes 1e-6 in RMSNorm and passes eps=1e-6 to every LayerNorm of the blocks


def heads(qkv: Tensor, num_heads: int) -> tuple[Tensor, Tensor, Tensor]:
    """sd-scripts' einops `rearrange(qkv, "B L (K H D) -> K B H L D", K=3)`, as views: q, k, v."""
    q, k, v = qkv.unflatten(-1, (3, num_heads, -1)).permute(2, 0, 3, 1, 4)
    return q, k, v


def rms_norm(x: Tensor, scale: Tensor, eps: float = EPS) -> Tensor:
    """sd-scripts `RMSNorm.forward`: fp32 inside, scale applied in fp32, one rounding back to x's dtype."""
    x_dtype = x.dtype
    x = x.float()
    rrms = torch.rsqrt(torch.mean(x**2, dim=-1, keepdim=True) + eps)
    return ((x * rrms) * scale.float()).to(dtype=x_dtype)


def apply_rope(xq: Tensor, xk: Tensor, freqs_cis: Tensor) -> tuple[Tensor, Tensor]:
    """sd-scripts `apply_rope`: each pair (x[2i], x[2i+1]) times the 2x2 matrix freqs_cis[..., i, :, :] in fp32."""
    xq_ = xq.float().reshape(*xq.shape[:-1], -1, 1, 2)
    xk_ = xk.float().reshape(*xk.shape[:-1], -1, 1, 2)
    xq_out = freqs_cis[..., 0] * xq_[..., 0] + freqs_cis[..., 1] * xq_[..., 1]
    xk_out = freqs_cis[..., 0] * xk_[..., 0] + freqs_cis[..., 1] * xk_[..., 1]
    return xq_out.reshape(*xq.shape).type_as(xq), xk_out.reshape(*xk.shape).type_as(xk)


def qk_norm_rope(q: Tensor, k: Tensor, q_scale: Tensor, k_scale: Tensor, pe: Tensor, eps: float = EPS):
    """`QKNorm` (RMSNorm of q and of k, each rounded to the input dtype) then `apply_rope`, as the single-stream
    block and `attention()` do it. q and k come from one qkv tensor, so `.to(v)` in QKNorm is a no-op here."""
    return apply_rope(rms_norm(q, q_scale, eps), rms_norm(k, k_scale, eps), pe)


def qk_norm_rope_cat(segments: Sequence[tuple[Tensor, Tensor, Tensor, Tensor]], pe: Tensor, eps: float = EPS):
    """The double-stream block: each stream (q, k, q_scale, k_scale) normalised with its own QKNorm, the streams
    concatenated along L (txt first), then one `apply_rope` over the whole sequence."""
    qs, ks = [], []
    for q, k, q_scale, k_scale in segments:
        qs.append(rms_norm(q, q_scale, eps))
        ks.append(rms_norm(k, k_scale, eps))
    q = qs[0] if len(qs) == 1 else torch.cat(qs, dim=2)
    k = ks[0] if len(ks) == 1 else torch.cat(ks, dim=2)
    return apply_rope(q, k, pe)


def modulate(x: Tensor, shift: Tensor, scale: Tensor, eps: float = EPS) -> Tensor:
    """`nn.LayerNorm(C, elementwise_affine=False, eps)` then `(1 + scale) * x + shift`, as the blocks write it
    (F.layer_norm is exactly what that LayerNorm module calls)."""
    return (1 + scale) * F.layer_norm(x, (x.shape[-1],), eps=eps) + shift


def gated_residual(x: Tensor, gate: Tensor, y: Tensor) -> Tensor:
    """The blocks' residual update `x + gate * y`."""
    return x + gate * y


def gated_modulate(
    x: Tensor, gate: Tensor, y: Tensor, shift: Tensor, scale: Tensor, eps: float = EPS
) -> tuple[Tensor, Tensor]:
    """The double block's residual update followed by the modulated LayerNorm of its result, as sd-scripts writes
    `img = img + img_mod1.gate * proj(...)` then `(1 + img_mod2.scale) * self.img_norm2(img) + img_mod2.shift`.
    Returns (updated residual, modulated input of the MLP)."""
    res = gated_residual(x, gate, y)
    return res, modulate(res, shift, scale, eps)


def attention(q: Tensor, k: Tensor, v: Tensor, pe: Tensor, attn_mask: Tensor | None = None) -> Tensor:
    """sd-scripts `attention`: RoPE, PyTorch SDPA (its own backend choice), then "B H L D -> B L (H D)"."""
    q, k = apply_rope(q, k, pe)
    x = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
    return x.transpose(1, 2).flatten(2)


def rope(pos: Tensor, dim: int, theta: int) -> Tensor:
    """sd-scripts `rope`: [..., n] positions -> [..., n, dim/2, 2, 2] fp32 rotation matrices (computed in fp64).
    Here to build realistic `pe` in tests and probes without importing sd-scripts."""
    assert dim % 2 == 0
    scale = torch.arange(0, dim, 2, dtype=torch.float64, device=pos.device) / dim
    omega = 1.0 / (theta**scale)
    out = torch.einsum("...n,d->...nd", pos.to(torch.float64), omega)
    out = torch.stack([torch.cos(out), -torch.sin(out), torch.sin(out), torch.cos(out)], dim=-1)
    return out.unflatten(-1, (2, 2)).float()


def make_pe(batch: int, length: int, head_dim: int, device=None, theta: int = 10_000, generator=None) -> Tensor:
    """A `pe` shaped like EmbedND's output, [batch, 1, length, head_dim/2, 2, 2], from random positions."""
    pos = torch.rand(batch, length, generator=generator, device="cpu") * 64
    return rope(pos, head_dim, theta).unsqueeze(1).to(device)


def max_rel_err(got: Tensor, want: Tensor) -> float:
    """max |got - want| / max |want|, in float32: how the fast ops are compared with their references."""
    return ((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-12)).item()


def rel_l2_err(got: Tensor, want: Tensor) -> float:
    """|got - want| / |want| over the whole tensor, in float64: a GEMM's error, where `max_rel_err` would be
    decided by one element."""
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


def saved_tensors(fn, args, also_skip=()) -> list[torch.Tensor]:
    """The tensors one forward of `fn(*args)` keeps for backward, as saved_tensors_hooks see them (compiled code saves
    through them too); the inputs (nested ones included), `fn`'s parameters (a module's) and `also_skip` (e.g. a
    frozen weight a closure holds) left out, by storage."""
    from torch.utils._pytree import tree_flatten

    params = fn.parameters() if isinstance(fn, torch.nn.Module) else ()
    inputs = [t for t in tree_flatten(args)[0] if torch.is_tensor(t)]
    skip = {t.untyped_storage().data_ptr() for t in (*params, *inputs, *also_skip)}
    saved: list[torch.Tensor] = []

    def pack(t):
        if t.untyped_storage().data_ptr() not in skip:
            saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args)
    return saved


def saved_bytes(fn, args, also_skip=()) -> int:
    """Bytes one forward of `fn(*args)` keeps for backward: the distinct storages of `saved_tensors`. How kernels
    are compared on memory."""
    storages = {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in saved_tensors(fn, args, also_skip)
    }
    return sum(storages.values())


def optimizer_probe(build, install, device, steps: int) -> tuple[float, list]:
    """An optimizer step's install probe: the same tiny random float32 problem (three tensors and an all-zero one,
    gradients pulling towards random targets, with noise) stepped `steps` times by `build(params)` as it is and
    by another one with `install` applied, on `device`. Returns the worst relative difference of the parameters
    after the steps, and the two optimizers (plain, installed)."""
    gen = torch.Generator().manual_seed(0)
    shapes = [(24, 40), (40, 24), (7,)]
    start = [torch.randn(*s, generator=gen) * 0.1 for s in shapes] + [torch.zeros(40, 24)]
    targets = [torch.randn(t.shape, generator=gen).to(device) for t in start]
    runs, optimizers = [], []
    for installed in (False, True):
        params = [torch.nn.Parameter(t.clone().to(device)) for t in start]
        opt = build(params)
        if installed:
            install(opt)
        noise = torch.Generator().manual_seed(1)
        for _ in range(steps):
            for p, t in zip(params, targets, strict=True):
                p.grad = (p.detach() - t) + (torch.randn(p.shape, generator=noise) * 1e-2).to(device)
            opt.step()
        runs.append(params)
        optimizers.append(opt)
    return max(max_rel_err(b, a) for a, b in zip(*runs, strict=True)), optimizers
