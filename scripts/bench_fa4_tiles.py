"""FlashAttention-4's sm90 backward at FLUX's shape under other tile configurations than flash-attn-4's own.

`cudnn_fa4`'s backward is the largest kernel of a `vram80` step (62.9 ms of ~318 ms on an H200: 57 calls at ~590
TFLOP/s). flash-attn-4 picks the sm90 backward's tiles in `interface._tile_size_bwd_sm90`, FA3's choice for an H100
SXM (head dim 128, not causal: 80 x 128 with dQ swapped); the lent H200 runs at its power limit, below the H100's
clock. This script times that backward with each candidate configuration patched in (cuDNN's forward once; its
output and log-sum-exp reused), checks each one's gradients against the default configuration's, and prints a table
(and writes JSON with --out). A configuration that does not compile or launch is listed with its error.

    python scripts/bench_fa4_tiles.py --out tiles.json            # needs flash-attn-4 and an sm90 GPU

Nothing installs a configuration: a clear winner would go into flux_kernels.patches.attention.fa4 with its measurement.
On the H200 (2026-11-26, README) the default was the fastest of the three that built (1.138 ms against 1.150 and 1.372).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import statistics
import sys
from pathlib import Path

import torch

# (m_block_size, n_block_size) and flags against the default; fields not named keep the default's values
CANDIDATES: list[dict] = [
    {},  # flash-attn-4's own choice
    {"m_block_size": 64, "dQ_swapAB": False},
    {"m_block_size": 96, "dQ_swapAB": True},
    {"m_block_size": 128, "dQ_swapAB": False, "AtomLayoutMdQ": 2},
    {"m_block_size": 64, "n_block_size": 96, "dQ_swapAB": False},
    {"m_block_size": 80, "n_block_size": 96},
    {"AtomLayoutNdKV": 1},
    {"AtomLayoutMSdP": 2, "SdP_swapAB": False},
    {"num_stages_Q": 1},
    {"num_stages_dO": 1},
]


def configs(default) -> list[tuple[str, object]]:
    """(label, BwdConfig) for every candidate, the default first; a candidate equal to the default is left out."""
    out, seen = [], set()
    for change in CANDIDATES:
        cfg = dataclasses.replace(default, **change)
        if dataclasses.astuple(cfg) in seen:
            continue
        seen.add(dataclasses.astuple(cfg))
        label = ", ".join(f"{k}={v}" for k, v in change.items()) or "default"
        out.append((label, cfg))
    return out


@contextlib.contextmanager
def tiles(interface, cfg):
    """flash-attn-4's sm90 backward with `cfg` for head dim 128 (its in-memory kernel cache cleared: some fields,
    num_stages_PdS among them, are not in its compile key)."""
    original = interface._tile_size_bwd_sm90
    interface._tile_size_bwd_sm90 = lambda *a, **k: cfg
    interface._flash_attn_bwd.compile_cache.clear()
    try:
        yield
    finally:
        interface._tile_size_bwd_sm90 = original
        interface._flash_attn_bwd.compile_cache.clear()


def gpu_ms(fn, reps: int) -> float:
    """Median of `reps` CUDA-event timings of fn(), after two untimed calls."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=4608, help="FLUX at 1024²: 4096 image + 512 text tokens")
    ap.add_argument("--heads", type=int, default=24)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out", type=Path)
    ns = ap.parse_args(argv)
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        print("needs an sm90 GPU (flash-attn-4's sm90 backward)", file=sys.stderr)
        return 2
    from flash_attn.cute import interface

    from flux_kernels.patches.attention.fa4 import fa4_attention_backward

    gen = torch.Generator(device="cuda").manual_seed(0)
    shape = (1, ns.heads, ns.tokens, 128)
    q, k, v, dout = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(4))
    res = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, False, False)
    out, lse = res[0], res[1].reshape(shape[:3]).contiguous()
    flops = 2.5 * 4 * ns.tokens**2 * 128 * ns.heads  # the backward: 2.5x the forward's 4 L² D H

    rows, want = [], None
    default = interface._tile_size_bwd_sm90(128, 128, False, False)
    for label, cfg in configs(default):
        row = {"config": label, **dataclasses.asdict(cfg)}
        try:
            with tiles(interface, cfg):
                grads = fa4_attention_backward(dout, q, k, v, out, lse)
                ms = gpu_ms(lambda: fa4_attention_backward(dout, q, k, v, out, lse), ns.reps)
            want = want or grads
            row.update(ms=ms, tflops=flops / ms / 1e9, err=max(rel(g, w) for g, w in zip(grads, want, strict=True)))
        except Exception as e:  # noqa: BLE001 - a configuration that cannot compile or launch is a result too
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:100] if str(e) else ''}"
        rows.append(row)
        base = rows[0].get("ms")
        if row.get("ms"):
            vs = f"{base / row['ms']:.3f}x" if base else "-"
            print(f"{label:<48} {row['ms']:8.3f} ms {row['tflops']:6.0f} TFLOP/s {vs:>7} err {row['err']:.1e}")
        else:
            print(f"{label:<48} {row['error']}")
    if ns.out:
        ns.out.write_text(json.dumps({"shape": shape, "device": torch.cuda.get_device_name(), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
