"""GELU inside the GEMM: quack's CuTe-DSL GEMMs against cuBLAS plus a separate GELU pass, at FLUX's MLP shapes.

FLUX's MLPs (the double blocks' `img_mlp`, the single blocks' `linear1` MLP part) write their pre-activation, read it
back for GELU, and in the backward read the input gradient GEMM's output back for GELU's gradient. quack-kernels (a
dependency of flash-attn-4) has sm90 GEMMs that apply GELU in the epilogue (`gemm_act`: pre- and post-activation
written by the GEMM) and GELU's gradient in the input-gradient GEMM's epilogue (`gemm_dact`). This script times, per
shape, bf16, medians of CUDA events with the L2 flushed:

    forward:  cuBLAS addmm | cuBLAS addmm then GELU | quack gemm | quack gemm_act
    backward: cuBLAS mm    | cuBLAS mm then GELU's gradient | quack gemm | quack gemm_dact

each quack result checked against cuBLAS's (relative L2 error), and prints a table (JSON with --out):

    python scripts/bench_gemm_epilogue.py --out epilogue.json    # needs quack-kernels and an sm90 GPU

(quack fingerprints the code an epilogue depends on and takes installed packages by name only where their path has
a `site-packages` folder in it: a `pip install --target` elsewhere makes every epilogue GEMM fail with "no fail-closed
semantic key".) Nothing in flux_kernels uses these GEMMs yet; the README has the measurement (2026-11-27, H200).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from flux_kernels.reference import rel_l2_err
from flux_kernels.timing import cold_l2_ms

SHAPES = {"img_mlp.0": (4096, 3072, 12288), "single linear1, MLP part": (4608, 3072, 12288)}  # tokens, in, out


def variants(m: int, k: int, n: int, quack, tuned: bool, gen: torch.Generator, dev="cuda") -> list[tuple]:
    """(label, function, what its output is compared with, or None) for one shape: forward, then backward."""
    bf16 = torch.bfloat16
    x = torch.randn(m, k, generator=gen).to(dev, bf16)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(dev, bf16)  # [out, in], as nn.Linear keeps it
    bias = (torch.randn(n, generator=gen) * 0.1).to(dev, bf16)
    dy = torch.randn(m, k, generator=gen).to(dev, bf16)  # the gradient of the MLP's output (width k)
    w2 = (torch.randn(k, n, generator=gen) / n**0.5).to(dev, bf16)  # the second layer's [out, in]
    pre = torch.addmm(bias, x, w.t())
    post = F.gelu(pre, approximate="tanh")
    d_post = dy @ w2
    d_pre = torch.ops.aten.gelu_backward(d_post, pre, approximate="tanh")
    act = "gelu_tanh_approx"
    return [
        ("fwd cuBLAS addmm", lambda: torch.addmm(bias, x, w.t()), None),
        ("fwd cuBLAS addmm, GELU", lambda: F.gelu(torch.addmm(bias, x, w.t()), approximate="tanh"), None),
        ("fwd quack gemm", lambda: quack.gemm(x, w.t(), bias=bias, tuned=tuned), pre),
        ("fwd quack gemm_act", lambda: quack.gemm_act(x, w.t(), bias=bias, activation=act, tuned=tuned)[1], post),
        ("bwd cuBLAS mm", lambda: dy @ w2, None),
        ("bwd cuBLAS mm, GELU'", lambda: torch.ops.aten.gelu_backward(dy @ w2, pre, approximate="tanh"), None),
        ("bwd quack gemm", lambda: quack.gemm(dy, w2, tuned=tuned), d_post),
        ("bwd quack gemm_dact", lambda: quack.gemm_dact(dy, w2, pre, activation=act, tuned=tuned)[0], d_pre),
    ]


def missing() -> str | None:
    """Why this cannot run here, or None."""
    if not torch.cuda.is_available():
        return "needs a CUDA GPU (sm90: quack's GEMMs with epilogues are Hopper kernels)"
    if torch.cuda.get_device_capability()[0] < 9:
        return f"needs sm90 or newer, this GPU is sm{''.join(map(str, torch.cuda.get_device_capability()))}"
    try:
        import quack.gemm_interface  # noqa: F401
    except ImportError as e:
        return f"needs quack-kernels with nvidia-cutlass-dsl ({e})"
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, help="write the results as JSON here")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--tuned", action="store_true", help="let quack autotune each GEMM (minutes of compiling)")
    ns = ap.parse_args(argv)
    if why := missing():
        print(f"bench_gemm_epilogue: {why}", file=sys.stderr)
        return 2
    import quack.gemm_interface as quack

    gen = torch.Generator().manual_seed(0)
    rows = []
    for name, (m, k, n) in SHAPES.items():
        flops = 2 * m * k * n
        for label, fn, want in variants(m, k, n, quack, ns.tuned, gen):
            row = {"shape": name, "m": m, "k": k, "n": n, "variant": label}
            try:
                if want is not None:
                    row["rel_err"] = rel_l2_err(fn(), want)
                row["ms"] = cold_l2_ms(fn, torch.device("cuda"), 3, ns.reps)
                row["tflops"] = flops / row["ms"] / 1e9
            except Exception as e:  # noqa: BLE001 - a variant that fails is listed with its error
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            rows.append(row)
    print(f"{'shape':26} {'variant':24} {'ms':>8} {'TFLOP/s':>8} {'rel. err':>9}")
    for r in rows:
        err = f"{r['rel_err']:9.1e}" if "rel_err" in r else " " * 9
        timing = f"{r['ms']:8.4f} {r['tflops']:8.1f}" if "ms" in r else f"{r['error']}"
        print(f"{r['shape']:26} {r['variant']:24} {timing} {err}")
    if ns.out:
        ns.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
