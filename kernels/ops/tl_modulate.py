"""Triton kernels: LayerNorm (no affine) + `(1 + scale) * x + shift`, the gated residual `x + gate * y`, and both
in one pass where the block modulates the residual it has just updated (imported only by `fast.py`, lazily).

Forward: one program per row (b, tok) over the whole hidden dim C (3072 -> a 4096-wide tile), statistics in fp32,
one rounding at the end. The reference path writes the LayerNorm output, `1 + scale`, the product and the sum
as four separate tensors. LayerNorm keeps mean and rstd per row (8 bytes) for its backward.

Backward: the modulation vectors are per batch row [B, 1, C], so their gradients are sums over L. A program
owns a run of rows of one batch element and accumulates those sums in fp32 registers; the few partial rows
are summed by torch afterwards (Liger-Kernel's RMSNorm does the same for its weight gradient).
  modulate: g = dy * (1 + scale), dx = rstd * (g - mean(g) - xn * mean(g * xn)), dscale = sum dy * xn,
            dshift = sum dy.
  gated:    dx = dy (no kernel), dy_in = dy * gate, dgate = sum dy * y.
  gated + modulate (res = x + gate * y, out = modulate(res)): one pass over dres, dout, x, y; the residual is
            recomputed from x and y rather than kept for backward (see gated_modulate_bwd).
"""

import triton
import triton.language as tl

from flux_kernels.ops.tl_common import cast, total


@triton.jit
def modulated_norm(v, m, C, eps, shift_ptrs, scale_ptrs):
    """(1 + scale) * LayerNorm(v) + shift of one fp32 row (lanes outside m hold 0): (out, mean, rstd). The modulation
    vectors are loaded after the two reductions, so they are not held in registers across them."""
    mean = total(v, 0) / C
    vc = tl.where(m, v - mean, 0.0)
    rstd = tl.rsqrt(total(vc * vc, 0) / C + eps)
    sh = tl.load(shift_ptrs, mask=m, other=0.0).to(tl.float32)
    sc = tl.load(scale_ptrs, mask=m, other=0.0).to(tl.float32)
    return (1.0 + sc) * (vc * rstd) + sh, mean, rstd


@triton.jit
def gated_sum(x_ptrs, gate_ptrs, y_ptrs, m):
    """x + gate * y of one row, in fp32 (the gated residual, before its one rounding)."""
    x = tl.load(x_ptrs, mask=m, other=0.0).to(tl.float32)
    g = tl.load(gate_ptrs, mask=m, other=0.0).to(tl.float32)
    y = tl.load(y_ptrs, mask=m, other=0.0).to(tl.float32)
    return x + g * y


@triton.jit
def norm_grad(g, xn, rstd, C):
    """Input gradient of LayerNorm (no affine) for the gradient g of its output and the normalised row xn."""
    return rstd * (g - total(g, 0) / C - xn * (total(g * xn, 0) / C))


@triton.jit
def modulate_fwd(
    x_ptr, shift_ptr, scale_ptr, out_ptr, mean_ptr, rstd_ptr,
    L, C, sx_b, sx_l, ssh_b, ssc_b, so_b, so_l, eps,
    BLOCK_C: tl.constexpr, RTNE: tl.constexpr,
):  # fmt: skip
    tok = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1).to(tl.int64)
    offs = tl.arange(0, BLOCK_C)
    m = offs < C
    x = tl.load(x_ptr + b * sx_b + tok * sx_l + offs, mask=m, other=0.0).to(tl.float32)
    y, mean, rstd = modulated_norm(x, m, C, eps, shift_ptr + b * ssh_b + offs, scale_ptr + b * ssc_b + offs)
    tl.store(out_ptr + b * so_b + tok * so_l + offs, cast(y, out_ptr.dtype.element_ty, RTNE), mask=m)
    tl.store(mean_ptr + b * L + tok, mean)
    tl.store(rstd_ptr + b * L + tok, rstd)


@triton.jit
def modulate_bwd(
    dy_ptr, x_ptr, scale_ptr, mean_ptr, rstd_ptr, dx_ptr, dsc_part_ptr, dsh_part_ptr,
    L, C, rows_per_prog, n_progs,
    sdy_b, sdy_l, sx_b, sx_l, ssc_b, sdx_b, sdx_l,
    BLOCK_C: tl.constexpr, COMPUTE_DSS: tl.constexpr, RTNE: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1).to(tl.int64)
    offs = tl.arange(0, BLOCK_C)
    m = offs < C
    sc1 = 1.0 + tl.load(scale_ptr + b * ssc_b + offs, mask=m, other=0.0).to(tl.float32)
    acc_sc = tl.full([BLOCK_C], 0.0, tl.float32)
    acc_sh = tl.full([BLOCK_C], 0.0, tl.float32)
    for i in range(0, rows_per_prog):  # rows past L are masked out (a fixed trip count, no data-dependent bounds)
        tok = pid * rows_per_prog + i
        valid = tok < L
        mv = m & valid
        x = tl.load(x_ptr + b * sx_b + tok * sx_l + offs, mask=mv, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + b * sdy_b + tok * sdy_l + offs, mask=mv, other=0.0).to(tl.float32)
        mean = tl.load(mean_ptr + b * L + tok, mask=valid, other=0.0)
        rstd = tl.load(rstd_ptr + b * L + tok, mask=valid, other=0.0)
        xn = tl.where(mv, (x - mean) * rstd, 0.0)
        dx = norm_grad(dy * sc1, xn, rstd, C)
        tl.store(dx_ptr + b * sdx_b + tok * sdx_l + offs, cast(dx, dx_ptr.dtype.element_ty, RTNE), mask=mv)
        if COMPUTE_DSS:
            acc_sc += dy * xn
            acc_sh += dy
    if COMPUTE_DSS:
        part = (b * n_progs + pid) * C
        tl.store(dsc_part_ptr + part + offs, acc_sc, mask=m)
        tl.store(dsh_part_ptr + part + offs, acc_sh, mask=m)


@triton.jit
def gated_fwd(
    x_ptr, gate_ptr, y_ptr, out_ptr,
    C, sx_b, sx_l, sg_b, sy_b, sy_l, so_b, so_l,
    BLOCK_C: tl.constexpr, RTNE: tl.constexpr,
):  # fmt: skip
    tok = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1).to(tl.int64)
    offs = tl.arange(0, BLOCK_C)
    m = offs < C
    row_x, row_y = x_ptr + b * sx_b + tok * sx_l + offs, y_ptr + b * sy_b + tok * sy_l + offs
    s = gated_sum(row_x, gate_ptr + b * sg_b + offs, row_y, m)
    tl.store(out_ptr + b * so_b + tok * so_l + offs, cast(s, out_ptr.dtype.element_ty, RTNE), mask=m)


@triton.jit
def gated_bwd(
    do_ptr, gate_ptr, y_ptr, dy_ptr, dg_part_ptr,
    L, C, rows_per_prog, n_progs,
    sdo_b, sdo_l, sg_b, sy_b, sy_l, sdy_b, sdy_l,
    BLOCK_C: tl.constexpr, COMPUTE_DGATE: tl.constexpr, RTNE: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1).to(tl.int64)
    offs = tl.arange(0, BLOCK_C)
    m = offs < C
    g = tl.load(gate_ptr + b * sg_b + offs, mask=m, other=0.0).to(tl.float32)
    acc = tl.full([BLOCK_C], 0.0, tl.float32)
    for i in range(0, rows_per_prog):
        tok = pid * rows_per_prog + i
        mv = m & (tok < L)
        do = tl.load(do_ptr + b * sdo_b + tok * sdo_l + offs, mask=mv, other=0.0).to(tl.float32)
        tl.store(dy_ptr + b * sdy_b + tok * sdy_l + offs, cast(do * g, dy_ptr.dtype.element_ty, RTNE), mask=mv)
        if COMPUTE_DGATE:
            y = tl.load(y_ptr + b * sy_b + tok * sy_l + offs, mask=mv, other=0.0).to(tl.float32)
            acc += do * y
    if COMPUTE_DGATE:
        tl.store(dg_part_ptr + (b * n_progs + pid) * C + offs, acc, mask=m)


@triton.jit
def gated_modulate_fwd(
    x_ptr, gate_ptr, y_ptr, shift_ptr, scale_ptr, res_ptr, out_ptr, mean_ptr, rstd_ptr,
    L, C, sx_b, sx_l, sg_b, sy_b, sy_l, ssh_b, ssc_b, sr_b, sr_l, so_b, so_l, eps,
    BLOCK_C: tl.constexpr, RTNE: tl.constexpr,
):  # fmt: skip
    """res = x + gate * y (rounded once, stored: the residual stream), out = (1 + scale) * LayerNorm(res) + shift."""
    tok = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1).to(tl.int64)
    offs = tl.arange(0, BLOCK_C)
    m = offs < C
    row_x, row_y = x_ptr + b * sx_b + tok * sx_l + offs, y_ptr + b * sy_b + tok * sy_l + offs
    s = gated_sum(row_x, gate_ptr + b * sg_b + offs, row_y, m)
    res = cast(s, res_ptr.dtype.element_ty, RTNE)
    tl.store(res_ptr + b * sr_b + tok * sr_l + offs, res, mask=m)
    r = res.to(tl.float32)  # LayerNorm sees the stored (rounded) residual, as in the unfused block
    out, mean, rstd = modulated_norm(r, m, C, eps, shift_ptr + b * ssh_b + offs, scale_ptr + b * ssc_b + offs)
    tl.store(out_ptr + b * so_b + tok * so_l + offs, cast(out, out_ptr.dtype.element_ty, RTNE), mask=m)
    tl.store(mean_ptr + b * L + tok, mean)
    tl.store(rstd_ptr + b * L + tok, rstd)


@triton.jit
def gated_modulate_bwd(
    dres_ptr, dout_ptr, x_ptr, gate_ptr, y_ptr, scale_ptr, mean_ptr, rstd_ptr, dx_ptr, dy_ptr,
    dg_part_ptr, dsc_part_ptr, dsh_part_ptr,
    L, C, rows_per_prog, n_progs,
    sdr_b, sdr_l, sdo_b, sdo_l, sx_b, sx_l, sg_b, sy_b, sy_l, ssc_b, sdx_b, sdx_l, sdy_b, sdy_l,
    BLOCK_C: tl.constexpr, HAS_DRES: tl.constexpr, COMPUTE_DG: tl.constexpr, COMPUTE_DSS: tl.constexpr,
    RTNE: tl.constexpr,
):  # fmt: skip
    """The residual is recomputed from x and y (both kept for backward anyway) instead of being saved:
    d = dres + LayerNorm'(dout * (1 + scale)); dx = d, dy = d * gate, dgate = sum d * y, dscale = sum dout * xn,
    dshift = sum dout, the sums over this program's rows in fp32 registers."""
    pid = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1).to(tl.int64)
    offs = tl.arange(0, BLOCK_C)
    m = offs < C
    g = tl.load(gate_ptr + b * sg_b + offs, mask=m, other=0.0).to(tl.float32)
    sc1 = 1.0 + tl.load(scale_ptr + b * ssc_b + offs, mask=m, other=0.0).to(tl.float32)
    acc_g = tl.full([BLOCK_C], 0.0, tl.float32)
    acc_sc = tl.full([BLOCK_C], 0.0, tl.float32)
    acc_sh = tl.full([BLOCK_C], 0.0, tl.float32)
    for i in range(0, rows_per_prog):
        tok = pid * rows_per_prog + i
        valid = tok < L
        mv = m & valid
        x = tl.load(x_ptr + b * sx_b + tok * sx_l + offs, mask=mv, other=0.0).to(tl.float32)
        y = tl.load(y_ptr + b * sy_b + tok * sy_l + offs, mask=mv, other=0.0).to(tl.float32)
        do = tl.load(dout_ptr + b * sdo_b + tok * sdo_l + offs, mask=mv, other=0.0).to(tl.float32)
        mean = tl.load(mean_ptr + b * L + tok, mask=valid, other=0.0)
        rstd = tl.load(rstd_ptr + b * L + tok, mask=valid, other=0.0)
        r = cast(x + g * y, dx_ptr.dtype.element_ty, RTNE).to(tl.float32)
        xn = tl.where(mv, (r - mean) * rstd, 0.0)
        d = norm_grad(do * sc1, xn, rstd, C)
        if HAS_DRES:
            d += tl.load(dres_ptr + b * sdr_b + tok * sdr_l + offs, mask=mv, other=0.0).to(tl.float32)
        tl.store(dx_ptr + b * sdx_b + tok * sdx_l + offs, cast(d, dx_ptr.dtype.element_ty, RTNE), mask=mv)
        tl.store(dy_ptr + b * sdy_b + tok * sdy_l + offs, cast(d * g, dy_ptr.dtype.element_ty, RTNE), mask=mv)
        if COMPUTE_DG:
            acc_g += d * y
        if COMPUTE_DSS:
            acc_sc += do * xn
            acc_sh += do
    part = (b * n_progs + pid) * C
    if COMPUTE_DG:
        tl.store(dg_part_ptr + part + offs, acc_g, mask=m)
    if COMPUTE_DSS:
        tl.store(dsc_part_ptr + part + offs, acc_sc, mask=m)
        tl.store(dsh_part_ptr + part + offs, acc_sh, mask=m)
