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

Where Triton runs (CUDA, or the CPU interpreter), q, k and v's part of the backward is one Triton kernel instead
(`tl_single_qkv`; traced code calls it as the custom op `flux_kernels::single_qkv_bwd`, whose launcher reads the
strides of the tensors it gets at run time), holding each (token, head) row in registers for RMSNorm's row sum;
GELU's part stays in torch ops, written in place into the kernel's output, so inductor fuses it with what makes its
input gradient. Inductor's code for the written-out q/k/v algebra needed a reduction pass and a pass per slice
(s26a: 91 + 30 + 29 + 15 us per block; the kernel: 67-71 us). Whole `vram80 kernels=fp8` runs, A B B A against the
torch backward (H200): 0.2997 / 0.2990 s/step against 0.3013 / 0.3013. GELU's part then went into the kernel's
buffer instead of a new one (no copy of the q/k/v columns): torch peak 52.49 against 52.59 GiB, s/step the same
(A B B A: 0.3006 / 0.2998 against 0.3006 / 0.2999). GELU's part must stay in torch ops: with it
in Triton as well, inductor could no longer fuse the LoRA gradient sum (linear2's frozen + LoRA input gradients)
into GELU's backward, and that sum's own pass cost what the kernels saved (0.305-0.306 s/step either way).
Checkpointed blocks keep the torch backward: at the checkpointed fp8-base tier (`memory=vram24 kernels=offload`),
in the order new / old / old / new, the Triton one measured 0.3846 / 0.3853 s/step against 0.3790 / 0.3796, card peak
16.7-16.8 against 16.4 GiB (not profiled). With GELU's part in the kernel's buffer, forced on there: 0.3749
against 0.3733 (forced first; within the run order's effect), card peak 16.5 against 16.4: no gain, so no change.

Used by `flux_kernels.patch` in the single blocks when the `single_qkv` switch is on and the block is what it
expects (GELU tanh, frozen norm scales); otherwise the block runs sd-scripts' ops.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from flux_kernels import fast, reference
from flux_kernels.device import triton_runs_on

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


def triton_backward_problem(q: Tensor, k: Tensor, q_scale: Tensor, k_scale: Tensor, pe: Tensor) -> str | None:
    """Why the Triton backward cannot take these inputs here (None when it can); q, k: [B, H, L, D]."""
    if not triton_runs_on(q.device):
        return f"no Triton on {q.device.type}"
    if q.dtype not in fast.DTYPES:
        return f"linear1's dtype {q.dtype} is not in {fast.DTYPES}"
    return fast._qk_shape_problem([(q, k, q_scale, k_scale)], pe)


def _triton_backward(ctx, dq: Tensor, dk: Tensor, dv: Tensor, d_act: Tensor) -> Tensor:
    # No stride or is_contiguous query here: where dynamo traces this backward, one would make it rewrite the
    # backward with a .contiguous() copy of every incoming gradient (torch._dynamo.config's
    # _autograd_backward_strict_mode_conditional_banned_ops). The launcher reads the strides at run time.
    lin1, q_scale, k_scale, pe, rq, rk = ctx.saved_tensors
    B, L, W = lin1.shape
    grad = torch.empty((B, L, W), dtype=lin1.dtype, device=lin1.device)
    fast._kernel("single_qkv_bwd", lin1)(dq, dk, dv, lin1, rq, rk, q_scale, k_scale, pe, grad)
    # GELU's part in place, in torch ops: inductor fuses it with what makes d_act (in a LoRA run, the sum of the
    # frozen and the LoRA input gradients of linear2) and writes straight into the kernel's buffer. Through an
    # as_strided view, which inductor's reinplacing always keeps a mutation: a slice assignment becomes a
    # slice_scatter that it would make a new buffer of, copying the kernel's columns over (a pass a block)
    gelu_part = grad.as_strided((B, L, W - ctx.width), (L * W, W, 1), ctx.width)
    gelu_part.copy_(torch.ops.aten.gelu_backward(d_act, lin1[..., ctx.width :], approximate="tanh"))
    return grad


class _SingleQKV(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, lin1: Tensor, q_scale: Tensor, k_scale: Tensor, pe: Tensor, num_heads: int, width: int, triton_bwd: bool
    ):
        q, k, v = reference.heads(lin1[..., :width], num_heads)
        normed, rrms = [], []
        for x, scale in ((q, q_scale), (k, k_scale)):  # reference.rms_norm, keeping 1/rms for the backward
            xf = x.float()
            r = torch.rsqrt(torch.mean(xf**2, dim=-1, keepdim=True) + EPS)
            normed.append(((xf * r) * scale.float()).to(x.dtype))
            rrms.append(r)
        q, k = reference.apply_rope(normed[0], normed[1], pe)
        ctx.triton = triton_bwd and triton_backward_problem(q, k, q_scale, k_scale, pe) is None
        if ctx.triton:  # what the kernels read: fp32 scales if the model's are fp8, pe as one fp32 block
            q_scale, k_scale = (fast._scale(s).contiguous() for s in (q_scale, k_scale))
            pe = fast._pe_fp32(pe)
        ctx.save_for_backward(lin1, q_scale, k_scale, pe, *rrms)
        ctx.num_heads, ctx.width = num_heads, width
        return q, k, v, F.gelu(lin1[..., width:], approximate="tanh")

    @staticmethod
    def backward(ctx, dq: Tensor, dk: Tensor, dv: Tensor, d_act: Tensor):
        if ctx.triton:
            return _triton_backward(ctx, dq, dk, dv, d_act), None, None, None, None, None, None
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
        return torch.cat(parts, dim=-1), None, None, None, None, None, None


def single_qkv(
    lin1: Tensor, q_scale: Tensor, k_scale: Tensor, pe: Tensor, num_heads: int, width: int, triton_bwd: bool = True
):
    """`reference_single_qkv` with the written-out backward. The norm scales are taken as constants: with a scale
    that needs a gradient (a run training the norms) this is the reference itself. `triton_bwd=False` keeps the
    torch backward where Triton could run (checkpointed blocks, where the Triton one measured slower)."""
    if q_scale.requires_grad or k_scale.requires_grad:
        return reference_single_qkv(lin1, q_scale, k_scale, pe, num_heads, width)
    return _SingleQKV.apply(lin1, q_scale, k_scale, pe, num_heads, width, triton_bwd)
