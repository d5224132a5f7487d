"""Row-wise e4m3 quantisation of a materialised 2-D tensor, imported lazily by `fp8.quantize_rows_op`.

One program per row. A row that fits in one block is loaded once and kept in registers; a wider one is swept twice:
the first sweep finds its amax (of x times the optional per-column scales), the second re-reads it, now in L2, and
writes the fp8 values. Either way the row is read from DRAM once."""

import triton
import triton.language as tl

from flux_kernels.ops.tl_common import largest


@triton.jit
def to_e4m3(x, RTNE: tl.constexpr):
    """`x.to(float8e4nv)` for |x| <= 448, rounding to nearest-even under the CPU interpreter too (its conversion
    carries a rounded-up mantissa into the wrong exponent: 125.1 became 64, not 128). There x is first snapped
    to the e4m3 grid in fp32 (3 mantissa bits for normals, multiples of 2^-9 below 2^-6), then converted exactly;
    GPUs convert with round-to-nearest-even in hardware, so RTNE is off there and this is a plain cast."""
    if RTNE:
        bits = x.to(tl.uint32, bitcast=True)
        normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & 0xFFF00000).to(tl.float32, bitcast=True)
        tiny = (tl.abs(x) + 24576.0) - 24576.0  # fp32 spacing at 24576 is 2^-9: e4m3's subnormal step
        x = tl.where(tl.abs(x) < 0.015625, tl.where(x < 0, -tiny, tiny), normal)
    return x.to(tl.float8e4nv)


@triton.jit
def _row_values(src, col_ptr, k, K, HAS_COL: tl.constexpr):
    """The row's fp32 values at columns k (times their column scales, with HAS_COL), and which of k are inside."""
    inside = k < K
    v = tl.load(src + k, mask=inside, other=0.0).to(tl.float32)
    if HAS_COL:
        v = v * tl.load(col_ptr + k, mask=inside, other=0.0)
    return v, inside


@triton.jit
def _store_e4m3(dst, k, v, s, inside, E4M3_MAX: tl.constexpr, RTNE: tl.constexpr):
    q = tl.minimum(tl.maximum(tl.math.div_rn(v, s), -E4M3_MAX), E4M3_MAX)
    tl.store(dst + k, to_e4m3(q, RTNE), mask=inside)


@triton.jit
def quantize_rows_2d(
    x_ptr,
    col_ptr,
    out_ptr,
    scale_ptr,
    K,
    stride_x,
    E4M3_MAX: tl.constexpr,
    HAS_COL: tl.constexpr,
    BLOCK: tl.constexpr,
    RTNE: tl.constexpr,
):
    """out[r] = clamp(v / s, +-E4M3_MAX) in e4m3 and scale[r] = s = max(amax(|v|), 1e-12) * (1 / E4M3_MAX), where
    v = x[r] (times col, one fp32 scale per column, with HAS_COL) in fp32; out is contiguous [R, K]. The arithmetic
    is fp8.quantize_rows' as PyTorch runs it: the scale times the fp32 reciprocal, v / s rounded (IEEE division, not
    Triton's faster approximate one), so the bits are the same."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    src = x_ptr + row * stride_x
    dst = out_ptr + row * K
    if BLOCK >= K:  # the whole row in registers: one sweep
        v, inside = _row_values(src, col_ptr, offs, K, HAS_COL)
        s = tl.maximum(largest(tl.abs(v), 0), 1e-12) * (1.0 / E4M3_MAX)
        tl.store(scale_ptr + row, s)
        _store_e4m3(dst, offs, v, s, inside, E4M3_MAX, RTNE)
    else:
        amax = tl.full([BLOCK], 0.0, tl.float32)
        for k0 in range(0, K, BLOCK):
            v, _ = _row_values(src, col_ptr, k0 + offs, K, HAS_COL)
            amax = tl.maximum(amax, tl.abs(v))
        s = tl.maximum(largest(amax, 0), 1e-12) * (1.0 / E4M3_MAX)
        tl.store(scale_ptr + row, s)
        for k0 in range(0, K, BLOCK):
            v, inside = _row_values(src, col_ptr, k0 + offs, K, HAS_COL)
            _store_e4m3(dst, k0 + offs, v, s, inside, E4M3_MAX, RTNE)
