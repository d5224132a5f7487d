"""Triton kernel: the single block's linear1 gradient for q, k, v (imported only by `_launch`, lazily).

`qkv_bwd` takes the gradients of the attention inputs q, k, v ([B, H, L, D]) back to linear1's first 3 * H * D
columns: for q and k, RoPE's transpose and RMSNorm's backward (tl_qk_norm_rope's `_bwd_rows`, given the forward's
1/rms per row, holds each (token, head) row of D in registers, so the row sum that RMSNorm's gradient needs costs
no second pass); v's gradient is copied. A program owns [BLOCK_T tokens, BLOCK_H heads, D]
of all three and stores them straight into the rows of the gradient buffer. Inductor's code for the same algebra
needs a reduction pass, then a pass per slice (s26a: 91 + 30 + 29 + 15 us per block at 1024²).

`gelu_bwd` writes the M columns after them: GELU's (tanh) backward, given its incoming gradient and linear1's MLP
columns, in fp32 as PyTorch's CUDA kernel computes it, tanh through exp (the interpreter has no libdevice).
"""

import triton
import triton.language as tl

from flux_kernels.ops.tl_common import cast
from flux_kernels.ops.tl_qk_norm_rope import _bwd_rows, _pe_tile


@triton.jit
def qkv_bwd(
    dq_ptr, dk_ptr, dv_ptr, x_ptr, rq_ptr, rk_ptr, qw_ptr, kw_ptr, pe_ptr, dlin_ptr,
    L, H,
    sdq_b, sdq_h, sdq_l, sdk_b, sdk_h, sdk_l, sdv_b, sdv_h, sdv_l,
    srq_b, srq_h, srq_l, srk_b, srk_h, srk_l,
    sx_b, sx_l, so_b, so_l,
    spe_b, spe_l,
    D: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, RTNE: tl.constexpr,
):  # fmt: skip
    HALF: tl.constexpr = D // 2
    offs_t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    b = tl.program_id(2).to(tl.int64)
    offs_d = tl.arange(0, D)
    mask_t = offs_t < L
    mask_row = mask_t[:, None, None] & (offs_h < H)[None, :, None]
    mask = mask_row & (offs_d < D)[None, None, :]
    f00, f01, f10, f11 = _pe_tile(pe_ptr + b * spe_b, spe_l, offs_t, mask_t, BLOCK_T, HALF)
    t3, h3, d3 = offs_t[:, None, None], offs_h[None, :, None], offs_d[None, None, :]
    cols = h3 * D + d3
    x_offs = b * sx_b + t3 * sx_l + cols
    o_offs = b * so_b + t3 * so_l + cols
    width = H * D  # q, k, v are linear1's column blocks [0, width), [width, 2 width), [2 width, 3 width)
    x = tl.load(x_ptr + x_offs, mask=mask, other=0.0).to(tl.float32)
    r = tl.load(rq_ptr + b * srq_b + t3 * srq_l + h3 * srq_h, mask=mask_row, other=0.0)
    _bwd_rows(x, r, qw_ptr, dq_ptr, b * sdq_b + t3 * sdq_l + h3 * sdq_h + d3, dlin_ptr, o_offs, qw_ptr,
              mask, f00, f01, f10, f11, BLOCK_T, BLOCK_H, D, HALF, False, RTNE)  # fmt: skip
    x = tl.load(x_ptr + width + x_offs, mask=mask, other=0.0).to(tl.float32)
    r = tl.load(rk_ptr + b * srk_b + t3 * srk_l + h3 * srk_h, mask=mask_row, other=0.0)
    _bwd_rows(x, r, kw_ptr, dk_ptr, b * sdk_b + t3 * sdk_l + h3 * sdk_h + d3, dlin_ptr + width, o_offs, kw_ptr,
              mask, f00, f01, f10, f11, BLOCK_T, BLOCK_H, D, HALF, False, RTNE)  # fmt: skip
    dv = tl.load(dv_ptr + b * sdv_b + t3 * sdv_l + h3 * sdv_h + d3, mask=mask, other=0.0)
    tl.store(dlin_ptr + 2 * width + o_offs, dv.to(dlin_ptr.dtype.element_ty), mask=mask)


@triton.jit
def gelu_bwd(
    da_ptr, x_ptr, dlin_ptr, L, M, sda_b, sda_l, sx_b, sx_l, so_b, so_l,
    BLOCK_T: tl.constexpr, BLOCK_M: tl.constexpr, RTNE: tl.constexpr,
):  # fmt: skip
    """dlin = da * GELU'(x) over [BLOCK_T tokens, BLOCK_M columns]; x and dlin point at the MLP's first column."""
    offs_t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    b = tl.program_id(2).to(tl.int64)
    mask = (offs_t < L)[:, None] & (offs_m < M)[None, :]
    t2, m2 = offs_t[:, None], offs_m[None, :]
    x = tl.load(x_ptr + b * sx_b + t2 * sx_l + m2, mask=mask, other=0.0).to(tl.float32)
    da = tl.load(da_ptr + b * sda_b + t2 * sda_l + m2, mask=mask, other=0.0).to(tl.float32)
    beta = 0.7978845608028654  # sqrt(2 / pi)
    kappa = 0.044715
    x_sq = x * x
    inner = beta * (x + kappa * (x_sq * x))
    e = tl.exp(-2.0 * tl.abs(inner))
    th = (1.0 - e) / (1.0 + e)
    th = tl.where(inner < 0, -th, th)
    d_left = 0.5 * (1.0 + th)
    d_right = 0.5 * x * (1.0 - th * th) * (beta * (1.0 + 3.0 * kappa * x_sq))
    out = cast(da * (d_left + d_right), dlin_ptr.dtype.element_ty, RTNE)
    tl.store(dlin_ptr + b * so_b + t2 * so_l + m2, out, mask=mask)
