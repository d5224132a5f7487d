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

`--projections` times instead every projection GEMM of a step (LAYERS: forward and input gradient, at lora_fold's
widths) with cuBLAS as torch calls it against quack's GEMM (default tiles, autotuned, and with `--configs` each of
CONFIGS), and sums them over a step's calls; `--sustained SECS` keeps each running that long and reads its energy,
as a card at its power limit runs it (the condition of a training step), instead of single calls on a cool card:

    python scripts/bench_gemm_epilogue.py --projections --sustained 2 --configs --only single --out proj.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from flux_kernels.ops.reference import rel_l2_err
from flux_kernels.runtime.timing import cold_l2_ms

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


# The step's projection layers at 1024², at the widths the compiled blocks give them with `lora_fold` (K + 16 where B
# is folded into the weight, N + 64 rows where A is, N + 16 columns in that fold's input gradient): (name, calls a
# step, tokens, forward in, forward out, input gradient's inner width, bias); the input gradient's output is as wide
# as the forward's input. The txt stream's are 512-token copies of the img stream's.
LAYERS = [
    ("single linear1", 38, 4608, 3088, 21504, 21504, True),
    ("single linear2", 38, 4608, 15360, 3136, 3088, False),
    ("img qkv", 19, 4096, 3072, 9216, 9216, True),
    ("img proj", 19, 4096, 3072, 3072, 3072, True),
    ("img mlp.0", 19, 4096, 3088, 12288, 12288, True),
    ("img mlp.2", 19, 4096, 12288, 3136, 3088, False),
]
LAYERS += [("txt" + name[3:], calls, 512, *widths) for name, calls, _, *widths in LAYERS[2:]]
# per GEMM: (name, calls a step, M, K, N, how the second factor is stored, bias). "nk" is a Linear's weight [N, K]
# (x @ Wᵀ, the forward), "kn" the same weight read as [K, N] (dY @ W, the input gradient)
PROJECTIONS = [
    gemm
    for name, calls, m, k, n, k_grad, bias in LAYERS
    for gemm in ((f"{name} fwd", calls, m, k, n, "nk", bias), (f"{name} bwd", calls, m, k_grad, k, "kn", False))
]


def projection_variants(case: tuple, quack, gen: torch.Generator, dev="cuda", configs=(), tuned=True) -> list:
    """(label, function, what its output is compared with, or None) for one projection: cuBLAS as torch calls it
    (addmm / mm), quack's GEMM with its default tiles, quack's GEMM autotuned over its sm90 configurations (`tuned`),
    and quack's GEMM at each of `configs` ((label, quack GemmConfig) pairs)."""
    _, _, m, k, n, how, has_bias = case
    bf16 = torch.bfloat16
    a = torch.randn(m, k, generator=gen).to(dev, bf16)
    stored = (torch.randn(*((n, k) if how == "nk" else (k, n)), generator=gen) / k**0.5).to(dev, bf16)
    b = stored.t() if how == "nk" else stored  # [K, N] either way, as the GEMM reads it
    bias = (torch.randn(n, generator=gen) * 0.1).to(dev, bf16) if has_bias else None
    want = torch.addmm(bias, a, b) if has_bias else a @ b
    out = torch.empty(m, n, device=dev, dtype=bf16)

    def at(config):  # quack's GEMM at one configuration, into `out` (its autotuner's function, untuned)
        quack.gemm_tuned.fn(a, b, out, bias=bias, config=config)
        return out

    return [
        ("cuBLAS", (lambda: torch.addmm(bias, a, b)) if has_bias else (lambda: a @ b), None),
        ("quack default", lambda: quack.gemm(a, b, bias=bias, tuned=False), want),
        *([("quack tuned", lambda: quack.gemm(a, b, bias=bias, tuned=True), want)] if tuned else []),
        *[(f"quack {label}", lambda c=config: at(c), want) for label, config in configs],
    ]


# quack's sm90 tile shapes (M x N, pingpong or cooperative) and 2-CTA clusters tried with --configs
CONFIGS = [(256, 192, False, 1, 2), (256, 192, False, 2, 1), (256, 208, False, 1, 2), (256, 160, False, 1, 2),
           (256, 128, False, 1, 2), (128, 256, False, 1, 2), (128, 256, False, 2, 1), (128, 224, False, 2, 1),
           (128, 192, True, 1, 2), (128, 208, True, 2, 1), (192, 128, True, 1, 2)]  # fmt: skip


def quack_configs(gemm_config) -> list[tuple[str, object]]:
    """(label, config) for CONFIGS, built with quack's GemmConfig class (passed in: quack is imported late)."""
    return [(f"{m}x{n}{' pp' if pp else ''} c{cm}{cn}",
             gemm_config(tile_m=m, tile_n=n, pingpong=pp, cluster_m=cm, cluster_n=cn, swap_ab=False,
                         device_capacity=9, is_dynamic_persistent=False, use_tma_gather=False))
            for m, n, pp, cm, cn in CONFIGS]  # fmt: skip


def step_totals(rows: list[dict]) -> dict[str, float]:
    """Milliseconds a step per variant, the rows' times weighted by their calls a step, and "best" (each
    projection's fastest variant); None where a variant has no time for some projection."""
    by_case: dict[str, dict[str, float]] = {}
    for r in rows:
        if "calls" in r:
            by_case.setdefault(r["shape"], {})[r["variant"]] = r["ms"] * r["calls"] if "ms" in r else None
    variants = {v for times in by_case.values() for v in times}
    totals = {v: sum(t[v] for t in by_case.values()) if all(t.get(v) is not None for t in by_case.values()) else None
              for v in sorted(variants)}  # fmt: skip
    totals["best"] = sum(min(x for x in t.values() if x is not None) for t in by_case.values())
    return totals


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


def measure(variant: tuple, flops: int, reps: int, where: dict, timer=None) -> dict:
    """One table row: the variant's error against what it is compared with, its median time and rate, or why it
    failed (a variant that fails is listed with its error). `timer(fn)` instead of the cold-L2 median: a dict with
    "ms" and, where it has them, "j" (joules a call) and "w" (flux_kernels.runtime.timing.sustained)."""
    label, fn, want = variant
    row = {**where, "variant": label}
    try:
        if want is not None:
            got = fn()
            row["rel_err"] = rel_l2_err(got[-1] if isinstance(got, tuple) else got, want)
        if timer is None:
            row["ms"] = cold_l2_ms(fn, torch.device("cuda"), 3, reps)
        else:
            row.update({k: v for k, v in timer(fn).items() if v is not None})
            if "j" in row:
                row["tflop_per_j"] = flops / row["j"] / 1e12
        row["tflops"] = flops / row["ms"] / 1e9
    except Exception as e:  # noqa: BLE001 - reported in the row
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, help="write the results as JSON here")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--tuned", action="store_true", help="let quack autotune each GEMM (minutes of compiling)")
    ap.add_argument(
        "--projections",
        action="store_true",
        help="instead: the step's projection GEMMs, cuBLAS against quack default and autotuned",
    )
    ap.add_argument(
        "--sustained",
        type=float,
        metavar="SECS",
        help="with --projections: time each variant kept running this long, with its energy (NVML), "
        "as a card at its power limit runs it, instead of single calls on a cool card",
    )
    ap.add_argument("--configs", action="store_true", help="with --projections: quack at each of CONFIGS too")
    ap.add_argument("--only", default="", help="with --projections: the projections whose names start so")
    ns = ap.parse_args(argv)
    if why := missing():
        print(f"bench_gemm_epilogue: {why}", file=sys.stderr)
        return 2
    import quack.gemm_interface as quack

    gen = torch.Generator().manual_seed(0)
    if ns.projections:
        return projections(quack, gen, ns)
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


def projections(quack, gen: torch.Generator, ns: argparse.Namespace) -> int:
    from quack.gemm_config import GemmConfig

    from flux_kernels.runtime.timing import sustained

    configs = quack_configs(GemmConfig) if ns.configs else []
    timer = None
    if ns.sustained:
        from flux_trainer.metrics.nvml import NvmlReader

        energy = NvmlReader(torch.cuda.current_device()).energy_j
        timer = lambda fn: sustained(fn, ns.sustained, energy if energy() is not None else None)  # noqa: E731
    rows = []
    for case in [c for c in PROJECTIONS if c[0].startswith(ns.only)]:
        name, calls, m, k, n, how, bias = case
        where = {"shape": name, "calls": calls, "m": m, "k": k, "n": n}
        variants = projection_variants(case, quack, gen, configs=configs, tuned=not ns.sustained)
        rows += [measure(v, 2 * m * k * n, ns.reps, where, timer) for v in variants]
    print(f"{'projection':20} {'calls':>5} {'variant':20} {'ms':>8} {'TFLOP/s':>8} {'TFLOP/J':>8} {'W':>4} "
          f"{'rel. err':>9}")  # fmt: skip
    for r in rows:
        err = f"{r['rel_err']:9.1e}" if "rel_err" in r else " " * 9
        per_j = f"{r['tflop_per_j']:8.3f} {r['w']:4.0f}" if "tflop_per_j" in r else " " * 13
        timing = f"{r['ms']:8.4f} {r['tflops']:8.1f} {per_j}" if "ms" in r else f"{r['error']}"
        print(f"{r['shape']:20} {r['calls']:5} {r['variant']:20} {timing} {err}")
    totals = step_totals(rows)
    print("ms a step: " + ", ".join(f"{v} {t:.2f}" if t is not None else f"{v} -" for v, t in totals.items()))
    if ns.out:
        out = {"device": torch.cuda.get_device_name(), "rows": rows, "ms_per_step": totals}
        ns.out.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
