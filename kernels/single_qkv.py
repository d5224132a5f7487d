"""The single-stream block's attention inputs and MLP activation, with a backward written out for inductor.

A FLUX single block splits `linear1`'s output into qkv and the MLP input, normalises q and k (QKNorm: RMSNorm in
fp32, rounded back), rotates them (RoPE, fp32, rounded back) and applies GELU (tanh) to the MLP input. Inside a
compiled block, the backward autograd derives for those ops costs three passes over the whole linear1 gradient on
the H200 (1024², 4608 x 21504): a reduction that materialises the rotated gradients in fp32, a pass that writes
q/k/v's gradients into a [3, B, H, L, D] buffer, and a pass that permutes that buffer into linear1's layout beside
the GELU backward (80 + 164 + 209 us per block, 38 blocks a step).

`single_qkv` computes the same forward, op for op (bit-identical), as one autograd function whose backward is the
algebra written out: RoPE's transpose, RMSNorm's gradient as `r * (g - xn * mean(g * xn))`, GELU's backward, and
one `cat` of the four parts in linear1's own layout. Inductor then writes every part straight into its slice of the
linear1 gradient. In a full-size compiled single block (bf16 matmuls) the Triton time of forward + backward
went from 635 to 497 us (s25c). Gradients agree with autograd's to fp32 rounding (in bf16: identical on small
inputs, ~2e-3 relative at full size, where the fp32 sums are ordered differently).

Used by `flux_kernels.patch` in the single blocks when the `single_qkv` switch is on and the block is what it
expects (GELU tanh, frozen norm scales); otherwise the block runs sd-scripts' ops.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from flux_kernels import reference

EPS = reference.EPS


def reference_single_qkv(lin1: Tensor, q_scale: Tensor, k_scale: Tensor, pe: Tensor, num_heads: int, width: int):
    """sd-scripts' single block from linear1's output: (q, k, v, GELU(mlp)), q and k normalised and rotated."""
    qkv, mlp = torch.split(lin1, [width, lin1.shape[-1] - width], dim=-1)
    q, k, v = reference.heads(qkv, num_heads)
    q, k = reference.qk_norm_rope(q, k, q_scale, k_scale, pe)
    return q, k, v, F.gelu(mlp, approximate="tanh")


def _rope_backward(d: Tensor, pe: Tensor) -> Tensor:
    """`reference.apply_rope`'s gradient: each pair's gradient times the transposed 2x2 matrix, in fp32."""
    pairs = d.float().reshape(*d.shape[:-1], -1, 2, 1)
    return (pe[..., 0, :] * pairs[..., 0, :] + pe[..., 1, :] * pairs[..., 1, :]).reshape(d.shape)


def _rms_norm_backward(d_out: Tensor, x: Tensor, rrms: Tensor, scale: Tensor) -> Tensor:
    """`reference.rms_norm`'s gradient for x, given its output's gradient and the forward's 1/rms per row."""
    g = d_out.float() * scale.float()
    xn = x.float() * rrms
    return (rrms * (g - xn * (g * xn).mean(-1, keepdim=True))).to(x.dtype)


def _tokens(t: Tensor) -> Tensor:
    """[B, H, L, D] -> [B, L, H * D], linear1's layout."""
    b, h, length, d = t.shape
    return t.permute(0, 2, 1, 3).reshape(b, length, h * d)


class _SingleQKV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, lin1: Tensor, q_scale: Tensor, k_scale: Tensor, pe: Tensor, num_heads: int, width: int):
        q, k, v = reference.heads(lin1[..., :width], num_heads)
        normed, rrms = [], []
        for x, scale in ((q, q_scale), (k, k_scale)):  # reference.rms_norm, keeping 1/rms for the backward
            xf = x.float()
            r = torch.rsqrt(torch.mean(xf**2, dim=-1, keepdim=True) + EPS)
            normed.append(((xf * r) * scale.float()).to(x.dtype))
            rrms.append(r)
        q, k = reference.apply_rope(normed[0], normed[1], pe)
        ctx.save_for_backward(lin1, q_scale, k_scale, pe, *rrms)
        ctx.num_heads, ctx.width = num_heads, width
        return q, k, v, F.gelu(lin1[..., width:], approximate="tanh")

    @staticmethod
    def backward(ctx, dq: Tensor, dk: Tensor, dv: Tensor, d_act: Tensor):
        lin1, q_scale, k_scale, pe, rq, rk = ctx.saved_tensors
        q, k, _ = reference.heads(lin1[..., : ctx.width], ctx.num_heads)
        # apply_rope took the normalised values rounded to lin1's dtype: its gradient is rounded the same way
        dq_normed, dk_normed = _rope_backward(dq, pe).to(lin1.dtype), _rope_backward(dk, pe).to(lin1.dtype)
        parts = (
            _tokens(_rms_norm_backward(dq_normed, q, rq, q_scale)),
            _tokens(_rms_norm_backward(dk_normed, k, rk, k_scale)),
            _tokens(dv),
            torch.ops.aten.gelu_backward(d_act, lin1[..., ctx.width :], approximate="tanh"),
        )
        return torch.cat(parts, dim=-1), None, None, None, None, None


def single_qkv(lin1: Tensor, q_scale: Tensor, k_scale: Tensor, pe: Tensor, num_heads: int, width: int):
    """`reference_single_qkv` with the written-out backward. The norm scales are taken as constants: with a scale
    that needs a gradient (a run training the norms) this is the reference itself."""
    if q_scale.requires_grad or k_scale.requires_grad:
        return reference_single_qkv(lin1, q_scale, k_scale, pe, num_heads, width)
    return _SingleQKV.apply(lin1, q_scale, k_scale, pe, num_heads, width)
