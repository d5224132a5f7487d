"""Triton kernels: QK-RMSNorm + RoPE in one pass over q and k (imported only by `fast.py`, lazily).

One program per token (b, tok): it loads the token's `pe` row once (D/2 2x2 matrices) and all H heads of q and k
as [H, D/2] tiles of even and odd elements, so RoPE's pairs (x[2i], x[2i+1]) sit in the same lane. Per head:
fp32 RMS, times the fp32 scale, rounded to the output dtype (QKNorm returns that dtype and apply_rope reads it
back as fp32: rounding here keeps the forward bit-compatible), then rotated and stored once. The reference
path reads q/k about ten times in fp32; this reads them once and writes once.

Backward recomputes rrms from x (cheaper than storing it) and uses the rotation's transpose:
  dy = R^T dout,  g = dy * w,  dx = rrms * g - x * rrms^3 * mean(g * x),  dw = sum over rows of dy * x * rrms.
The rounding between norm and rope is treated as identity, as autograd does for `.to(dtype)`.
"""

import triton
import triton.language as tl

from flux_kernels.tl_common import cast, total


@triton.jit
def _load_pe(pe_row, offs_j, mask_j):
    base = pe_row + offs_j * 4
    f00 = tl.load(base + 0, mask=mask_j, other=0.0)
    f01 = tl.load(base + 1, mask=mask_j, other=0.0)
    f10 = tl.load(base + 2, mask=mask_j, other=0.0)
    f11 = tl.load(base + 3, mask=mask_j, other=0.0)
    return f00[None, :], f01[None, :], f10[None, :], f11[None, :]


@triton.jit
def _fwd_tile(
    x_row, s_h, w_ptr, o_row, so_h, f00, f01, f10, f11, offs_h, offs_j, mask, mask_j, eps,
    D: tl.constexpr, RTNE: tl.constexpr,
):  # fmt: skip
    ptr = x_row + offs_h[:, None] * s_h + 2 * offs_j[None, :]
    xe = tl.load(ptr, mask=mask, other=0.0).to(tl.float32)
    xo = tl.load(ptr + 1, mask=mask, other=0.0).to(tl.float32)
    rrms = tl.rsqrt((total(xe * xe, 1) + total(xo * xo, 1)) / D + eps)[:, None]
    we = tl.load(w_ptr + 2 * offs_j, mask=mask_j, other=0.0).to(tl.float32)[None, :]
    wo = tl.load(w_ptr + 2 * offs_j + 1, mask=mask_j, other=0.0).to(tl.float32)[None, :]
    out_ty = o_row.dtype.element_ty
    ye = cast((xe * rrms) * we, out_ty, RTNE).to(tl.float32)
    yo = cast((xo * rrms) * wo, out_ty, RTNE).to(tl.float32)
    optr = o_row + offs_h[:, None] * so_h + 2 * offs_j[None, :]
    tl.store(optr, cast(f00 * ye + f01 * yo, out_ty, RTNE), mask=mask)
    tl.store(optr + 1, cast(f10 * ye + f11 * yo, out_ty, RTNE), mask=mask)


@triton.jit
def qk_norm_rope_fwd(
    q_ptr, k_ptr, qw_ptr, kw_ptr, pe_ptr, qo_ptr, ko_ptr,
    L, H, l_off,
    sq_b, sq_h, sq_l, sk_b, sk_h, sk_l,
    so_b, so_h, so_l,
    spe_b, spe_l,
    eps,
    D: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_J: tl.constexpr, RTNE: tl.constexpr,
):  # fmt: skip
    tok = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_j = tl.arange(0, BLOCK_J)
    mask_j = offs_j < HALF
    mask = (offs_h[:, None] < H) & mask_j[None, :]
    f00, f01, f10, f11 = _load_pe(pe_ptr + b * spe_b + (l_off + tok) * spe_l, offs_j, mask_j)
    o_off = b * so_b + (l_off + tok) * so_l
    _fwd_tile(q_ptr + b * sq_b + tok * sq_l, sq_h, qw_ptr, qo_ptr + o_off, so_h,
              f00, f01, f10, f11, offs_h, offs_j, mask, mask_j, eps, D, RTNE)  # fmt: skip
    _fwd_tile(k_ptr + b * sk_b + tok * sk_l, sk_h, kw_ptr, ko_ptr + o_off, so_h,
              f00, f01, f10, f11, offs_h, offs_j, mask, mask_j, eps, D, RTNE)  # fmt: skip


@triton.jit
def _bwd_tile(
    x_row, s_h, w_ptr, do_row, sdo_h, dx_row, sdx_h, dw_row,
    f00, f01, f10, f11, offs_h, offs_j, mask, mask_j, eps,
    D: tl.constexpr, COMPUTE_DW: tl.constexpr, RTNE: tl.constexpr,
):  # fmt: skip
    ptr = x_row + offs_h[:, None] * s_h + 2 * offs_j[None, :]
    xe = tl.load(ptr, mask=mask, other=0.0).to(tl.float32)
    xo = tl.load(ptr + 1, mask=mask, other=0.0).to(tl.float32)
    rrms = tl.rsqrt((total(xe * xe, 1) + total(xo * xo, 1)) / D + eps)[:, None]
    dptr = do_row + offs_h[:, None] * sdo_h + 2 * offs_j[None, :]
    de = tl.load(dptr, mask=mask, other=0.0).to(tl.float32)
    do = tl.load(dptr + 1, mask=mask, other=0.0).to(tl.float32)
    dye = f00 * de + f10 * do
    dyo = f01 * de + f11 * do
    we = tl.load(w_ptr + 2 * offs_j, mask=mask_j, other=0.0).to(tl.float32)[None, :]
    wo = tl.load(w_ptr + 2 * offs_j + 1, mask=mask_j, other=0.0).to(tl.float32)[None, :]
    ge = dye * we
    go = dyo * wo
    c = ((total(ge * xe, 1) + total(go * xo, 1)) / D)[:, None]
    r3 = rrms * rrms * rrms
    out_ty = dx_row.dtype.element_ty
    xptr = dx_row + offs_h[:, None] * sdx_h + 2 * offs_j[None, :]
    tl.store(xptr, cast(rrms * ge - xe * r3 * c, out_ty, RTNE), mask=mask)
    tl.store(xptr + 1, cast(rrms * go - xo * r3 * c, out_ty, RTNE), mask=mask)
    if COMPUTE_DW:
        tl.store(dw_row + 2 * offs_j, total(dye * xe * rrms, 0), mask=mask_j)
        tl.store(dw_row + 2 * offs_j + 1, total(dyo * xo * rrms, 0), mask=mask_j)


@triton.jit
def qk_norm_rope_bwd(
    dqo_ptr, dko_ptr, q_ptr, k_ptr, qw_ptr, kw_ptr, pe_ptr, dq_ptr, dk_ptr, dqw_ptr, dkw_ptr,
    L, H, l_off,
    sdqo_b, sdqo_h, sdqo_l, sdko_b, sdko_h, sdko_l,
    sq_b, sq_h, sq_l, sk_b, sk_h, sk_l,
    sd_b, sd_h, sd_l,
    spe_b, spe_l,
    eps,
    D: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_J: tl.constexpr, COMPUTE_DW: tl.constexpr,
    RTNE: tl.constexpr,
):  # fmt: skip
    tok = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_j = tl.arange(0, BLOCK_J)
    mask_j = offs_j < HALF
    mask = (offs_h[:, None] < H) & mask_j[None, :]
    f00, f01, f10, f11 = _load_pe(pe_ptr + b * spe_b + (l_off + tok) * spe_l, offs_j, mask_j)
    row = b * L + tok  # this token's row in the [B*L, D] partial-dw buffers
    d_off = b * sd_b + tok * sd_l
    _bwd_tile(q_ptr + b * sq_b + tok * sq_l, sq_h, qw_ptr, dqo_ptr + b * sdqo_b + (l_off + tok) * sdqo_l, sdqo_h,
              dq_ptr + d_off, sd_h, dqw_ptr + row * D,
              f00, f01, f10, f11, offs_h, offs_j, mask, mask_j, eps, D, COMPUTE_DW, RTNE)  # fmt: skip
    _bwd_tile(k_ptr + b * sk_b + tok * sk_l, sk_h, kw_ptr, dko_ptr + b * sdko_b + (l_off + tok) * sdko_l, sdko_h,
              dk_ptr + d_off, sd_h, dkw_ptr + row * D,
              f00, f01, f10, f11, offs_h, offs_j, mask, mask_j, eps, D, COMPUTE_DW, RTNE)  # fmt: skip
