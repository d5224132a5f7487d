"""Kernel launches: plain Python launchers, and the same wrapped as `torch.library.custom_op`s. Imported by
`fast._ops_lib()` on first use: importing this imports triton; `define_ops` registers the ops once per process.

Eager code calls the launchers directly (a custom op's dispatcher round trip costs ~10 us of CPU per call, as much
as the kernel itself at FLUX shapes); torch.compile and export trace the custom ops, which they see as opaque
calls with known output shapes (the fake implementations below) instead of Triton's launcher.

(No `from __future__ import annotations` here: custom_op reads the real annotations to build the op schema.)
"""

import functools
from types import SimpleNamespace

import torch
import triton
from torch import Tensor

from flux_kernels.ops import tl_lora_norms as tn
from flux_kernels.ops import tl_modulate as tm
from flux_kernels.ops import tl_qk_norm_rope as tq
from flux_kernels.ops import tl_single_qkv as ts
from flux_kernels.runtime.device import triton_interpreting

NS = "flux_kernels"
# The CPU interpreter truncates fp32 -> bf16; round to nearest-even by hand there so it matches GPUs.
_RTNE = triton_interpreting()
F32 = torch.float32


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 2  # the CPU interpreter: few programs, each looping over many rows


def _row_split(device: torch.device, B: int, L: int, reduce: bool) -> tuple[int, int]:
    """(programs per batch element, rows per program) for the backward kernels. Reducing over L (the modulation
    vectors need gradients, as when LoRA trains the Modulation layers, sd-scripts' default): about two programs
    per SM in all (what fits at 16 warps), so the fp32 partial rows summed afterwards stay ~8% of the traffic.
    Otherwise one row each."""
    if not reduce or not L:
        return max(L, 1), 1
    want = max(1, min(L, triton.cdiv(2 * _sm_count(device), B)))
    rows = triton.cdiv(L, want)
    return triton.cdiv(L, rows), rows


def _warps(block: int, bwd: bool = False) -> int:
    """Warps per program for one hidden-size row. From ptxas register counts (triton 3.7, sm_90, bf16, C=3072):
    a 4096-wide backward needs 16 warps to stay near 64-108 registers; no configuration spills."""
    if block >= 4096:
        return 16 if bwd else 8
    return 8 if block >= 2048 else 4


def _qk_tile(H: int, D: int) -> tuple[int, int, int]:
    """(tokens, heads, warps) per program: 2 tokens x 8 heads x 128 of q and of k, one 16-byte vector of each per
    thread (8 warps). ptxas (sm_90, bf16): 40 registers forward, 48 backward, no spills, so ~5 programs per SM;
    FLUX's 24 heads split into 3 groups of 8 without padding."""
    block_h = min(triton.next_power_of_2(H), 8)
    block_t = 2
    return block_t, block_h, max(1, min(16, block_t * block_h * D // 256))


def _empty_dq(q: Tensor) -> Tensor:
    """A [B, H, L, D] gradient laid out [B, L, H, D] in memory, like the q/k views of the qkv projection it
    flows back into (each token's heads are one contiguous run: coalesced stores)."""
    B, H, L, D = q.shape
    return q.new_empty(B, L, H, D).permute(0, 2, 1, 3)


def _sum_parts(parts: Tensor, B: int) -> Tensor:
    return parts.view(B, -1, parts.shape[-1]).sum(1, keepdim=True)


def _none(like: Tensor) -> Tensor:
    """An empty fp32 stand-in for a gradient that was not asked for (never aliased with another output)."""
    return like.new_empty(0, dtype=F32)


def _pe_batch_stride(pe: Tensor) -> int:
    """pe's batch stride for the kernels: 0 where one set of rotations serves the whole batch."""
    return pe.stride(0) if pe.shape[0] > 1 else 0


# ---- QK-RMSNorm + RoPE ------------------------------------------------------------------------------------------


def qk_norm_rope_fwd(
    qs: list[Tensor], ks: list[Tensor], qws: list[Tensor], kws: list[Tensor], pe: Tensor, eps: float
) -> tuple[Tensor, Tensor]:
    B, H, _, D = qs[0].shape
    total = sum(q.shape[2] for q in qs)
    q_out = qs[0].new_empty(B, H, total, D)
    k_out = qs[0].new_empty(B, H, total, D)
    spe_b = _pe_batch_stride(pe)
    bt, bh, warps = _qk_tile(H, D)
    l_off = 0
    for q, k, qw, kw in zip(qs, ks, qws, kws, strict=True):
        L = q.shape[2]
        if L and B:
            tq.qk_norm_rope_fwd[(triton.cdiv(L, bt), triton.cdiv(H, bh), B)](
                q, k, qw, kw, pe, q_out, k_out, L, H, l_off,
                q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
                q_out.stride(0), q_out.stride(1), q_out.stride(2), spe_b, pe.stride(2), eps,
                D=D, BLOCK_T=bt, BLOCK_H=bh, RTNE=_RTNE, num_warps=warps,
            )  # fmt: skip
        l_off += L
    return q_out, k_out


def qk_norm_rope_bwd(
    dq_out: Tensor, dk_out: Tensor, qs: list[Tensor], ks: list[Tensor], qws: list[Tensor], kws: list[Tensor],
    pe: Tensor, eps: float, need_dw: bool,
) -> list[Tensor]:  # fmt: skip
    B, H, _, D = qs[0].shape
    spe_b = _pe_batch_stride(pe)
    bt, bh, warps = _qk_tile(H, D)
    grads, dws = [], []
    l_off = 0
    for q, k, qw, kw in zip(qs, ks, qws, kws, strict=True):
        L = q.shape[2]
        dq, dk = _empty_dq(q), _empty_dq(k)
        grid = (triton.cdiv(L, bt), triton.cdiv(H, bh), B)
        parts = grid[0] * grid[1] * grid[2]
        dqw = q.new_empty(parts, D, dtype=F32) if need_dw else pe  # every program writes its row: no zeroing
        dkw = q.new_empty(parts, D, dtype=F32) if need_dw else pe
        if parts:
            tq.qk_norm_rope_bwd[grid](
                dq_out, dk_out, q, k, qw, kw, pe, dq, dk, dqw, dkw, L, H, l_off,
                dq_out.stride(0), dq_out.stride(1), dq_out.stride(2),
                dk_out.stride(0), dk_out.stride(1), dk_out.stride(2),
                q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
                dq.stride(0), dq.stride(1), dq.stride(2), spe_b, pe.stride(2), eps,
                D=D, BLOCK_T=bt, BLOCK_H=bh, COMPUTE_DW=need_dw, RTNE=_RTNE, num_warps=warps,
            )  # fmt: skip
        grads += [dq, dk]
        if need_dw:
            dws += [dqw.sum(0), dkw.sum(0)] if parts else [q.new_zeros(D, dtype=F32), q.new_zeros(D, dtype=F32)]
        else:
            dws += [_none(q), _none(q)]
        l_off += L
    return grads + dws


def _qk_fwd_fake(qs, ks, qws, kws, pe, eps):
    B, H, _, D = qs[0].shape
    total = sum(q.shape[2] for q in qs)
    return qs[0].new_empty(B, H, total, D), qs[0].new_empty(B, H, total, D)


def _qk_bwd_fake(dq_out, dk_out, qs, ks, qws, kws, pe, eps, need_dw):
    grads, dws = [], []
    for q, k in zip(qs, ks, strict=True):
        grads += [_empty_dq(q), _empty_dq(k)]
        n = q.shape[-1] if need_dw else 0
        dws += [q.new_empty(n, dtype=F32), q.new_empty(n, dtype=F32)]
    return grads + dws


# ---- LayerNorm + modulation -------------------------------------------------------------------------------------


def modulate_fwd(x: Tensor, shift: Tensor, scale: Tensor, eps: float) -> tuple[Tensor, Tensor, Tensor]:
    B, L, C = x.shape
    out = x.new_empty(B, L, C, dtype=torch.promote_types(torch.promote_types(x.dtype, shift.dtype), scale.dtype))
    mean = x.new_empty(B, L, dtype=F32)
    rstd = x.new_empty(B, L, dtype=F32)
    if B * L:
        block = triton.next_power_of_2(C)
        tm.modulate_fwd[(L, B)](
            x, shift, scale, out, mean, rstd, L, C, x.stride(0), x.stride(1), shift.stride(0), scale.stride(0),
            out.stride(0), out.stride(1), eps, BLOCK_C=block, RTNE=_RTNE, num_warps=_warps(block),
        )  # fmt: skip
    return out, mean, rstd


def _modulate_fwd_fake(x, shift, scale, eps):
    B, L, C = x.shape
    dtype = torch.promote_types(torch.promote_types(x.dtype, shift.dtype), scale.dtype)
    return x.new_empty(B, L, C, dtype=dtype), x.new_empty(B, L, dtype=F32), x.new_empty(B, L, dtype=F32)


def modulate_bwd(
    dout: Tensor, x: Tensor, scale: Tensor, mean: Tensor, rstd: Tensor, need_dss: bool
) -> tuple[Tensor, Tensor, Tensor]:
    B, L, C = x.shape
    dx = torch.empty_like(x, memory_format=torch.contiguous_format)
    progs, rows = _row_split(x.device, B, L, need_dss)
    dsc = x.new_empty(B * progs, C, dtype=F32) if need_dss else mean  # every program writes its row
    dsh = x.new_empty(B * progs, C, dtype=F32) if need_dss else mean
    if B * L:
        block = triton.next_power_of_2(C)
        tm.modulate_bwd[(progs, B)](
            dout, x, scale, mean, rstd, dx, dsc, dsh, L, C, rows, progs,
            dout.stride(0), dout.stride(1), x.stride(0), x.stride(1), scale.stride(0), dx.stride(0), dx.stride(1),
            BLOCK_C=block, COMPUTE_DSS=need_dss, RTNE=_RTNE, num_warps=_warps(block, bwd=True),
        )  # fmt: skip
    if not need_dss:
        return dx, _none(x), _none(x)
    if not B * L:
        return dx, x.new_zeros(B, 1, C, dtype=F32), x.new_zeros(B, 1, C, dtype=F32)
    return dx, _sum_parts(dsh, B), _sum_parts(dsc, B)


def _modulate_bwd_fake(dout, x, scale, mean, rstd, need_dss):
    B, L, C = x.shape
    shape = (B, 1, C) if need_dss else (0,)
    return torch.empty_like(x), x.new_empty(shape, dtype=F32), x.new_empty(shape, dtype=F32)


# ---- gated residual ---------------------------------------------------------------------------------------------


def gated_residual_fwd(x: Tensor, gate: Tensor, y: Tensor) -> Tensor:
    B, L, C = x.shape
    out = x.new_empty(B, L, C, dtype=torch.promote_types(torch.promote_types(x.dtype, gate.dtype), y.dtype))
    if B * L:
        block = triton.next_power_of_2(C)
        tm.gated_fwd[(L, B)](
            x, gate, y, out, C, x.stride(0), x.stride(1), gate.stride(0), y.stride(0), y.stride(1),
            out.stride(0), out.stride(1), BLOCK_C=block, RTNE=_RTNE, num_warps=_warps(block),
        )  # fmt: skip
    return out


def _gated_fwd_fake(x, gate, y):
    return x.new_empty(x.shape, dtype=torch.promote_types(torch.promote_types(x.dtype, gate.dtype), y.dtype))


def gated_residual_bwd(dout: Tensor, gate: Tensor, y: Tensor, need_dgate: bool) -> tuple[Tensor, Tensor]:
    B, L, C = y.shape
    dy = torch.empty_like(y, memory_format=torch.contiguous_format)
    progs, rows = _row_split(y.device, B, L, need_dgate)
    dg = y.new_empty(B * progs, C, dtype=F32) if need_dgate else dy
    if B * L:
        block = triton.next_power_of_2(C)
        tm.gated_bwd[(progs, B)](
            dout, gate, y, dy, dg, L, C, rows, progs, dout.stride(0), dout.stride(1), gate.stride(0),
            y.stride(0), y.stride(1), dy.stride(0), dy.stride(1),
            BLOCK_C=block, COMPUTE_DGATE=need_dgate, RTNE=_RTNE, num_warps=_warps(block, bwd=True),
        )  # fmt: skip
    if not need_dgate:
        return dy, _none(y)
    return dy, _sum_parts(dg, B) if B * L else y.new_zeros(B, 1, C, dtype=F32)


def _gated_bwd_fake(dout, gate, y, need_dgate):
    B, _, C = y.shape
    return torch.empty_like(y), y.new_empty((B, 1, C) if need_dgate else (0,), dtype=F32)


# ---- gated residual + LayerNorm + modulation --------------------------------------------------------------------


def gated_modulate_fwd(
    x: Tensor, gate: Tensor, y: Tensor, shift: Tensor, scale: Tensor, eps: float
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    B, L, C = x.shape
    res = x.new_empty(B, L, C)
    out = x.new_empty(B, L, C)
    mean = x.new_empty(B, L, dtype=F32)
    rstd = x.new_empty(B, L, dtype=F32)
    if B * L:
        block = triton.next_power_of_2(C)
        tm.gated_modulate_fwd[(L, B)](
            x, gate, y, shift, scale, res, out, mean, rstd, L, C, x.stride(0), x.stride(1), gate.stride(0),
            y.stride(0), y.stride(1), shift.stride(0), scale.stride(0), res.stride(0), res.stride(1),
            out.stride(0), out.stride(1), eps, BLOCK_C=block, RTNE=_RTNE, num_warps=_warps(block),
        )  # fmt: skip
    return res, out, mean, rstd


def _gated_modulate_fwd_fake(x, gate, y, shift, scale, eps):
    B, L, C = x.shape
    return x.new_empty(B, L, C), x.new_empty(B, L, C), x.new_empty(B, L, dtype=F32), x.new_empty(B, L, dtype=F32)


def gated_modulate_bwd(
    dres: Tensor | None, dout: Tensor, x: Tensor, gate: Tensor, y: Tensor, scale: Tensor, mean: Tensor,
    rstd: Tensor, need_dgate: bool, need_dss: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    B, L, C = x.shape
    dx = torch.empty_like(x, memory_format=torch.contiguous_format)
    dy = torch.empty_like(y, memory_format=torch.contiguous_format)
    progs, rows = _row_split(x.device, B, L, need_dgate or need_dss)
    dg = x.new_empty(B * progs, C, dtype=F32) if need_dgate else mean  # every program writes its row
    dsc = x.new_empty(B * progs, C, dtype=F32) if need_dss else mean
    dsh = x.new_empty(B * progs, C, dtype=F32) if need_dss else mean
    dr = dout if dres is None else dres
    if B * L:
        block = triton.next_power_of_2(C)
        tm.gated_modulate_bwd[(progs, B)](
            dr, dout, x, gate, y, scale, mean, rstd, dx, dy, dg, dsc, dsh, L, C, rows, progs,
            dr.stride(0), dr.stride(1), dout.stride(0), dout.stride(1), x.stride(0), x.stride(1), gate.stride(0),
            y.stride(0), y.stride(1), scale.stride(0), dx.stride(0), dx.stride(1), dy.stride(0), dy.stride(1),
            BLOCK_C=block, HAS_DRES=dres is not None, COMPUTE_DG=need_dgate, COMPUTE_DSS=need_dss, RTNE=_RTNE,
            num_warps=_warps(block, bwd=True),
        )  # fmt: skip

    def total(parts: Tensor, need: bool) -> Tensor:
        if not need:
            return _none(x)
        return _sum_parts(parts, B) if B * L else x.new_zeros(B, 1, C, dtype=F32)

    return dx, dy, total(dg, need_dgate), total(dsh, need_dss), total(dsc, need_dss)


def _gated_modulate_bwd_fake(dres, dout, x, gate, y, scale, mean, rstd, need_dgate, need_dss):
    B, _, C = x.shape
    g, ss = ((B, 1, C) if need_dgate else (0,)), ((B, 1, C) if need_dss else (0,))
    f32 = (x.new_empty(g, dtype=F32), x.new_empty(ss, dtype=F32), x.new_empty(ss, dtype=F32))
    return (torch.empty_like(x), torch.empty_like(y), *f32)


# ---- the single block's linear1 gradient -------------------------------------------------------------------------


def single_qkv_bwd(
    dq: Tensor, dk: Tensor, dv: Tensor, lin1: Tensor, rq: Tensor, rk: Tensor, q_scale: Tensor, k_scale: Tensor,
    pe: Tensor, out: Tensor, d_act: Tensor | None = None,
) -> None:  # fmt: skip
    """Writes the first 3 * H * D columns of `out`, shaped like linear1's output [B, L, 3 * H * D + M]: linear1's
    gradient from q, k, v's ([B, H, L, D]), given the forward's 1/rms of q and k ([B, H, L, 1], fp32). The M
    columns after them: GELU's (tanh) gradient from `d_act` ([B, L, M], the MLP activation's gradient) where it is
    given, else the caller's (single_qkv writes GELU's gradient there, in place, which inductor fuses with whatever
    produces that gradient, straight into the same buffer). As a custom op with a flexible layout, it reads the
    strides of what it gets at run time."""
    if out.shape != lin1.shape or out.stride(-1) != 1:
        raise ValueError(f"out must be shaped {tuple(lin1.shape)} with unit column stride, got {out.stride()}")
    dq, dk, dv, lin1 = (t if t.stride(-1) == 1 else t.contiguous() for t in (dq, dk, dv, lin1))
    B, L, W = lin1.shape
    _, H, _, D = dq.shape
    width = 3 * H * D
    if d_act is not None and d_act.shape != (B, L, W - width):
        raise ValueError(f"d_act must be shaped {(B, L, W - width)}, got {tuple(d_act.shape)}")
    if not (B and L):
        return
    spe_b = _pe_batch_stride(pe)
    bt, bh, warps = _qk_tile(H, D)
    ts.qkv_bwd[(triton.cdiv(L, bt), triton.cdiv(H, bh), B)](
        dq, dk, dv, lin1, rq, rk, q_scale, k_scale, pe, out, L, H,
        dq.stride(0), dq.stride(1), dq.stride(2), dk.stride(0), dk.stride(1), dk.stride(2),
        dv.stride(0), dv.stride(1), dv.stride(2), rq.stride(0), rq.stride(1), rq.stride(2),
        rk.stride(0), rk.stride(1), rk.stride(2),
        lin1.stride(0), lin1.stride(1), out.stride(0), out.stride(1), spe_b, pe.stride(2),
        D=D, BLOCK_T=bt, BLOCK_H=bh, RTNE=_RTNE, num_warps=warps,
    )  # fmt: skip
    if d_act is not None and W > width:
        _gelu_bwd(d_act if d_act.stride(-1) == 1 else d_act.contiguous(), lin1[..., width:], out[..., width:])


GELU_TILE = (4, 1024, 8)  # tokens, columns, warps per program of gelu_bwd: 16 elements a thread


def _gelu_bwd(d_act: Tensor, x: Tensor, out: Tensor) -> None:
    B, L, M = x.shape
    bt, bm, warps = GELU_TILE
    ts.gelu_bwd[(triton.cdiv(L, bt), triton.cdiv(M, bm), B)](
        d_act, x, out, L, M, d_act.stride(0), d_act.stride(1), x.stride(0), x.stride(1), out.stride(0),
        out.stride(1), BLOCK_T=bt, BLOCK_M=bm, RTNE=_RTNE, num_warps=warps,
    )  # fmt: skip


def _single_qkv_bwd_fake(dq, dk, dv, lin1, rq, rk, q_scale, k_scale, pe, out, d_act=None):
    return None


# ---- LoRA gradient row norms ------------------------------------------------------------------------------------


def gram_row_norms(ups: Tensor, d_ups: Tensor, gram: Tensor, scale: float) -> Tensor:
    """|scale| * sqrt(a_i M a_iᵀ) per row i of each of k modules, a_i = [up_i, d_up_i]: ups and d_ups [k, out, r]
    (unit stride on r), gram [k, 2r, 2r] float64 contiguous. Returns [k, out, 1] fp32, computed in float64."""
    k, N, r = ups.shape
    out = torch.empty((k, N, 1), dtype=F32, device=ups.device)
    if not (k and N):
        return out
    R = max(16, triton.next_power_of_2(r))
    block = {16: 64, 32: 32}.get(R, 16)  # ptxas (sm_90, fp32 factors): 95 / ~100 / 255 registers, no spills
    tn.gram_row_norms[(k, triton.cdiv(N, block))](
        ups, d_ups, gram, out, N, r, abs(float(scale)), ups.stride(0), ups.stride(1), d_ups.stride(0),
        d_ups.stride(1), out.stride(0), BLOCK_N=block, R=R, num_warps=4,
    )  # fmt: skip
    return out


LAUNCHERS = {
    "qk_norm_rope_fwd": (qk_norm_rope_fwd, _qk_fwd_fake),
    "qk_norm_rope_bwd": (qk_norm_rope_bwd, _qk_bwd_fake),
    "modulate_fwd": (modulate_fwd, _modulate_fwd_fake),
    "modulate_bwd": (modulate_bwd, _modulate_bwd_fake),
    "gated_residual_fwd": (gated_residual_fwd, _gated_fwd_fake),
    "gated_residual_bwd": (gated_residual_bwd, _gated_bwd_fake),
    "gated_modulate_fwd": (gated_modulate_fwd, _gated_modulate_fwd_fake),
    "gated_modulate_bwd": (gated_modulate_bwd, _gated_modulate_bwd_fake),
    "single_qkv_bwd": (single_qkv_bwd, _single_qkv_bwd_fake),
}
# inductor may hand these any layout (their launchers read the strides at run time): no copies to match the trace's
FLEXIBLE = {"single_qkv_bwd"}
MUTATES = {"single_qkv_bwd": ("out",)}  # the ops that write into a tensor they are given


def define_ops() -> SimpleNamespace:
    """Register every launcher as the custom op `flux_kernels::<name>` with its fake implementation."""
    ops = {}
    for name, (launcher, fake) in LAUNCHERS.items():
        tags = (torch.Tag.flexible_layout,) if name in FLEXIBLE else ()
        op = torch.library.custom_op(f"{NS}::{name}", launcher, mutates_args=MUTATES.get(name, ()), tags=tags)
        op.register_fake(fake)
        ops[name] = getattr(getattr(torch.ops, NS), name).default  # dynamo traces OpOverload calls (not CustomOpDef)
    return SimpleNamespace(**ops)
