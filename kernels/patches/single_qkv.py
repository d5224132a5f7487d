"""The blocks' attention inputs (and the single block's MLP activation), with a backward written out for inductor.

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

That sum is gone where lora_fold mirror-folds linear2 (`vram80`'s default): GELU's incoming gradient is then one
GEMM's output, and inductor's pass wrote the buffer's full width (q, k, v's columns copied from the fresh buffer,
then written again by the kernel). There `gelu_in_kernel` hands that gradient to the custom op, whose second Triton
kernel writes only the MLP columns: 97.4 against 168.5 us a block, device busy 326.5 against 329.8 ms a step,
0.3369 / 0.3342 against 0.3398 / 0.3391 s/step (H200, vram80 auto, n o o n).

Used by `flux_kernels.patches.patch` in the single blocks when the `single_qkv` switch is on and the block is what it
expects (GELU tanh, frozen norm scales); otherwise the block runs sd-scripts' ops.

`double_qkv` is the same autograd function over the double block's two streams: each stream's qkv output split into
heads and normalised with its own QKNorm, txt then img concatenated, RoPE over the whole sequence (sd-scripts'
order, bit-identical); the backward runs the Triton kernel once per stream, on that stream's rows of the incoming
gradients and of pe. A compiled double block's q/k/v ops with cuDNN attention at 1024² (H200, s28c), forward +
backward: 2.107 ms median against 2.225 with sd-scripts' ops (device time outside attention 212 against 314 us);
with the torch backward 2.243 (320 us), so checkpointed double blocks keep sd-scripts' ops. Whole `vram80` runs do
not show the gain (A B B A, kernels=fp8: 0.2978 / 0.2973 against 0.2976 / 0.2979 s/step; auto: 0.3518 / 0.3466
against 0.3514 / 0.3515), so its switch is opt-in.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from flux_kernels.ops import fast, reference
from flux_kernels.runtime.device import triton_runs_on

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


def triton_backward_problem(segments, pe: Tensor) -> str | None:
    """Why the Triton backward cannot take these inputs here (None when it can): (q, k, q_scale, k_scale) per
    stream, q and k [B, H, L_i, D], pe over all streams' tokens."""
    q = segments[0][0]
    if not triton_runs_on(q.device):
        return f"no Triton on {q.device.type}"
    if q.dtype not in fast.DTYPES:
        return f"the blocks' dtype {q.dtype} is not in {fast.DTYPES}"
    return fast._qk_shape_problem(segments, pe)


def _norm(x: Tensor, scale: Tensor) -> tuple[Tensor, Tensor]:
    """`reference.rms_norm`, op for op, and its 1/rms per row for the backward."""
    xf = x.float()
    r = torch.rsqrt(torch.mean(xf**2, dim=-1, keepdim=True) + EPS)
    return ((xf * r) * scale.float()).to(x.dtype), r


def _groups(items, n: int):
    """Consecutive groups of n: the per-stream tensors, saved or passed flat."""
    return zip(*[iter(items)] * n, strict=True)


def _rows(t: Tensor, start: int, length: int) -> Tensor:
    """One stream's tokens of a [B, H, L, ...] tensor over all streams (the tensor itself when it is the only one)."""
    return t if start == 0 and length == t.shape[2] else t[:, :, start : start + length]


def _triton_backward(ctx, dq: Tensor, dk: Tensor, dv: Tensor, d_acts) -> list[Tensor]:
    # No stride or is_contiguous query here: where dynamo traces this backward, one would make it rewrite the
    # backward with a .contiguous() copy of every incoming gradient (torch._dynamo.config's
    # _autograd_backward_strict_mode_conditional_banned_ops). The launcher reads the strides at run time.
    pe, *saved = ctx.saved_tensors
    grads, start, d_acts = [], 0, iter(d_acts)
    for lin, q_scale, k_scale, rq, rk in _groups(saved, 5):
        B, L, W = lin.shape
        grad = torch.empty((B, L, W), dtype=lin.dtype, device=lin.device)
        d_act = next(d_acts) if W > ctx.width else None
        if d_act is not None and not ctx.gelu_in_kernel:
            # GELU's part first, in torch ops: inductor fuses it with what makes d_act (in a LoRA run, the sum of
            # the frozen and the LoRA input gradients of linear2) in one pass over the buffer's full width (its
            # slice_scatter on a fresh buffer), and the kernel then writes q, k, v's columns in place. After the
            # kernel, the same assignment would make inductor copy the kernel's columns into a new buffer; an
            # as_strided view avoided that, but functionalization bans a mutation through as_strided on a view
            # chain, and one H100 compile hit it
            grad[..., ctx.width :] = torch.ops.aten.gelu_backward(d_act, lin[..., ctx.width :], approximate="tanh")
            d_act = None
        # with gelu_in_kernel, the kernel writes GELU's columns too: d_act is one GEMM's output there (linear2
        # mirror-folded), so no sum is left for inductor to fuse, and its pass wrote the buffer's full width
        qkv_grads = (_rows(d, start, L) for d in (dq, dk, dv))
        kernel = fast._kernel("single_qkv_bwd", lin)
        kernel(*qkv_grads, lin, rq, rk, q_scale, k_scale, _rows(pe, start, L), grad, d_act)
        grads.append(grad)
        start += L
    return grads


def _torch_backward(ctx, dq: Tensor, dk: Tensor, dv: Tensor, d_acts) -> list[Tensor]:
    pe, *saved = ctx.saved_tensors
    dtype = saved[0].dtype
    # apply_rope took the normalised values rounded to the blocks' dtype: its gradient is rounded the same way
    dq_normed, dk_normed = _rope_backward(dq, pe).to(dtype), _rope_backward(dk, pe).to(dtype)
    grads, start, d_acts = [], 0, iter(d_acts)
    for lin, q_scale, k_scale, rq, rk in _groups(saved, 5):
        L = lin.shape[1]
        q, k, _ = reference.heads(lin[..., : ctx.width], ctx.num_heads)
        parts = [
            _tokens(_rms_norm_backward(_rows(dq_normed, start, L), q, rq, q_scale)),
            _tokens(_rms_norm_backward(_rows(dk_normed, start, L), k, rk, k_scale)),
            _tokens(_rows(dv, start, L)),
        ]
        if lin.shape[-1] > ctx.width:
            parts.append(torch.ops.aten.gelu_backward(next(d_acts), lin[..., ctx.width :], approximate="tanh"))
        grads.append(torch.cat(parts, dim=-1))
        start += L
    return grads


class _QKV(torch.autograd.Function):
    """Streams (a linear's output [B, L_i, width (+ M)], q_scale, k_scale), in sequence order, to q, k, v over
    all streams' tokens ([B, H, sum L_i, D]; q and k normalised per stream, then rotated) and, for a stream with
    M columns after its qkv (the single block's MLP input), their GELU."""

    @staticmethod
    def forward(ctx, pe: Tensor, num_heads: int, width: int, triton_bwd: bool, gelu_in_kernel: bool, *streams: Tensor):
        qs, ks, vs, acts, segments, saved = [], [], [], [], [], []
        for lin, q_scale, k_scale in _groups(streams, 3):
            q, k, v = reference.heads(lin[..., :width], num_heads)
            segments.append((q, k, q_scale, k_scale))
            (q, rq), (k, rk) = _norm(q, q_scale), _norm(k, k_scale)
            qs.append(q)
            ks.append(k)
            vs.append(v)
            if lin.shape[-1] > width:
                acts.append(F.gelu(lin[..., width:], approximate="tanh"))
            saved += [lin, q_scale, k_scale, rq, rk]
        q, k, v = (t[0] if len(t) == 1 else torch.cat(t, dim=2) for t in (qs, ks, vs))
        q, k = reference.apply_rope(q, k, pe)
        ctx.triton = triton_bwd and triton_backward_problem(segments, pe) is None
        if ctx.triton:  # what the kernels read: fp32 scales if the model's are fp8, pe as one fp32 block
            for i in range(0, len(saved), 5):
                saved[i + 1 : i + 3] = (fast._scale(s).contiguous() for s in saved[i + 1 : i + 3])
            pe = fast._pe_fp32(pe)
        ctx.save_for_backward(pe, *saved)
        ctx.num_heads, ctx.width, ctx.gelu_in_kernel = num_heads, width, gelu_in_kernel
        return q, k, v, *acts

    @staticmethod
    def backward(ctx, dq: Tensor, dk: Tensor, dv: Tensor, *d_acts: Tensor):
        grads = (_triton_backward if ctx.triton else _torch_backward)(ctx, dq, dk, dv, d_acts)
        return None, None, None, None, None, *(g for grad in grads for g in (grad, None, None))


def single_qkv(
    lin1: Tensor, q_scale: Tensor, k_scale: Tensor, pe: Tensor, num_heads: int, width: int, triton_bwd: bool = True,
    gelu_in_kernel: bool = False,
):  # fmt: skip
    """`reference_single_qkv` with the written-out backward. The norm scales are taken as constants: with a scale
    that needs a gradient (a run training the norms) this is the reference itself. `triton_bwd=False` keeps the
    torch backward where Triton could run (checkpointed blocks, where the Triton one measured slower).
    `gelu_in_kernel` has the Triton backward write GELU's gradient too, for blocks whose GELU gradient comes out of
    one GEMM (linear2 mirror-folded: `lora_fold`); elsewhere inductor fuses it with the sum that makes it."""
    if q_scale.requires_grad or k_scale.requires_grad:
        return reference_single_qkv(lin1, q_scale, k_scale, pe, num_heads, width)
    return _QKV.apply(pe, num_heads, width, triton_bwd, gelu_in_kernel, lin1, q_scale, k_scale)


def reference_double_qkv(
    txt_qkv: Tensor, txt_q_scale: Tensor, txt_k_scale: Tensor, img_qkv: Tensor, img_q_scale: Tensor,
    img_k_scale: Tensor, pe: Tensor, num_heads: int,
):  # fmt: skip
    """sd-scripts' double block from the two streams' qkv outputs ([B, L, 3 * H * D]): q, k, v over txt then img
    tokens, q and k normalised with their stream's QKNorm, then rotated over the whole sequence."""
    (tq, tk, tv), (iq, ik, iv) = reference.heads(txt_qkv, num_heads), reference.heads(img_qkv, num_heads)
    segments = [(tq, tk, txt_q_scale, txt_k_scale), (iq, ik, img_q_scale, img_k_scale)]
    return *reference.qk_norm_rope_cat(segments, pe), torch.cat((tv, iv), dim=2)


def double_qkv(
    txt_qkv: Tensor, txt_q_scale: Tensor, txt_k_scale: Tensor, img_qkv: Tensor, img_q_scale: Tensor,
    img_k_scale: Tensor, pe: Tensor, num_heads: int,
):  # fmt: skip
    """`reference_double_qkv` with the written-out backward (each stream's qkv gradient in one Triton kernel where
    Triton runs); as `single_qkv`, with norm scales that need a gradient it is the reference itself, and so it is
    with streams of different widths (not FLUX's)."""
    scales = (txt_q_scale, txt_k_scale, img_q_scale, img_k_scale)
    if any(s.requires_grad for s in scales) or txt_qkv.shape[-1] != img_qkv.shape[-1]:
        return reference_double_qkv(txt_qkv, *scales[:2], img_qkv, *scales[2:], pe, num_heads)
    width = txt_qkv.shape[-1]
    return _QKV.apply(pe, num_heads, width, True, False, txt_qkv, *scales[:2], img_qkv, *scales[2:])
