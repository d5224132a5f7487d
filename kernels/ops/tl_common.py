"""Shared Triton helpers (imported only by the tl_* kernel modules, themselves imported lazily)."""

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


@triton.jit
def _add(a, b):
    return a + b


@triton.jit
def _max(a, b):
    return tl.maximum(a, b)


def _std_lib_compiled_only() -> bool:
    """triton.language's own @jit helpers (tl.sum, tl.zeros) are decorated when triton is first imported. If that
    happened before TRITON_INTERPRET was set (another test or library in the same process), they are compiled-only
    and the interpreter cannot call them."""
    from triton.runtime.jit import JITFunction

    from flux_kernels.runtime.device import triton_interpreting

    return triton_interpreting() and isinstance(tl.sum, JITFunction)


if _std_lib_compiled_only():

    @triton.jit
    def total(x, axis: tl.constexpr):
        """`tl.sum` from the core `tl.reduce` (slow under the interpreter, but callable there)."""
        return tl.reduce(x, axis, _add)

    @triton.jit
    def largest(x, axis: tl.constexpr):
        """`tl.max` from the core `tl.reduce`."""
        return tl.reduce(x, axis, _max)

else:

    @triton.jit
    def total(x, axis: tl.constexpr):
        """`tl.sum` (the fp32 tiles here need no dtype promotion)."""
        return tl.sum(x, axis=axis)

    @triton.jit
    def largest(x, axis: tl.constexpr):
        """`tl.max`."""
        return tl.max(x, axis=axis)
