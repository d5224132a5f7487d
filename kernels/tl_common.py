"""Shared Triton helpers (imported only through `fast.py`, lazily)."""

import triton
import triton.language as tl


@triton.jit
def cast(x, dtype: tl.constexpr, RTNE: tl.constexpr):
    """`x.to(dtype)` that rounds fp32 -> bf16 to nearest-even even under the CPU interpreter, which truncates
    (GPUs round to nearest-even in hardware, so RTNE is off there and this is a plain cast)."""
    if RTNE and dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        x = bits.to(tl.float32, bitcast=True)
    return x.to(dtype)
