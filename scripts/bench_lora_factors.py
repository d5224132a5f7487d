"""The LoRA factors' skinny GEMMs at FLUX's shapes: cuBLAS (torch.mm) against Triton kernels that split the sum.

A LoRA r16 layer's backward has two products whose output is only rank-wide while their sum runs over the 4608 tokens
(dB = dYᵀ h, dA = dhᵀ x) and two that sum over a wide feature dimension into a rank-wide output (dh = dY @ B, and the
forward's h = x @ Aᵀ). All are bound by reading the wide operand once; with a rank-16 output there is little to spread
over the SMs, which is where a kernel that splits the long sum over several programs (partial sums in float32, added
afterwards) could beat cuBLAS. This script times both on the GPU, each Triton kernel at its best of a grid of tile
configurations (checked against float64 first), and prints GB/s of the wide operand read:

    python scripts/bench_lora_factors.py --out factors.json      # needs a CUDA GPU

On the H200 (2026-11-27, README) cuBLAS was as fast or faster at every shape: these products run at the memory's
rate where the tensors are large, so nothing here is used by flux_kernels. `--tiny` runs small shapes on the CPU
through Triton's interpreter (a check of the kernels' math, no timing).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

from flux_kernels.ops.reference import rel_l2_err
from flux_kernels.runtime.timing import cold_l2_ms

RANK = 16
# (name, kind, tokens, wide): "tokens": [wide, r] = yᵀ h, y [tokens, wide]; "features": [tokens, r] = y w, w [wide, r]
CASES = [
    ("linear1 dB = dYᵀ h", "tokens", 4608, 21504),
    ("linear2 dA = dhᵀ x", "tokens", 4608, 15360),
    ("linear1 dA, linear2 dB", "tokens", 4608, 3072),
    ("img qkv dB", "tokens", 4096, 9216),
    ("img mlp0 dB, mlp2 dA", "tokens", 4096, 12288),
    ("img 3072-wide dA, dB", "tokens", 4096, 3072),
    ("txt qkv dB", "tokens", 512, 9216),
    ("txt 3072-wide dA, dB", "tokens", 512, 3072),
    ("img qkv dh = dY @ B", "features", 4096, 9216),
    ("img x @ Aᵀ, dY @ B", "features", 4096, 3072),
    ("single x @ Aᵀ", "features", 4608, 3072),
    ("txt x @ Aᵀ", "features", 512, 3072),
]
TINY_CASES = [("odd tokens", "tokens", 100, 96), ("odd features", "features", 100, 96), ("wide", "tokens", 64, 272)]
# (rows per tile, columns per tile, splits of the sum, warps, pipeline stages)
TOKEN_CONFIGS = list(itertools.product([64, 128], [64, 128], [1, 2, 4, 8], [4, 8], [3, 4]))
FEATURE_CONFIGS = list(itertools.product([32, 64], [128, 256], [1, 2, 4], [4, 8], [3, 4]))
TINY_CONFIG = (32, 32, 2, 4, 2)


@triton.jit
def _sum_over_tokens(y_ptr, h_ptr, out_ptr, M, N, sy_m, sh_m, so_s, rows_per_split,
                     BM: tl.constexpr, BN: tl.constexpr, R: tl.constexpr):  # fmt: skip
    """out[s, n, :] = sum over split s's rows m of y[m, n] · h[m, :]."""
    offs_n = tl.program_id(0) * BN + tl.arange(0, BN)
    offs_r = tl.arange(0, R)
    m0 = tl.program_id(1) * rows_per_split
    m_end = tl.minimum(m0 + rows_per_split, M)
    acc = tl.full([BN, R], 0.0, tl.float32)  # not tl.zeros: a @jit helper (tl_common says why)
    for m in range(m0, m_end, BM):
        offs_m = m + tl.arange(0, BM)
        rows = (offs_m < m_end)[:, None]
        y = tl.load(y_ptr + offs_m[:, None].to(tl.int64) * sy_m + offs_n[None, :], mask=rows & (offs_n < N)[None, :],
                    other=0.0)  # fmt: skip
        h = tl.load(h_ptr + offs_m[:, None].to(tl.int64) * sh_m + offs_r[None, :], mask=rows, other=0.0)
        acc += tl.dot(tl.trans(y), h)
    tl.store(out_ptr + tl.program_id(1) * so_s + offs_n[:, None] * R + offs_r[None, :], acc, mask=(offs_n < N)[:, None])


@triton.jit
def _sum_over_features(x_ptr, w_ptr, out_ptr, M, K, sx_m, sw_k, sw_r, so_s, cols_per_split,
                       BM: tl.constexpr, BK: tl.constexpr, R: tl.constexpr):  # fmt: skip
    """out[s, m, :] = sum over split s's columns k of x[m, k] · w[k, :]."""
    offs_m = tl.program_id(0) * BM + tl.arange(0, BM)
    offs_r = tl.arange(0, R)
    k0 = tl.program_id(1) * cols_per_split
    k_end = tl.minimum(k0 + cols_per_split, K)
    acc = tl.full([BM, R], 0.0, tl.float32)
    for k in range(k0, k_end, BK):
        offs_k = k + tl.arange(0, BK)
        cols = offs_k < k_end
        x = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * sx_m + offs_k[None, :],
                    mask=(offs_m < M)[:, None] & cols[None, :], other=0.0)  # fmt: skip
        w = tl.load(w_ptr + offs_k[:, None] * sw_k + offs_r[None, :] * sw_r, mask=cols[:, None], other=0.0)
        acc += tl.dot(x, w)
    tl.store(out_ptr + tl.program_id(1) * so_s + offs_m[:, None] * R + offs_r[None, :], acc, mask=(offs_m < M)[:, None])


def _splits(total: int, tile: int, split: int) -> tuple[int, int]:
    """(length of each split, a multiple of the tile; how many splits that makes)."""
    per = triton.cdiv(triton.cdiv(total, split), tile) * tile
    return per, triton.cdiv(total, per)


def yt_h(y: torch.Tensor, h: torch.Tensor, config: tuple) -> torch.Tensor:
    """yᵀ h for y [M, N] (rows contiguous) and h [M, R] (any row stride): [N, R] in y's dtype."""
    bm, bn, split, warps, stages = config
    (m, n), r = y.shape, h.shape[1]
    per, split = _splits(m, bm, split)
    out = torch.empty((split, n, r), device=y.device, dtype=torch.float32)
    _sum_over_tokens[(triton.cdiv(n, bn), split)](y, h, out, m, n, y.stride(0), h.stride(0), n * r, per,
                                                  BM=bm, BN=bn, R=r, num_warps=warps, num_stages=stages)  # fmt: skip
    return out.sum(0).to(y.dtype)


def y_w(y: torch.Tensor, w: torch.Tensor, config: tuple) -> torch.Tensor:
    """y @ w for y [M, K] (rows contiguous) and w [K, R] (any strides): [M, R] in y's dtype."""
    bm, bk, split, warps, stages = config
    (m, k), r = y.shape, w.shape[1]
    per, split = _splits(k, bk, split)
    out = torch.empty((split, m, r), device=y.device, dtype=torch.float32)
    grid = (triton.cdiv(m, bm), split)
    _sum_over_features[grid](y, w, out, m, k, y.stride(0), w.stride(0), w.stride(1), m * r, per,
                             BM=bm, BK=bk, R=r, num_warps=warps, num_stages=stages)  # fmt: skip
    return out.sum(0).to(y.dtype)


def operands(kind: str, tokens: int, wide: int, device, dtype, seed: int = 0):
    """The wide operand and the rank-wide one, random (never zero): for "tokens" h is a strided column slice, as
    lora_fold's `xh[:, k:]` is."""
    gen = torch.Generator().manual_seed(seed)
    y = torch.randn(tokens, wide, generator=gen).to(device, dtype)
    if kind == "tokens":
        return y, torch.randn(tokens, 3072 + RANK, generator=gen).to(device, dtype)[:, 3072:]
    return y, (torch.randn(wide, RANK, generator=gen) * 0.02).to(device, dtype)


def functions(kind: str, y: torch.Tensor, other: torch.Tensor):
    """(cuBLAS's product, the Triton kernel's as a function of its config, the float64 truth)."""
    if kind == "tokens":
        return (lambda: y.t() @ other), (lambda c: yt_h(y, other, c)), y.double().t() @ other.double()
    return (lambda: y @ other), (lambda c: y_w(y, other, c)), y.double() @ other.double()


def bench_case(name: str, kind: str, tokens: int, wide: int, device, dtype, reps: int, timed: bool) -> dict:
    y, other = operands(kind, tokens, wide, device, dtype)
    ref, fast, truth = functions(kind, y, other)
    row = {"case": name, "kind": kind, "tokens": tokens, "wide": wide, "mb": y.numel() * y.element_size() / 1e6,
           "torch_err": rel_l2_err(ref(), truth)}  # fmt: skip
    configs = (TOKEN_CONFIGS if kind == "tokens" else FEATURE_CONFIGS) if timed else [TINY_CONFIG]
    best, tolerance = None, 2 * row["torch_err"] + 1e-3
    for config in configs:
        try:
            err = rel_l2_err(fast(config), truth)
        except Exception as e:  # noqa: BLE001 - a configuration that does not build is skipped, and said
            print(f"  {name} {config}: {type(e).__name__}", file=sys.stderr)
            continue
        if not err <= tolerance:
            raise AssertionError(f"{name} {config}: relative error {err:.2e} > {tolerance:.2e}")
        t = cold_l2_ms(lambda c=config: fast(c), device, 3, max(reps // 2, 5)) if timed else 0.0
        if best is None or t < best[0]:
            best = (t, config, err)
    row.update(triton_config=list(best[1]), triton_err=best[2])
    if timed:
        row["torch_ms"] = cold_l2_ms(ref, device, 3, reps)
        row["triton_ms"] = cold_l2_ms(lambda: fast(best[1]), device, 3, reps)
        row["torch_gbs"], row["triton_gbs"] = row["mb"] / row["torch_ms"], row["mb"] / row["triton_ms"]
        row["speedup"] = row["torch_ms"] / row["triton_ms"]
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, help="write the results as JSON here")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--tiny", action="store_true", help="small shapes, no timing (runs on the CPU through Triton's "
                                                        "interpreter with TRITON_INTERPRET=1)")  # fmt: skip
    ns = ap.parse_args(argv)
    timed = not ns.tiny
    if timed and not torch.cuda.is_available():
        print("bench_lora_factors: no CUDA device here; nothing to time (--tiny checks the kernels' math)")
        return 0
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if timed else torch.float32
    result: dict = {"device": torch.cuda.get_device_name() if timed else "cpu", "dtype": str(dtype), "rank": RANK}
    if timed:
        big = torch.randn(4608, 21504, device=device, dtype=dtype)
        copy_ms = cold_l2_ms(big.clone, device, 3, ns.reps)
        result["copy_gbs"] = 2 * big.numel() * big.element_size() / 1e6 / copy_ms
        print(f"copy of a 4608 x 21504 tensor: {copy_ms:.4f} ms, {result['copy_gbs']:.0f} GB/s read + write")
        del big
    cases = CASES if timed else TINY_CASES
    result["rows"] = [bench_case(*case, device, dtype, ns.reps, timed) for case in cases]
    print(f"{'case':24} {'MB':>6} {'torch ms':>9} {'GB/s':>6} {'triton ms':>9} {'GB/s':>6} {'x':>5}  best config")
    for r in result["rows"]:
        if timed:
            print(f"{r['case']:24} {r['mb']:6.1f} {r['torch_ms']:9.4f} {r['torch_gbs']:6.0f} {r['triton_ms']:9.4f} "
                  f"{r['triton_gbs']:6.0f} {r['speedup']:5.2f}  {tuple(r['triton_config'])}")  # fmt: skip
        else:
            print(f"{r['case']:24} {r['mb']:6.3f}  triton error {r['triton_err']:.1e} (torch {r['torch_err']:.1e})")
    if ns.out:
        ns.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
