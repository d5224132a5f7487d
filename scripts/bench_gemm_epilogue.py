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


# FLUX's single block at 1024²: linear1 3072 -> 9216 (q, k, v) + 12288 (MLP), linear2 takes [attention 3072, GELU(MLP)]
BLOCK = {"tokens": 4608, "hidden": 3072, "qkv": 9216, "mlp": 12288}


def block_variants(quack, tuned: bool, gen: torch.Generator, dev="cuda", compile=torch.compile, sizes=BLOCK) -> list:
    """The single block's MLP columns as the block would use quack: (label, function, what its output is compared
    with, or None). The baselines are what a compiled block does now: linear1 as one cuBLAS GEMM, then inductor's
    GELU + concatenation kernel; in the backward linear2's input gradient, then GELU's gradient written into linear1's
    gradient beside q/k/v's. The quack forms split linear1 (cuBLAS for q/k/v, `gemm_act` for the MLP columns, its
    GELU output written straight into linear2's input buffer: a column slice) and give GELU's gradient out of
    linear2's input-gradient GEMM (`gemm_dact`, written into a column slice of linear1's gradient). A variant whose
    strided output quack refuses shows its error: that is part of what this measures. The "graphed" rows (compiled,
    replayed from a CUDA graph) show that quack's ops trace and record there; their times include the copies of the
    inputs into the graph's own buffers, so they compare with each other only."""
    m, h, nq, nm = sizes["tokens"], sizes["hidden"], sizes["qkv"], sizes["mlp"]
    bf16, act = torch.bfloat16, "gelu_tanh_approx"

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(dev, bf16)

    x, attn, dy, d_qkv = rnd(m, h), rnd(m, h), rnd(m, h), rnd(m, nq)
    w1, b1 = rnd(nq + nm, h, scale=h**-0.5), rnd(nq + nm, scale=0.1)
    w2 = rnd(h, h + nm, scale=(h + nm) ** -0.5)  # linear2 [out, in]: in = [attention, MLP]
    w_qkv, w_mlp, b_qkv, b_mlp = w1[:nq], w1[nq:], b1[:nq], b1[nq:]
    pre = torch.addmm(b_mlp, x, w_mlp.t())

    # each returns what the block needs besides the compared output (q/k/v's columns; the attention's input
    # gradient) first, so that compiled code cannot drop that work as unused; the last output is compared
    def fwd_now(x, attn):
        lin1 = torch.addmm(b1, x, w1.t())
        return lin1[:, :nq], torch.cat([attn, F.gelu(lin1[:, nq:], approximate="tanh")], 1)

    def bwd_now(dy, pre, d_qkv):
        d_in = dy @ w2
        return d_in[:, :h], torch.cat([d_qkv, torch.ops.aten.gelu_backward(d_in[:, h:], pre, approximate="tanh")], 1)

    def fwd_quack(x, attn):
        buf = torch.empty(m, h + nm, device=x.device, dtype=bf16)
        quack.gemm_act(x, w_mlp.t(), bias=b_mlp, activation=act, postact_out=buf[:, h:], tuned=tuned)
        buf[:, :h].copy_(attn)
        return torch.addmm(b_qkv, x, w_qkv.t()), buf

    def bwd_quack(dy, pre, d_qkv):
        d_lin1 = torch.empty(m, nq + nm, device=dy.device, dtype=bf16)
        d_lin1[:, :nq].copy_(d_qkv)
        quack.gemm_dact(dy, w2[:, h:], pre, activation=act, dx_out=d_lin1[:, nq:], tuned=tuned)
        return dy @ w2[:, :h], d_lin1

    fwd_args, bwd_args = (x, attn), (dy, pre, d_qkv)
    want_fwd, want_bwd = fwd_now(*fwd_args)[-1], bwd_now(*bwd_args)[-1]
    fwd_compiled, bwd_compiled = compile(fwd_now), compile(bwd_now)
    graphs = {f.__name__: compile(f, mode="reduce-overhead") for f in (fwd_now, bwd_now, fwd_quack, bwd_quack)}
    return [
        ("blk fwd now (compiled)", lambda: fwd_compiled(*fwd_args), None),
        ("blk fwd now, graphed", lambda: graphs["fwd_now"](*fwd_args), None),
        ("blk fwd quack into slice", lambda: fwd_quack(*fwd_args), want_fwd),
        ("blk fwd quack, graphed", lambda: graphs["fwd_quack"](*fwd_args), want_fwd),
        ("blk bwd now (compiled)", lambda: bwd_compiled(*bwd_args), None),
        ("blk bwd now, graphed", lambda: graphs["bwd_now"](*bwd_args), None),
        ("blk bwd quack into slice", lambda: bwd_quack(*bwd_args), want_bwd),
        ("blk bwd quack, graphed", lambda: graphs["bwd_quack"](*bwd_args), want_bwd),
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


def measure(variant: tuple, flops: int, reps: int, where: dict) -> dict:
    """One table row: the variant's error against what it is compared with, its median time and rate, or why it
    failed (a variant that fails is listed with its error)."""
    label, fn, want = variant
    row = {**where, "variant": label}
    try:
        if want is not None:
            got = fn()
            row["rel_err"] = rel_l2_err(got[-1] if isinstance(got, tuple) else got, want)
        row["ms"] = cold_l2_ms(fn, torch.device("cuda"), 3, reps)
        row["tflops"] = flops / row["ms"] / 1e9
    except Exception as e:  # noqa: BLE001 - reported in the row
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    return row


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
        where = {"shape": name, "m": m, "k": k, "n": n}
        rows += [measure(v, 2 * m * k * n, ns.reps, where) for v in variants(m, k, n, quack, ns.tuned, gen)]
    flops = 2 * BLOCK["tokens"] * BLOCK["hidden"] * (BLOCK["qkv"] + BLOCK["mlp"])  # the forward's (linear1)
    where = {"shape": "single block MLP part", **BLOCK}
    rows += [measure(v, flops, ns.reps, where) for v in block_variants(quack, ns.tuned, gen)]
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
