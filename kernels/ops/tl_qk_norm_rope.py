"""Triton kernels: QK-RMSNorm + RoPE in one pass over q and k (imported only by `fast.py`, lazily).

A program owns a [BLOCK_T tokens, BLOCK_H heads, D] tile of q and the same tile of k. Each (token, head) row of
D elements is contiguous in memory (q/k are views of the qkv projection, the outputs are [B, H, L, D]), so rows
are loaded and stored whole, in 16-byte vectors; RoPE's pairs (x[2i], x[2i+1]) are separated in registers with
`tl.split` and put back with `tl.join` instead of stride-2 loads. The tokens' `pe` rows (D/2 2x2 fp32 matrices)
are loaded once per tile and shared by its heads. Per row: fp32 RMS, times the fp32 scale, rounded to the output
dtype (QKNorm returns that dtype and apply_rope reads it back as fp32: rounding here keeps the forward
bit-compatible with sd-scripts), rotated, stored once. The reference path reads q/k about ten times in fp32.

Backward recomputes rrms from x (cheaper than storing it) and uses the rotation's transpose:
  dy = R^T dout,  g = dy * w,  dx = rrms * g - x * rrms^3 * mean(g * x),  dw = sum over rows of dy * x * rrms.
The rounding between norm and rope is treated as identity, as autograd does for `.to(dtype)`.
"""

import triton
import triton.language as tl

from flux_kernels.ops.tl_common import cast, total


@triton.jit
def _pe_tile(pe_row0, s_l, offs_t, mask_t, BLOCK_T: tl.constexpr, HALF: tl.constexpr):
    """The rotation entries f[r][c] of BLOCK_T tokens as [BLOCK_T, 1, HALF] tiles (pe is [..., L, HALF, 2, 2])."""
    offs = offs_t[:, None, None] * s_l + tl.arange(0, HALF)[None, :, None] * 4 + tl.arange(0, 4)[None, None, :]
    p = tl.load(pe_row0 + offs, mask=mask_t[:, None, None], other=0.0)
    c0, c1 = tl.split(tl.reshape(p, [BLOCK_T, HALF, 2, 2]))  # column 0 / 1 of each 2x2, indexed by row
    f00, f10 = tl.split(c0)
    f01, f11 = tl.split(c1)
    return f00[:, None, :], f01[:, None, :], f10[:, None, :], f11[:, None, :]


@triton.jit
def _fwd_tile(
    x_ptr, x_offs, w_ptr, o_ptr, o_offs, mask, f00, f01, f10, f11, eps,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr, RTNE: tl.constexpr,
):  # fmt: skip
    x = tl.load(x_ptr + x_offs, mask=mask, other=0.0).to(tl.float32)
    rrms = tl.rsqrt(total(x * x, 2) / D + eps)[:, :, None]
    w = tl.load(w_ptr + tl.arange(0, D)).to(tl.float32)[None, None, :]
    out_ty = o_ptr.dtype.element_ty
    y = cast((x * rrms) * w, out_ty, RTNE).to(tl.float32)
    ye, yo = tl.split(tl.reshape(y, [BLOCK_T, BLOCK_H, HALF, 2]))
    out = tl.reshape(tl.join(f00 * ye + f01 * yo, f10 * ye + f11 * yo), [BLOCK_T, BLOCK_H, D])
    tl.store(o_ptr + o_offs, cast(out, out_ty, RTNE), mask=mask)


@triton.jit
def qk_norm_rope_fwd(
    q_ptr, k_ptr, qw_ptr, kw_ptr, pe_ptr, qo_ptr, ko_ptr,
    L, H, l_off,
    sq_b, sq_h, sq_l, sk_b, sk_h, sk_l,
    so_b, so_h, so_l,
    spe_b, spe_l,
    eps,
    D: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, RTNE: tl.constexpr,
):  # fmt: skip
    HALF: tl.constexpr = D // 2
    offs_t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    b = tl.program_id(2).to(tl.int64)
    offs_d = tl.arange(0, D)
    mask_t = offs_t < L
    mask = mask_t[:, None, None] & (offs_h < H)[None, :, None] & (offs_d < D)[None, None, :]
    f00, f01, f10, f11 = _pe_tile(pe_ptr + b * spe_b + l_off * spe_l, spe_l, offs_t, mask_t, BLOCK_T, HALF)
    t3, h3, d3 = offs_t[:, None, None], offs_h[None, :, None], offs_d[None, None, :]
    o_offs = b * so_b + (l_off + t3) * so_l + h3 * so_h + d3
    _fwd_tile(q_ptr, b * sq_b + t3 * sq_l + h3 * sq_h + d3, qw_ptr, qo_ptr, o_offs, mask,
              f00, f01, f10, f11, eps, BLOCK_T, BLOCK_H, D, HALF, RTNE)  # fmt: skip
    _fwd_tile(k_ptr, b * sk_b + t3 * sk_l + h3 * sk_h + d3, kw_ptr, ko_ptr, o_offs, mask,
              f00, f01, f10, f11, eps, BLOCK_T, BLOCK_H, D, HALF, RTNE)  # fmt: skip


@triton.jit
def _bwd_tile(
    x_ptr, x_offs, w_ptr, do_ptr, do_offs, dx_ptr, dx_offs, dw_ptr, mask, f00, f01, f10, f11, eps,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr,
    COMPUTE_DW: tl.constexpr, RTNE: tl.constexpr,
):  # fmt: skip
    x = tl.load(x_ptr + x_offs, mask=mask, other=0.0).to(tl.float32)
    rrms = tl.rsqrt(total(x * x, 2) / D + eps)[:, :, None]
    _bwd_rows(x, rrms, w_ptr, do_ptr, do_offs, dx_ptr, dx_offs, dw_ptr, mask, f00, f01, f10, f11,
              BLOCK_T, BLOCK_H, D, HALF, COMPUTE_DW, RTNE)  # fmt: skip


@triton.jit
def _bwd_rows(
    x, rrms, w_ptr, do_ptr, do_offs, dx_ptr, dx_offs, dw_ptr, mask, f00, f01, f10, f11,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr,
    COMPUTE_DW: tl.constexpr, RTNE: tl.constexpr,
):  # fmt: skip
    """The backward of rows x ([BLOCK_T, BLOCK_H, D], fp32) given their 1/rms ([BLOCK_T, BLOCK_H, 1])."""
    do = tl.load(do_ptr + do_offs, mask=mask, other=0.0).to(tl.float32)
    de, dd = tl.split(tl.reshape(do, [BLOCK_T, BLOCK_H, HALF, 2]))
    dy = tl.reshape(tl.join(f00 * de + f10 * dd, f01 * de + f11 * dd), [BLOCK_T, BLOCK_H, D])  # R^T dout
    w = tl.load(w_ptr + tl.arange(0, D)).to(tl.float32)[None, None, :]
    g = dy * w
    c = (total(g * x, 2) / D)[:, :, None]
    dx = rrms * g - x * (rrms * rrms * rrms) * c
    tl.store(dx_ptr + dx_offs, cast(dx, dx_ptr.dtype.element_ty, RTNE), mask=mask)
    if COMPUTE_DW:
        tl.store(dw_ptr + tl.arange(0, D), total(total(dy * x * rrms, 0), 0))


@triton.jit
def qk_norm_rope_bwd(
    dqo_ptr, dko_ptr, q_ptr, k_ptr, qw_ptr, kw_ptr, pe_ptr, dq_ptr, dk_ptr, dqw_ptr, dkw_ptr,
    L, H, l_off,
    sdqo_b, sdqo_h, sdqo_l, sdko_b, sdko_h, sdko_l,
    sq_b, sq_h, sq_l, sk_b, sk_h, sk_l,
    sd_b, sd_h, sd_l,
    spe_b, spe_l,
    eps,
    D: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, COMPUTE_DW: tl.constexpr, RTNE: tl.constexpr,
):  # fmt: skip
    HALF: tl.constexpr = D // 2
    pid_t = tl.program_id(0)
    pid_h = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    offs_t = pid_t.to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, D)
    mask_t = offs_t < L
    mask = mask_t[:, None, None] & (offs_h < H)[None, :, None] & (offs_d < D)[None, None, :]
    f00, f01, f10, f11 = _pe_tile(pe_ptr + b * spe_b + l_off * spe_l, spe_l, offs_t, mask_t, BLOCK_T, HALF)
    t3, h3, d3 = offs_t[:, None, None], offs_h[None, :, None], offs_d[None, None, :]
    d_offs = b * sd_b + t3 * sd_l + h3 * sd_h + d3
    part = ((b * tl.num_programs(1) + pid_h) * tl.num_programs(0) + pid_t) * D  # this tile's row of dw partials
    _bwd_tile(q_ptr, b * sq_b + t3 * sq_l + h3 * sq_h + d3, qw_ptr,
              dqo_ptr, b * sdqo_b + (l_off + t3) * sdqo_l + h3 * sdqo_h + d3, dq_ptr, d_offs, dqw_ptr + part,
              mask, f00, f01, f10, f11, eps, BLOCK_T, BLOCK_H, D, HALF, COMPUTE_DW, RTNE)  # fmt: skip
    _bwd_tile(k_ptr, b * sk_b + t3 * sk_l + h3 * sk_h + d3, kw_ptr,
              dko_ptr, b * sdko_b + (l_off + t3) * sdko_l + h3 * sdko_h + d3, dk_ptr, d_offs, dkw_ptr + part,
              mask, f00, f01, f10, f11, eps, BLOCK_T, BLOCK_H, D, HALF, COMPUTE_DW, RTNE)  # fmt: skip
