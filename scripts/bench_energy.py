"""Joules, not seconds: what a FLUX step's kinds of work cost on a card that runs at its power limit.

A card held at its power limit (the lent H200: 700 W, and `flux-train bench` reads 685-702 W through training steps)
is fast in proportion to the work it does per joule, not per second. This script measures, each kept running for a
few seconds so that the card reaches its limit, with NVML's energy counter (millijoules):

    a projection GEMM      the single blocks' linear1 forward as the step issues it (4608 x 3088 -> 21504, bias)
    attention              forward + backward at FLUX's shape (1, 24, 4608, 128): cuDNN through SDPA, and
                           `cudnn_fa4` (cuDNN's forward, FlashAttention-4's backward) where flash-attn-4 is installed
    a memory-bound pass    a bf16 add of two 4608 x 12288 tensors (GB moved a joule)

and from those the energy floor of a bf16 step at 1024² (flux_trainer.metrics.flops: the projections' forward and
input gradients, attention forward + backward), what that floor allows at the card's enforced power limit, and, for
a target s/step, the joules left for everything else (LoRA factors, norms, modulation, GELU, residuals, optimizer):

    python scripts/bench_energy.py --target 0.30 --out energy.json     # needs a CUDA GPU with NVML

The best rate measured for each kind stands for all of its kind in the step: the floor is optimistic where other
projections or attention run less efficiently.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from flux_kernels.runtime.timing import sustained
from flux_trainer.metrics.flops import flux_step_flops
from flux_trainer.metrics.nvml import NvmlReader

ATTENTION_SHAPE = (1, 24, 4608, 128)  # batch, heads, img + txt tokens at 1024², head dim
GEMM = (4608, 3088, 21504)  # the single blocks' linear1 forward with lora_fold: tokens, 3072 + rank 16, out


def step_tflop(**flux) -> dict[str, float]:
    """TFLOP of one step's projections (forward, and the input gradients the backward takes) and attention
    (forward, and backward at flux_step_flops' 2.5x), without checkpointing."""
    f = flux_step_flops(**flux)
    attention = f.parts["attention"] * 3.5  # forward + backward
    projections = f.parts["linear"] + (f.backward - 2.5 * f.parts["attention"] - 2 * f.parts["lora"])
    return {"projections": projections / 1e12, "attention": attention / 1e12}


def floor(tflop: dict[str, float], tflop_per_j: dict[str, float], limit_w: float, target_s: float | None) -> dict:
    """The energy the projections and attention take at the measured rates a joule, the s/step that is at the power
    limit, and the joules a step at `target_s` leaves for everything else (negative: the target is below it)."""
    joules = {kind: tflop[kind] / tflop_per_j[kind] for kind in tflop}
    out = {"joules": joules, "floor_j": sum(joules.values()), "limit_w": limit_w}
    out["floor_s"] = out["floor_j"] / limit_w
    if target_s is not None:
        out["target_s"], out["target_j"] = target_s, target_s * limit_w
        out["left_j"] = out["target_j"] - out["floor_j"]
    return out


def workloads(dev: str = "cuda") -> list[tuple[str, str, float, Callable[[], object]]]:
    """(name, kind, FLOPs or bytes a call, fn): kind "projections" / "attention" (FLOPs) or "memory" (bytes)."""
    bf16, gen = torch.bfloat16, torch.Generator(device=dev).manual_seed(0)
    m, k, n = GEMM
    a = torch.randn(m, k, device=dev, dtype=bf16, generator=gen)
    w = torch.randn(n, k, device=dev, dtype=bf16, generator=gen) / k**0.5
    bias = torch.randn(n, device=dev, dtype=bf16, generator=gen)
    out = [("GEMM linear1 fwd (cuBLAS)", "projections", 2.0 * m * k * n, lambda: torch.addmm(bias, a, w.t()))]
    b, h, t, d = ATTENTION_SHAPE
    q, kk, v = (torch.randn(b, h, t, d, device=dev, dtype=bf16, generator=gen).requires_grad_() for _ in range(3))
    do = torch.randn(b, h, t, d, device=dev, dtype=bf16, generator=gen)
    flops = 4.0 * t * t * d * h * b * 3.5
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            o = F.scaled_dot_product_attention(q, kk, v)
        torch.autograd.grad(o, (q, kk, v), do)

    out.append(("attention fwd+bwd (cuDNN)", "attention", flops, cudnn))
    try:
        import flash_attn.cute  # noqa: F401

        from flux_kernels.patches.attention.fa4 import cudnn_fa4

        def fa4():
            torch.autograd.grad(cudnn_fa4(q, kk, v), (q, kk, v), do)

        out.append(("attention fwd+bwd (cudnn_fa4)", "attention", flops, fa4))
    except ImportError:
        pass
    x = torch.randn(4608, 12288, device=dev, dtype=bf16, generator=gen)
    y, z = torch.randn_like(x), torch.empty_like(x)
    out.append(("bf16 add, 3 x 113 MB", "memory", 3.0 * x.numel() * 2, lambda: torch.add(x, y, out=z)))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--secs", type=float, default=4.0, help="measured seconds per workload")
    ap.add_argument("--target", type=float, help="a step time to say the energy left at, s/step (0.30)")
    ap.add_argument("--out", type=Path, help="write the results as JSON here")
    ns = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_energy: needs a CUDA GPU (and NVML: nvidia-ml-py)", file=sys.stderr)
        return 2
    nvml = NvmlReader(torch.cuda.current_device())
    limits = nvml.power_limits_w()
    if nvml.energy_j() is None or limits is None:
        print("bench_energy: NVML's energy counter or power limit is not readable here (nvidia-ml-py)", file=sys.stderr)
        return 2
    limit_w = limits[0]

    rows = []
    print(f"{'workload':32} {'ms/call':>8} {'rate':>14} {'mJ/call':>8} {'per joule':>14} {'W':>4} {'MHz':>5}")
    for name, kind, amount, fn in workloads():
        r = {"workload": name, "kind": kind, **sustained(fn, ns.secs, nvml.energy_j)}
        r["mhz"] = nvml.read().get("gpu/sm_clock_mhz", float("nan"))
        if kind == "memory":
            r["gb_per_s"], r["gb_per_j"] = amount / r["ms"] / 1e6, amount / r["j"] / 1e9
            rate, per_j = f"{r['gb_per_s']:8.0f} GB/s", f"{r['gb_per_j']:8.2f} GB/J"
        else:
            r["tflops"], r["tflop_per_j"] = amount / r["ms"] / 1e9, amount / r["j"] / 1e12
            rate, per_j = f"{r['tflops']:7.1f} TFLOP/s", f"{r['tflop_per_j']:7.3f} TFLOP/J"
        rows.append(r)
        print(f"{name:32} {r['ms']:8.4f} {rate:>14} {r['j'] * 1e3:8.1f} {per_j:>14} {r['w']:4.0f} {r['mhz']:5.0f}")
    best = {kind: max(r["tflop_per_j"] for r in rows if r["kind"] == kind) for kind in ("projections", "attention")}
    tflop = step_tflop()
    fl = floor(tflop, best, limit_w, ns.target)
    print(f"a bf16 step at 1024² (batch 1, no checkpointing): projections {tflop['projections']:.1f} TFLOP -> "
          f"{fl['joules']['projections']:.0f} J, attention {tflop['attention']:.1f} TFLOP -> "
          f"{fl['joules']['attention']:.0f} J: {fl['floor_j']:.0f} J, {fl['floor_s']:.3f} s at the card's "
          f"{limit_w:.0f} W limit with nothing else in the step")  # fmt: skip
    if ns.target is not None:
        print(f"{ns.target:.3f} s/step at {limit_w:.0f} W is {fl['target_j']:.0f} J: {fl['left_j']:.0f} J left for "
              "everything else in the step")  # fmt: skip
    if ns.out:
        ns.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows, **fl}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
