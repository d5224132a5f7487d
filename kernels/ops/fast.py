"""The fast ops: Triton kernels behind `torch.autograd.Function`s, same signatures as `reference`.

Each public function takes the Triton path when it can run here (CUDA with triton installed, or CPU under
TRITON_INTERPRET=1) and the inputs have a shape it handles, and otherwise calls the reference (logged once per
reason). `fallback=False` raises `Unsupported` instead: probes and tests use it, so a probe can never pass by
silently comparing the reference with itself.

The kernel launches are also `torch.library.custom_op`s (registered at first use, not import): traced code could
call them as opaque ops with known output shapes instead of tracing into Triton's launcher. Under torch.compile the
ops currently take the reference path instead (`TRACED`), so the fused kernels run in eager blocks only. Eager
calls skip the custom-op dispatcher and call the launchers directly (see `_kernel`).

What each op keeps for backward is no more than the reference keeps (see tests/unit/test_kernels_memory.py):
inputs the backward needs anyway, and fp32 row statistics (8 bytes per row), never fp32 copies of activations.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
from torch import Tensor

from flux_kernels.ops import reference
from flux_kernels.runtime.device import triton_runs_on

log = logging.getLogger(__name__)

EPS = reference.EPS
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MAX_HIDDEN = 16384  # one row of the hidden dim is one tile
_ops = None
_logged: set[str] = set()


# Traced by torch.compile (compile_blocks), the ops take the reference path and inductor compiles and fuses it
# itself. On the H200 (torch 2.11) a compiled, checkpointed double block with all four fused ops gave input
# gradients 26-44% off the eager block's when it was compiled with dynamic shapes or for a second input shape
# (another aspect-ratio bucket), while its outputs, the block without them and each op alone matched. With the ops'
# reference inside the graphs that was fixed, except where checkpointing saved the RNG state on the host
# (compile_blocks' cacheable variant): so blocks with these ops keep torch's graph-safe variant. Not understood
# yet; and in whole runs the fused ops inside compiled blocks measured no faster than compile_blocks alone (0.386
# vs 0.389 s/step).
TRACED = "traced by torch.compile: the reference, which inductor compiles (see fast.TRACED)"


class Unsupported(RuntimeError):
    """The fast path cannot take these inputs on this device (the reason is the message)."""


def _fallback(op: str, reason: str, fallback: bool) -> None:
    if not fallback:
        raise Unsupported(f"{op}: {reason}")
    if reason == TRACED:
        return  # no log call in traced code (it would break the graph); compile_blocks' install line says it
    if reason not in _logged:
        _logged.add(reason)
        log.info("flux_kernels %s: reference path (%s)", op, reason)


def _ops_lib():
    """(launchers module, custom ops), defined on first use (imports triton; not at import time of flux_kernels)."""
    global _ops
    if _ops is None:
        from flux_kernels.ops import _launch

        _ops = (_launch, _launch.define_ops())
    return _ops


_PLAIN = (Tensor, torch.nn.Parameter)


def _kernel(name: str, x: Tensor):
    """The launcher of `name`: its custom op in traced code and for tensor subclasses such as fake tensors, the
    plain launcher for plain tensors, where the dispatcher round trip would cost as much CPU time as the kernel
    takes on the GPU. Dynamo shows traced tensors to Python as plain Tensors: without the op it would trace into
    the launcher and bake the strides it saw into the graph, which inductor may then lay out differently."""
    launchers, ops = _ops_lib()
    if torch.compiler.is_compiling() or type(x) not in _PLAIN:
        return getattr(ops, name)
    return getattr(launchers, name)


def _common_problem(tensors: Sequence[Tensor]) -> str | None:
    if torch.compiler.is_compiling():
        return TRACED
    dev = tensors[0].device
    if any(t.device != dev for t in tensors):
        return "inputs on different devices"
    if not triton_runs_on(dev):
        return f"no Triton on {dev.type} (CUDA with triton, or TRITON_INTERPRET=1 on CPU)"
    if any(t.dtype not in DTYPES for t in tensors):
        return f"dtype {sorted({str(t.dtype) for t in tensors})} not in {[str(d) for d in DTYPES]}"
    return None


def _bc(t: Tensor, x: Tensor) -> Tensor | None:
    """A per-batch vector [B or 1, 1, C] (Modulation's chunks) as a [B, 1, C] view with unit stride on C."""
    B, _, C = x.shape
    if t.dim() != 3 or t.shape[1] != 1 or t.shape[2] != C or t.shape[0] not in (1, B):
        return None
    t = t.expand(B, 1, C)
    return t if t.stride(-1) == 1 else t.contiguous()


def _sum_to(grad: Tensor | None, like: Tensor) -> Tensor | None:
    return None if grad is None else grad.sum_to_size(like.shape).to(like.dtype)


# ---- QK-RMSNorm + RoPE --------------------------------------------------------------------------------------


class _QKNormRope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, pe: Tensor, eps: float, *flat: Tensor):
        qs, ks, qws, kws = flat[0::4], flat[1::4], flat[2::4], flat[3::4]
        q_out, k_out = _kernel("qk_norm_rope_fwd", qs[0])(list(qs), list(ks), list(qws), list(kws), pe, eps)
        ctx.save_for_backward(pe, *flat)
        ctx.eps = eps
        return q_out, k_out

    @staticmethod
    def backward(ctx, dq_out: Tensor | None, dk_out: Tensor | None):
        pe, *flat = ctx.saved_tensors
        qs, ks, qws, kws = flat[0::4], flat[1::4], flat[2::4], flat[3::4]
        n = len(qs)
        if dq_out is None or dk_out is None:  # one of q, k feeds nothing downstream
            B, H, _, D = qs[0].shape
            zeros = qs[0].new_zeros(B, H, sum(q.shape[2] for q in qs), D)
            dq_out, dk_out = (zeros if dq_out is None else dq_out), (zeros if dk_out is None else dk_out)
        need = ctx.needs_input_grad[2:]
        need_dw = any(need[4 * i + j] for i in range(n) for j in (2, 3))
        out = _kernel("qk_norm_rope_bwd", qs[0])(
            _unit_stride(dq_out), _unit_stride(dk_out), list(qs), list(ks), list(qws), list(kws), pe, ctx.eps, need_dw
        )
        grads: list[Tensor | None] = []
        for i in range(n):
            dq, dk = out[2 * i], out[2 * i + 1]
            dqw = out[2 * n + 2 * i].to(qws[i].dtype) if need[4 * i + 2] else None
            dkw = out[2 * n + 2 * i + 1].to(kws[i].dtype) if need[4 * i + 3] else None
            grads += [dq if need[4 * i] else None, dk if need[4 * i + 1] else None, dqw, dkw]
        return None, None, *grads


def _unit_stride(t: Tensor) -> Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _qk_problem(segments, pe: Tensor) -> str | None:
    # scales of any float dtype are fine: fp8-base models (sd-scripts casts the whole model) get an fp32 copy
    return _qk_shape_problem(segments, pe) or _common_problem([t for s in segments for t in s[:2]] + [pe.float()])


def _qk_shape_problem(segments, pe: Tensor) -> str | None:
    """What the QK-RMSNorm + RoPE kernels cannot take in these shapes (None when they can): [B, H, L, D] q and k
    per stream with D a power of two, [D] norm scales, pe [B|1, 1, L, D/2, 2, 2] over all streams' L."""
    q0 = segments[0][0]
    if q0.dim() != 4:
        return f"q must be [B, H, L, D], got {tuple(q0.shape)}"
    B, H, _, D = q0.shape
    if D < 2 or D > 256 or D & (D - 1):
        return f"head_dim {D} (must be a power of two from 2 to 256)"
    for q, k, qw, kw in segments:
        if q.shape[:2] != (B, H) or q.shape[3] != D or k.shape != q.shape or {q.dtype, k.dtype} != {q0.dtype}:
            return "q/k segments differ in batch, heads, head_dim or dtype"
        if qw.shape != (D,) or kw.shape != (D,):
            return f"norm scales must be [{D}]"
    L = sum(s[0].shape[2] for s in segments)
    if pe.requires_grad:
        return "pe requires grad (the kernel treats RoPE as a constant)"
    if pe.dim() != 6 or pe.shape[1:] != (1, L, D // 2, 2, 2) or pe.shape[0] not in (1, B):
        return f"pe shape {tuple(pe.shape)} is not [B|1, 1, {L}, {D // 2}, 2, 2]"
    return None


def _pe_fp32(pe: Tensor) -> Tensor:
    """RoPE's rotations as the kernels read them: one fp32 block."""
    return pe if pe.dtype == torch.float32 and pe.is_contiguous() else pe.float().contiguous()


def _scale(w: Tensor) -> Tensor:
    """RMSNorm reads its scale as fp32 (`self.scale.float()`); give the kernel that when it is fp8."""
    return w if w.dtype in DTYPES else w.float()


def qk_norm_rope_cat(
    segments: Sequence[tuple[Tensor, Tensor, Tensor, Tensor]], pe: Tensor, eps: float = EPS, *, fallback: bool = True
) -> tuple[Tensor, Tensor]:
    """Fused `reference.qk_norm_rope_cat`: per stream (q, k, q_scale, k_scale) RMSNorm, streams concatenated
    along L, RoPE, in one kernel launch per stream that writes straight into the concatenated [B, H, L, D]
    outputs (so the double block's torch.cat of q and k disappears too)."""
    problem = _qk_problem(segments, pe)
    if problem:
        _fallback("qk_norm_rope", problem, fallback)
        return reference.qk_norm_rope_cat(segments, pe, eps)
    flat = []
    for q, k, qw, kw in segments:
        flat += [_unit_stride(q), _unit_stride(k), _scale(qw), _scale(kw)]
    return _QKNormRope.apply(_pe_fp32(pe), eps, *flat)


def qk_norm_rope(
    q: Tensor, k: Tensor, q_scale: Tensor, k_scale: Tensor, pe: Tensor, eps: float = EPS, *, fallback: bool = True
) -> tuple[Tensor, Tensor]:
    """Fused `reference.qk_norm_rope` (one stream, as in the single-stream block)."""
    return qk_norm_rope_cat([(q, k, q_scale, k_scale)], pe, eps, fallback=fallback)


# ---- LayerNorm + modulation -----------------------------------------------------------------------------------


class _Modulate(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, shift: Tensor, scale: Tensor, eps: float):
        sh, sc = _bc(shift, x), _bc(scale, x)
        out, mean, rstd = _kernel("modulate_fwd", x)(x, sh, sc, eps)
        ctx.save_for_backward(x, shift, scale, mean, rstd)
        return out

    @staticmethod
    def backward(ctx, dout: Tensor):
        x, shift, scale, mean, rstd = ctx.saved_tensors
        need_dss = ctx.needs_input_grad[1] or ctx.needs_input_grad[2]
        dx, dshift, dscale = _kernel("modulate_bwd", x)(_unit_stride(dout), x, _bc(scale, x), mean, rstd, need_dss)
        return (
            dx if ctx.needs_input_grad[0] else None,
            _sum_to(dshift, shift) if ctx.needs_input_grad[1] else None,
            _sum_to(dscale, scale) if ctx.needs_input_grad[2] else None,
            None,
        )


def _rows_problem(x: Tensor, vecs: Sequence[Tensor]) -> str | None:
    if x.dim() != 3:
        return f"x must be [B, L, C], got {tuple(x.shape)}"
    if x.shape[-1] > MAX_HIDDEN:
        return f"hidden size {x.shape[-1]} > {MAX_HIDDEN}"
    if any(_bc(v, x) is None for v in vecs):
        return f"modulation vectors {[tuple(v.shape) for v in vecs]} are not [B|1, 1, {x.shape[-1]}]"
    return _common_problem([x, *vecs])


def modulate(x: Tensor, shift: Tensor, scale: Tensor, eps: float = EPS, *, fallback: bool = True) -> Tensor:
    """Fused `reference.modulate`: LayerNorm without affine and `(1 + scale) * x + shift` in one pass, fp32
    inside, one rounding (the reference rounds after each of its four ops, so the two agree to ~1 ulp)."""
    problem = _rows_problem(x, (shift, scale))
    if problem:
        _fallback("modulate", problem, fallback)
        return reference.modulate(x, shift, scale, eps)
    return _Modulate.apply(_unit_stride(x), shift, scale, eps)


# ---- gated residual -------------------------------------------------------------------------------------------


class _Gated(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, gate: Tensor, y: Tensor):
        out = _kernel("gated_residual_fwd", x)(x, _bc(gate, x), y)
        ctx.save_for_backward(gate, y)
        ctx.x_dtype = x.dtype
        return out

    @staticmethod
    def backward(ctx, dout: Tensor):
        gate, y = ctx.saved_tensors
        dout = _unit_stride(dout)
        dy, dgate = _kernel("gated_residual_bwd", y)(dout, _bc(gate, y), y, ctx.needs_input_grad[1])
        return (
            dout.to(ctx.x_dtype) if ctx.needs_input_grad[0] else None,
            _sum_to(dgate, gate) if ctx.needs_input_grad[1] else None,
            dy if ctx.needs_input_grad[2] else None,
        )


def gated_residual(x: Tensor, gate: Tensor, y: Tensor, *, fallback: bool = True) -> Tensor:
    """Fused `reference.gated_residual` `x + gate * y`: one read of x and y, one write (the reference writes
    `gate * y` out and reads it back); backward computes dy and the gate's sum over L in one pass."""
    problem = _rows_problem(x, (gate,))
    if not problem and y.shape != x.shape:
        problem = f"y shape {tuple(y.shape)} != x shape {tuple(x.shape)}"
    if not problem:
        problem = _common_problem([x, gate, y])
    if problem:
        _fallback("gated_residual", problem, fallback)
        return reference.gated_residual(x, gate, y)
    return _Gated.apply(_unit_stride(x), gate, _unit_stride(y))


# ---- gated residual + LayerNorm + modulation --------------------------------------------------------------------


class _GatedModulate(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, gate: Tensor, y: Tensor, shift: Tensor, scale: Tensor, eps: float):
        res, out, mean, rstd = _kernel("gated_modulate_fwd", x)(x, _bc(gate, x), y, _bc(shift, x), _bc(scale, x), eps)
        # The residual `res` is not kept: backward recomputes it from x and y, which it needs anyway (y for the gate
        # gradient; x is the block's input stream, kept by the LayerNorm before it). Keeping `res` would add one
        # [B, L, C] activation per call that the compiled reference does not keep.
        ctx.save_for_backward(x, gate, y, scale, mean, rstd)
        ctx.shift_shape = shift.shape
        return res, out

    @staticmethod
    def backward(ctx, dres: Tensor | None, dout: Tensor | None):
        x, gate, y, scale, mean, rstd = ctx.saved_tensors
        need = ctx.needs_input_grad
        if dout is None:
            dout = torch.zeros_like(x)
        dx, dy, dgate, dshift, dscale = _kernel("gated_modulate_bwd", x)(
            None if dres is None else _unit_stride(dres), _unit_stride(dout), x, _bc(gate, x), y, _bc(scale, x),
            mean, rstd, need[1], need[3] or need[4],
        )  # fmt: skip
        return (
            dx if need[0] else None,
            _sum_to(dgate, gate) if need[1] else None,
            dy if need[2] else None,
            dshift.sum_to_size(ctx.shift_shape).to(scale.dtype) if need[3] else None,
            _sum_to(dscale, scale) if need[4] else None,
            None,
        )


def gated_modulate(
    x: Tensor, gate: Tensor, y: Tensor, shift: Tensor, scale: Tensor, eps: float = EPS, *, fallback: bool = True
) -> tuple[Tensor, Tensor]:
    """Fused `reference.gated_modulate`: the residual update `res = x + gate * y` and the modulated LayerNorm of
    `res` that the double block feeds its MLP, in one pass (the unfused path writes `res`, reads it back for the
    LayerNorm and adds the two gradients of `res` in a third pass). Returns (res, modulated)."""
    problem = _rows_problem(x, (gate, shift, scale))
    if not problem and y.shape != x.shape:
        problem = f"y shape {tuple(y.shape)} != x shape {tuple(x.shape)}"
    if not problem and len({t.dtype for t in (x, gate, y, shift, scale)}) > 1:
        problem = f"mixed dtypes {sorted({str(t.dtype) for t in (x, gate, y, shift, scale)})}"
    if not problem:
        problem = _common_problem([x, gate, y, shift, scale])
    if problem:
        _fallback("gated_modulate", problem, fallback)
        return reference.gated_modulate(x, gate, y, shift, scale, eps)
    return _GatedModulate.apply(_unit_stride(x), gate, _unit_stride(y), shift, scale, eps)
