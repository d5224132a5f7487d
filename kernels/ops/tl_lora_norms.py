"""Triton kernel: the LoRA gradient row norms from the [2r, 2r] Gram matrix (imported only by `_launch`, lazily).

`gram_row_norms` takes k modules of one shape at once: their `lora_up` weights and gradients stacked ([k, out, r]
each) and each module's M = B Bᵀ ([k, 2r, 2r], float64, formed by the caller), B = [d_down; down]. A program
owns BLOCK_N rows of one module and writes |G_i| = |scale| * sqrt(a_i M a_iᵀ), a_i = [up_i, d_up_i], reading each
factor once in its own dtype and doing the math in float64, as the reference does (float64 tensor-core dots on
sm_80 and newer): where a row of G nearly cancels between its two parts, float32 would lose the digits.
"""

import triton
import triton.language as tl

from flux_kernels.ops.tl_common import total


@triton.jit
def _block(m_ptr, row0, col0, offs_r, r, two_r):
    """M's r x r block at (row0, col0), as an [R, R] tile zero-padded past r."""
    mask = (offs_r[:, None] < r) & (offs_r[None, :] < r)
    return tl.load(m_ptr + (row0 + offs_r)[:, None] * two_r + (col0 + offs_r)[None, :], mask=mask, other=0.0)


@triton.jit
def gram_row_norms(
    u_ptr, du_ptr, m_ptr, out_ptr, N, r, scale, su_k, su_n, sdu_k, sdu_n, so_k,
    BLOCK_N: tl.constexpr, R: tl.constexpr,
):  # fmt: skip
    k = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, R)
    mask = (offs_n < N)[:, None] & (offs_r < r)[None, :]
    u = tl.load(u_ptr + k * su_k + offs_n[:, None] * su_n + offs_r[None, :], mask=mask, other=0.0).to(tl.float64)
    du = tl.load(du_ptr + k * sdu_k + offs_n[:, None] * sdu_n + offs_r[None, :], mask=mask, other=0.0).to(tl.float64)
    two_r = 2 * r
    m = m_ptr + k * two_r * two_r
    m11, m12 = _block(m, 0, 0, offs_r, r, two_r), _block(m, 0, r, offs_r, r, two_r)
    m21, m22 = _block(m, r, 0, offs_r, r, two_r), _block(m, r, r, offs_r, r, two_r)
    t1 = tl.dot(u, m11) + tl.dot(du, m21)  # (a M)'s first r columns
    t2 = tl.dot(u, m12) + tl.dot(du, m22)
    q = total(t1 * u + t2 * du, 1)
    norm = tl.sqrt(tl.maximum(q, 0.0)) * scale
    tl.store(out_ptr + k * so_k + offs_n, norm.to(tl.float32), mask=offs_n < N)
