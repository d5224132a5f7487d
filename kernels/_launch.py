"""Kernel launches as `torch.library.custom_op`s. Imported by `fast._ops_lib()` on first use: importing this
imports triton, and registers the ops once per process.

(No `from __future__ import annotations` here: custom_op reads the real annotations to build the op schema.)
"""

import functools
from types import SimpleNamespace

import torch
import triton
from torch import Tensor

from flux_kernels import tl_modulate as tm
from flux_kernels import tl_qk_norm_rope as tq
from flux_kernels.device import triton_interpreting

NS = "flux_kernels"
# The CPU interpreter truncates fp32 -> bf16; round to nearest-even by hand there so it matches GPUs.
_RTNE = triton_interpreting()


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 2  # the CPU interpreter: few programs, each looping over many rows


def _row_split(device: torch.device, B: int, L: int, reduce: bool) -> tuple[int, int]:
    """(programs per batch element, rows per program) for the backward kernels. Reducing over L (the modulation
    vectors need gradients, as when LoRA trains the Modulation layers, sd-scripts' default): about two programs
    per SM in all, so the fp32 partial rows summed afterwards stay ~8% of the traffic. Otherwise one row each."""
    if not reduce or not L:
        return max(L, 1), 1
    want = max(1, min(L, triton.cdiv(2 * _sm_count(device), B)))
    rows = triton.cdiv(L, want)
    return triton.cdiv(L, rows), rows


def _warps(block: int, bwd: bool = False) -> int:
    """Warps per program for one hidden-size row. From ptxas register counts (triton 3.7, sm_90, bf16, C=3072):
    a 4096-wide backward needs 16 warps to stay near 64-108 registers; no configuration spills. Not yet tuned
    by measurement."""
    if block >= 4096:
        return 16 if bwd else 8
    return 8 if block >= 2048 else 4


def _empty_dq(q: Tensor) -> Tensor:
    """A [B, H, L, D] gradient laid out [B, L, H, D] in memory, like the q/k views of the qkv projection it
    flows back into (each token's heads are one contiguous run: coalesced stores)."""
    B, H, L, D = q.shape
    return q.new_empty(B, L, H, D).permute(0, 2, 1, 3)


def define_ops() -> SimpleNamespace:
    @torch.library.custom_op(f"{NS}::qk_norm_rope_fwd", mutates_args=())
    def qk_norm_rope_fwd(
        qs: list[Tensor], ks: list[Tensor], qws: list[Tensor], kws: list[Tensor], pe: Tensor, eps: float
    ) -> tuple[Tensor, Tensor]:
        B, H, _, D = qs[0].shape
        total = sum(q.shape[2] for q in qs)
        q_out = qs[0].new_empty(B, H, total, D)
        k_out = qs[0].new_empty(B, H, total, D)
        spe_b = pe.stride(0) if pe.shape[0] > 1 else 0
        l_off = 0
        for q, k, qw, kw in zip(qs, ks, qws, kws, strict=True):
            L = q.shape[2]
            if L:
                tq.qk_norm_rope_fwd[(L, B)](
                    q, k, qw, kw, pe, q_out, k_out, L, H, l_off,
                    q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
                    q_out.stride(0), q_out.stride(1), q_out.stride(2), spe_b, pe.stride(2), eps,
                    D=D, HALF=D // 2, BLOCK_H=triton.next_power_of_2(H), BLOCK_J=triton.next_power_of_2(D // 2),
                    RTNE=_RTNE, num_warps=8,
                )  # fmt: skip
            l_off += L
        return q_out, k_out

    @qk_norm_rope_fwd.register_fake
    def _(qs, ks, qws, kws, pe, eps):
        B, H, _, D = qs[0].shape
        total = sum(q.shape[2] for q in qs)
        return qs[0].new_empty(B, H, total, D), qs[0].new_empty(B, H, total, D)

    @torch.library.custom_op(f"{NS}::qk_norm_rope_bwd", mutates_args=())
    def qk_norm_rope_bwd(
        dq_out: Tensor, dk_out: Tensor, qs: list[Tensor], ks: list[Tensor], qws: list[Tensor], kws: list[Tensor],
        pe: Tensor, eps: float, need_dw: bool,
    ) -> list[Tensor]:  # fmt: skip
        B, H, _, D = qs[0].shape
        spe_b = pe.stride(0) if pe.shape[0] > 1 else 0
        grads, dws = [], []
        l_off = 0
        for q, k, qw, kw in zip(qs, ks, qws, kws, strict=True):
            L = q.shape[2]
            dq, dk = _empty_dq(q), _empty_dq(k)
            rows = B * L if need_dw else 1
            dqw = torch.zeros(rows, D, device=q.device, dtype=torch.float32)
            dkw = torch.zeros(rows, D, device=q.device, dtype=torch.float32)
            if L:
                tq.qk_norm_rope_bwd[(L, B)](
                    dq_out, dk_out, q, k, qw, kw, pe, dq, dk, dqw, dkw, L, H, l_off,
                    dq_out.stride(0), dq_out.stride(1), dq_out.stride(2),
                    dk_out.stride(0), dk_out.stride(1), dk_out.stride(2),
                    q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
                    dq.stride(0), dq.stride(1), dq.stride(2), spe_b, pe.stride(2), eps,
                    D=D, HALF=D // 2, BLOCK_H=triton.next_power_of_2(H), BLOCK_J=triton.next_power_of_2(D // 2),
                    COMPUTE_DW=need_dw, RTNE=_RTNE, num_warps=8,
                )  # fmt: skip
            grads += [dq, dk]
            dws += [dqw.sum(0), dkw.sum(0)] if need_dw else [dqw.new_empty(0), dkw.new_empty(0)]  # never aliased
            l_off += L
        return grads + dws

    @qk_norm_rope_bwd.register_fake
    def _(dq_out, dk_out, qs, ks, qws, kws, pe, eps, need_dw):
        grads, dws = [], []
        for q, k in zip(qs, ks, strict=True):
            grads += [_empty_dq(q), _empty_dq(k)]
            n = q.shape[-1] if need_dw else 0
            dws += [q.new_empty(n, dtype=torch.float32), q.new_empty(n, dtype=torch.float32)]
        return grads + dws

    @torch.library.custom_op(f"{NS}::modulate_fwd", mutates_args=())
    def modulate_fwd(x: Tensor, shift: Tensor, scale: Tensor, eps: float) -> tuple[Tensor, Tensor, Tensor]:
        B, L, C = x.shape
        dtype = torch.promote_types(torch.promote_types(x.dtype, shift.dtype), scale.dtype)
        out = x.new_empty(B, L, C, dtype=dtype)
        mean = x.new_empty(B, L, dtype=torch.float32)
        rstd = x.new_empty(B, L, dtype=torch.float32)
        if B * L:
            block = triton.next_power_of_2(C)
            tm.modulate_fwd[(L, B)](
                x, shift, scale, out, mean, rstd, L, C, x.stride(0), x.stride(1), shift.stride(0), scale.stride(0),
                out.stride(0), out.stride(1), eps, BLOCK_C=block, RTNE=_RTNE, num_warps=_warps(block),
            )  # fmt: skip
        return out, mean, rstd

    @modulate_fwd.register_fake
    def _(x, shift, scale, eps):
        B, L, C = x.shape
        dtype = torch.promote_types(torch.promote_types(x.dtype, shift.dtype), scale.dtype)
        f32 = torch.float32
        return x.new_empty(B, L, C, dtype=dtype), x.new_empty(B, L, dtype=f32), x.new_empty(B, L, dtype=f32)

    @torch.library.custom_op(f"{NS}::modulate_bwd", mutates_args=())
    def modulate_bwd(
        dout: Tensor, x: Tensor, scale: Tensor, mean: Tensor, rstd: Tensor, need_dss: bool
    ) -> tuple[Tensor, Tensor, Tensor]:
        B, L, C = x.shape
        dx = torch.empty_like(x, memory_format=torch.contiguous_format)
        progs, rows = _row_split(x.device, B, L, need_dss)
        parts = B * progs if need_dss else 1
        dsc = x.new_zeros(parts, C, dtype=torch.float32)
        dsh = x.new_zeros(parts, C, dtype=torch.float32)
        if B * L:
            block = triton.next_power_of_2(C)
            tm.modulate_bwd[(progs, B)](
                dout, x, scale, mean, rstd, dx, dsc, dsh, L, C, rows, progs,
                dout.stride(0), dout.stride(1), x.stride(0), x.stride(1), scale.stride(0), dx.stride(0), dx.stride(1),
                BLOCK_C=block, COMPUTE_DSS=need_dss, RTNE=_RTNE, num_warps=_warps(block, bwd=True),
            )  # fmt: skip
        if not need_dss:
            return dx, x.new_empty(0, dtype=torch.float32), x.new_empty(0, dtype=torch.float32)
        return dx, dsh.view(B, progs, C).sum(1, keepdim=True), dsc.view(B, progs, C).sum(1, keepdim=True)

    @modulate_bwd.register_fake
    def _(dout, x, scale, mean, rstd, need_dss):
        B, L, C = x.shape
        shape = (B, 1, C) if need_dss else (0,)
        f32 = torch.float32
        return torch.empty_like(x), x.new_empty(shape, dtype=f32), x.new_empty(shape, dtype=f32)

    @torch.library.custom_op(f"{NS}::gated_residual_fwd", mutates_args=())
    def gated_fwd(x: Tensor, gate: Tensor, y: Tensor) -> Tensor:
        B, L, C = x.shape
        out = x.new_empty(B, L, C, dtype=torch.promote_types(torch.promote_types(x.dtype, gate.dtype), y.dtype))
        if B * L:
            block = triton.next_power_of_2(C)
            tm.gated_fwd[(L, B)](
                x, gate, y, out, C, x.stride(0), x.stride(1), gate.stride(0), y.stride(0), y.stride(1),
                out.stride(0), out.stride(1), BLOCK_C=block, RTNE=_RTNE, num_warps=_warps(block),
            )  # fmt: skip
        return out

    @gated_fwd.register_fake
    def _(x, gate, y):
        dtype = torch.promote_types(torch.promote_types(x.dtype, gate.dtype), y.dtype)
        return x.new_empty(x.shape, dtype=dtype)

    @torch.library.custom_op(f"{NS}::gated_residual_bwd", mutates_args=())
    def gated_bwd(dout: Tensor, gate: Tensor, y: Tensor, need_dgate: bool) -> tuple[Tensor, Tensor]:
        B, L, C = y.shape
        dy = torch.empty_like(y, memory_format=torch.contiguous_format)
        progs, rows = _row_split(y.device, B, L, need_dgate)
        dg = y.new_zeros(B * progs if need_dgate else 1, C, dtype=torch.float32)
        if B * L:
            block = triton.next_power_of_2(C)
            tm.gated_bwd[(progs, B)](
                dout, gate, y, dy, dg, L, C, rows, progs, dout.stride(0), dout.stride(1), gate.stride(0),
                y.stride(0), y.stride(1), dy.stride(0), dy.stride(1),
                BLOCK_C=block, COMPUTE_DGATE=need_dgate, RTNE=_RTNE, num_warps=_warps(block, bwd=True),
            )  # fmt: skip
        if not need_dgate:
            return dy, y.new_empty(0, dtype=torch.float32)
        return dy, dg.view(B, progs, C).sum(1, keepdim=True)

    @gated_bwd.register_fake
    def _(dout, gate, y, need_dgate):
        B, _, C = y.shape
        return torch.empty_like(y), y.new_empty((B, 1, C) if need_dgate else (0,), dtype=torch.float32)

    return SimpleNamespace(
        qk_norm_rope_fwd=qk_norm_rope_fwd,
        qk_norm_rope_bwd=qk_norm_rope_bwd,
        modulate_fwd=modulate_fwd,
        modulate_bwd=modulate_bwd,
        gated_fwd=gated_fwd,
        gated_bwd=gated_bwd,
    )
