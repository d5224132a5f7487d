"""Attention with PyTorch's cuDNN forward and FlashAttention-4's backward (`cudnn_fa4`, an attention backend).

On the H200 at FLUX's 1024² shape ([1, 24, 4608, 128], bf16) cuDNN's forward is the fastest there is (0.44-0.46 ms
against 0.59 for FlashAttention-4's), while FlashAttention-4's backward (flash-attn-4, CuTe DSL; sm90 and newer) is
faster than cuDNN's. Both use the same softmax statistics: the log-sum-exp of the scaled scores per query row,
natural log, float32, [B, H, L]. So the forward keeps cuDNN's log-sum-exp beside its output, and the backward hands
both to FlashAttention-4's backward kernels. Errors against fp32 are the same as cuDNN's own (2.4e-3 relative for
dq, dk and dv at 4608 tokens, measured).

Two custom ops, so that compiled blocks call them as they are and CUDA graphs record them:
  * `flux_kernels::cudnn_lse_attention(q, k, v) -> (out, lse)`: cuDNN's forward with its log-sum-exp;
  * `flux_kernels::fa4_attention_backward(dout, q, k, v, out, lse) -> (dq, dk, dv)`.
Inputs are FLUX's [B, H, L, D]; FlashAttention-4 takes [B, L, H, D], which is a transposed view of the same memory,
and writes the gradients through such views into contiguous [B, H, L, D] tensors. The output is [B, H, L, D] laid
out token-major, [B, L, H, D] in memory (`token_major`), so that `cudnn_fa4_tokens`, the blocks' call, gets sd-scripts'
"B H L D -> B L (H D)" as a view; cuDNN writes it so when q is so laid out, as the single blocks' q is. Its gradient
goes to FlashAttention-4 in whatever layout it comes, where that has the alignment the kernels need (else it is
copied to token-major). On the CPU (tests) both ops run the plain-PyTorch math of the same two steps
(`reference_forward`, `reference_backward`).

flash-attn-4 is imported at the first backward (its import takes seconds); nothing here imports it before. Its
backward accumulates dq with atomics, so two runs of a step can differ in the last bits, as with FlashAttention-2.
"""

from __future__ import annotations

import torch
from torch import Tensor

MODULE = "flash_attn.cute"  # what flash-attn-4 installs (the distribution is flash-attn-4)
MIN_CAPABILITY = (9, 0)  # its backward kernels: sm90 (Hopper), sm100/sm110 (Blackwell), sm120 (RTX 50)
DISTRIBUTION = "flash-attn-4==4.0.0b36"  # the version measured (flux-train's `fa4` extra pins the same)
NO_MASK = "cudnn_fa4 takes no attention mask (FlashAttention-4's dense backward has none)"


# ---- the math, in plain PyTorch (the CPU path and the tests' reference) -----------------------------------------


def reference_forward(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """softmax(q kᵀ / sqrt(D)) v and the log-sum-exp of the scaled scores per query row (float32, [B, H, L])."""
    acc = torch.promote_types(q.dtype, torch.float32)
    s = (q.to(acc) @ k.to(acc).transpose(-1, -2)) * q.shape[-1] ** -0.5
    lse = torch.logsumexp(s, dim=-1)
    out = torch.exp(s - lse[..., None]) @ v.to(acc)
    return out.to(q.dtype), lse.float()


def reference_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor):
    """The attention's input gradients from its output and log-sum-exp, as flash attention's backward computes them:
    P from the saved statistics, dS = P * (dO Vᵀ - rowsum(dO * O))."""
    scale, acc = q.shape[-1] ** -0.5, torch.promote_types(q.dtype, torch.float32)
    qf, kf, vf, dof = (t.to(acc) for t in (q, k, v, dout))
    p = torch.exp((qf @ kf.transpose(-1, -2)) * scale - lse.to(acc)[..., None])
    dv = p.transpose(-1, -2) @ dof
    ds = p * (dof @ vf.transpose(-1, -2) - (dof * out.to(acc)).sum(-1, keepdim=True))
    dq, dk = (ds @ kf) * scale, (ds.transpose(-1, -2) @ qf) * scale
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


# ---- the ops ----------------------------------------------------------------------------------------------------


def token_major(t: Tensor) -> Tensor:
    """[B, H, L, D] `t` laid out as [B, L, H, D] in memory, the tokens' order: `t` itself where it already is, else a
    copy."""
    return t.transpose(1, 2).contiguous().transpose(1, 2)


def fa4_layout(t: Tensor) -> Tensor:
    """`t` where FlashAttention-4 takes it as it is (the last dimension contiguous, every other stride a non-zero
    multiple of 16 bytes, the pointer 16-byte aligned: a column slice of a wider gradient qualifies), else
    `token_major(t)`. A broadcast gradient (stride 0, from a loss such as `out.sum()`) is copied."""
    align = 16 // t.element_size()
    strides = t.stride()
    if strides[-1] == 1 and all(s > 0 and s % align == 0 for s in strides[:-1]) and t.data_ptr() % 16 == 0:
        return t
    return token_major(t)


@torch.library.custom_op("flux_kernels::cudnn_lse_attention", mutates_args=())
def cudnn_lse_attention(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """[B, H, L, D] attention, token-major (`token_major`), and its log-sum-exp [B, H, L]: cuDNN's forward on CUDA,
    the reference elsewhere."""
    if q.device.type != "cuda":
        out, lse = reference_forward(q, k, v)
        return token_major(out), lse.contiguous()
    res = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, False, False)
    out, lse = res[0], res[1]  # out laid out as q is; lse [B, H, L, 1]
    return token_major(out), lse.reshape(q.shape[:3]).contiguous()


@cudnn_lse_attention.register_fake
def _(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    B, H, L, _ = q.shape
    out = q.new_empty((B, L, H, v.shape[-1])).transpose(1, 2)
    return out, q.new_empty((B, H, L), dtype=torch.float32)


@torch.library.custom_op("flux_kernels::fa4_attention_backward", mutates_args=())
def fa4_attention_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """dq, dk, dv ([B, H, L, D], contiguous) from FlashAttention-4's backward on CUDA, the reference elsewhere."""
    if q.device.type != "cuda":
        return tuple(g.contiguous() for g in reference_backward(dout, q, k, v, out, lse))
    from flash_attn.cute.interface import _flash_attn_bwd

    dout = fa4_layout(dout)
    dq, dk, dv = (torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))

    def tokens(x: Tensor) -> Tensor:  # [B, H, L, D] -> [B, L, H, D], the same memory
        return x.transpose(1, 2)

    _flash_attn_bwd(tokens(q), tokens(k), tokens(v), tokens(out), tokens(dout), lse,
                    dq=tokens(dq), dk=tokens(dk), dv=tokens(dv))  # fmt: skip
    return dq, dk, dv


@fa4_attention_backward.register_fake
def _(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    return tuple(torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))


def _setup(ctx, inputs, output) -> None:
    q, k, v = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)


def _backward(ctx, dout: Tensor, _dlse: Tensor | None):
    q, k, v, out, lse = ctx.saved_tensors
    return fa4_attention_backward(dout, q, k, v, out, lse)


cudnn_lse_attention.register_autograd(_backward, setup_context=_setup)


def cudnn_fa4(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None) -> Tensor:
    """The attention backend's call: [B, H, L, D] in, [B, H, L, D] out; no mask. Under autocast the inputs are cast
    to its dtype first, as autocast casts them for PyTorch's SDPA (custom ops are not cast by autocast)."""
    if mask is not None:
        raise NotImplementedError(NO_MASK)
    kind = q.device.type
    if torch.is_autocast_enabled(kind):
        dtype = torch.get_autocast_dtype(kind)
        q, k, v = (t.to(dtype) for t in (q, k, v))
    return cudnn_lse_attention(q, k, v)[0]


def cudnn_fa4_tokens(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None) -> Tensor:
    """`cudnn_fa4` as tokens [B, L, H*D], sd-scripts' "B H L D -> B L (H D)": a view of the token-major output, where
    other backends' output is copied (`flux_kernels.patches.attention.backends.heads_to_tokens`). Its gradient,
    [B, L, H*D] in whatever layout the blocks' backward makes it (a column slice of linear2's input gradient in a single
    block), reaches FlashAttention-4 as it is (`fa4_layout`)."""
    return cudnn_fa4(q, k, v, mask).transpose(1, 2).flatten(2)
