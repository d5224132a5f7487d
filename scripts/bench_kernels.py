"""Benchmark flux_kernels at FLUX.1 shapes: fast vs reference, forward+backward, on one CUDA GPU.

    python scripts/bench_kernels.py --out bench_kernels.json            # ops + attention backends
    python scripts/bench_kernels.py --blocks --out bench_kernels.json   # + whole sd-scripts blocks (needs a checkout)

Per op, forward+backward (gradients of every input that needs one), for the eager reference, the reference under
torch.compile (what `compile_blocks` would make of it; the number to beat) and the Triton kernel, two times:
  wall  median of --reps CUDA-event timings of one isolated call. At these sizes (~30-300 us of GPU work) this
        is mostly the CPU launching kernels: every column pays Python, dispatcher and autograd overhead.
  gpu   the sum of the GPU kernel durations per call (torch.profiler): the time the op occupies the GPU inside
        a training step, where the CPU runs ahead of a GPU busy with matmuls. Speedups are computed from this.
GB/s is the op's minimum traffic (bytes it must read and write, forward and backward) over the GPU time, the
same byte count for every column so the columns compare (an H200 streams ~4 TB/s).
With --lora, one FLUX Linear with a LoRA, forward+backward: as sd-scripts has it, against the frozen Linear alone,
the LoRA folded into the frozen GEMM and a hand-written backward (the measurement behind not folding it).
With --single-qkv, the single block's linear1 gradient (q, k, v's and GELU's parts, `single_qkv_bwd`) at 4608
tokens: the Triton kernels for every column against GELU's part compiled by inductor.
With --prodigy, one Prodigy optimizer step over FLUX's 608 LoRA tensors: prodigyopt's against flux_kernels', with
its flat buffers and with multi-tensor ops only.
With --l2, one compiled double and single block without and with an L2 persistence window (flux_kernels.memory.l2) over
the input activation (hit ratio 1 and 0.5) or a weight: does pinning them in L2 pay (GPU time against none)?
With --blocks, one double and one single block at full size in four configurations (sd-scripts as is, patched
with the kernels, compiled, compiled + kernels), installed as in training (verified on tiny inputs first): wall
and GPU time, the bytes kept for backward and the peak memory of one forward+backward.
Without CUDA it says so and exits 0 (`--device cpu --tiny` runs the same code on CPU, for its own test).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
from dataclasses import asdict
from pathlib import Path

import torch

from flux_kernels.ops import reference
from flux_kernels.patches import patch
from flux_kernels.patches.attention.probe import library_versions, probe_attention
from flux_kernels.runtime.device import device_info
from flux_kernels.runtime.examples import gated_example, gated_modulate_example, modulate_example, qk_example
from flux_kernels.runtime.registry import REGISTRY, TOLERANCE, unchecked
from flux_kernels.runtime.timing import median_ms

OPS = ("qk_norm_rope", "modulate", "gated_residual", "gated_modulate")
BLOCK_KERNELS = ("attention", "qk_norm_rope", "modulate", "gated_residual", "gated_modulate")


def gpu_ms(fn, dev: torch.device, reps: int) -> float | None:
    """GPU kernel time per call (ms): the durations of every kernel, memset and copy fn() launches, from
    torch.profiler, summed and divided by reps. None off CUDA or where the profiler cannot see the GPU."""
    if dev.type != "cuda":
        return None
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize(dev)
    try:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(reps):
                fn()
            torch.cuda.synchronize(dev)
        us = sum(e.device_time_total for e in prof.events() if e.device_type == DeviceType.CUDA)
    except Exception:  # noqa: BLE001 - no CUPTI here: the wall column still stands
        return None
    return us / reps / 1e3 if us else None


def saved_and_peak(fn, args, dev: torch.device, exclude=()) -> tuple[float, float | None]:
    """(MiB kept for backward by one forward of fn(*args) (flux_kernels.ops.reference.saved_bytes: parameters, inputs
    and `exclude` not counted), MiB of peak memory of a forward+backward above what was allocated before)."""
    from flux_kernels.ops.reference import saved_bytes

    saved = saved_bytes(fn, args, also_skip=exclude) / 2**20
    if dev.type != "cuda":
        return saved, None
    run = fwd_bwd(fn, args)
    torch.cuda.synchronize(dev)
    base = torch.cuda.memory_allocated(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    run()
    torch.cuda.synchronize(dev)
    return saved, (torch.cuda.max_memory_allocated(dev) - base) / 2**20


def fwd_bwd(fn, args):
    """A closure running fn(*args) and the gradients of every input that requires grad."""
    from torch.utils._pytree import tree_flatten

    wrt = [t for t in tree_flatten(args)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
    outs = fn(*args)
    outs = list(outs) if isinstance(outs, tuple) else [outs]
    grads = [torch.randn_like(o) for o in outs]

    def run():
        o = fn(*args)
        o = list(o) if isinstance(o, tuple) else [o]
        return torch.autograd.grad(o, wrt, grads)

    return run


def op_cases(dev, dtype, s):
    """(name, args, bytes moved fwd+bwd) at FLUX shapes; q/k as strided views of the qkv projection output."""
    e = torch.empty(0, dtype=dtype).element_size()
    B, H, D, lt, li, C = s["batch"], s["heads"], s["head_dim"], s["txt"], s["img"], s["hidden"]
    L = lt + li
    n_qk = B * H * L * D
    pe_bytes = L * D * 8
    rows = B * L * C
    return {
        # read q,k + write q,k (fwd); read dq_out,dk_out,q,k + write dq,dk (bwd); pe read twice
        "qk_norm_rope": (qk_example(dev, dtype, B, H, D, lt, li), 10 * n_qk * e + 2 * pe_bytes),
        # fwd: read x, write out; bwd: read dy, x, write dx
        "modulate": (modulate_example(dev, dtype, B, L, C), 5 * rows * e),
        # fwd: read x, y, write out; bwd: read dout, y, write dy (dx is dout itself)
        "gated_residual": (gated_example(dev, dtype, B, L, C), 6 * rows * e),
        # fwd: read x, y, write res, out; bwd: read dres, dout, x, y, write dx, dy
        "gated_modulate": (gated_modulate_example(dev, dtype, B, L, C), 10 * rows * e),
    }


def time_variants(
    row: dict, variants: dict, args, dev, warmup: int, reps: int, rate_key: str, rate, make_run=fwd_bwd
) -> None:
    """Into `row`, per variant `label`: label_ms (wall), label_gpu_ms (where the profiler sees the GPU) and
    label_<rate_key> = rate(ms), from GPU time where measured; label_error instead if it fails. What is timed is
    make_run(fn, args): forward and backward by default."""
    for label, fn in variants.items():
        try:
            run = make_run(fn, args)
            row[f"{label}_ms"] = median_ms(run, dev, warmup, reps)
            gpu = gpu_ms(run, dev, reps)
            if gpu is not None:
                row[f"{label}_gpu_ms"] = gpu
            row[f"{label}_{rate_key}"] = rate(gpu or row[f"{label}_ms"])
        except Exception as e:  # noqa: BLE001 - report and go on with the other columns
            row[f"{label}_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"


def bench_ops(dev, dtype, s, names, warmup, reps, compiled: bool) -> list[dict]:
    rows = []
    for name, (args, nbytes) in op_cases(dev, dtype, s).items():
        if name not in names:
            continue
        spec = REGISTRY[name]
        row = {"name": name, "bytes": nbytes}
        variants = {"ref": spec.reference, "fast": spec.fast}
        if compiled:
            variants["ref_compiled"] = torch.compile(spec.reference)
        time_variants(row, variants, args, dev, warmup, reps, "gbps", lambda ms, nbytes=nbytes: nbytes / ms / 1e6)
        t = "_gpu_ms" if "fast_gpu_ms" in row else "_ms"  # speedups from GPU time where measured
        if f"ref{t}" in row and f"fast{t}" in row:
            row["speedup"] = row[f"ref{t}"] / row[f"fast{t}"]
            if f"ref_compiled{t}" in row:
                row["speedup_vs_compiled"] = row[f"ref_compiled{t}"] / row[f"fast{t}"]
        rows.append(row)
    return rows


FP8_SHAPES = {  # (tokens M, in K, out N) of the FLUX.1 linears at 1024^2, batch 1
    "img_qkv": (4096, 3072, 9216),
    "txt_qkv": (512, 3072, 9216),
    "img_mlp_up": (4096, 3072, 12288),
    "img_mlp_down": (4096, 12288, 3072),
    "single_linear1": (4608, 3072, 21504),
    "single_linear2": (4608, 15360, 3072),
}


def bench_fp8(dev, warmup, reps, tiny: bool, compiled: bool = True) -> list[dict]:
    """One frozen Linear, forward + input gradient (4*M*K*N FLOP), four ways: a bf16 weight (a bf16 base), the
    fp8 weight upcast per call (sd-scripts' fp8_base), fp8_matmul eager and compiled (quantisation fused)."""
    from flux_kernels.patches import fp8

    rows = []
    shapes = {"tiny": (64, 256, 512)} if tiny else FP8_SHAPES
    for name, (m, k, n) in shapes.items():
        gen = torch.Generator().manual_seed(0)
        w = (torch.randn(n, k, generator=gen) * 0.02).to(dev)
        w8, scale = fp8.quantize_weight(w)
        wb = w.to(torch.bfloat16)
        x = torch.randn(1, m, k, generator=gen).to(dev, torch.bfloat16).requires_grad_()
        flop = 4 * m * k * n
        row = {"name": name, "shape": f"{m}x{k}x{n}"}
        variants = {
            "bf16": functools.partial(torch.nn.functional.linear, weight=wb),
            "upcast": functools.partial(fp8.reference_linear, w8=w8, w_scale=scale),
            "fp8": functools.partial(fp8.fp8_linear, w8=w8, w_scale=scale),
        }
        if compiled:
            variants["fp8_compiled"] = torch.compile(variants["fp8"])
            # as in a compiled block, the activation comes from an op (here GELU): its quantisation fused into that
            # op's kernel (fp8.QUANTIZE_IN_GRAPH, what auto does) vs a separate quantising pass inside the matmul op
            for label, in_graph in (("gelu_bf16", None), ("gelu_fp8_in_op", False), ("gelu_fp8_fused", True)):
                variants[label] = _gelu_then(wb if in_graph is None else (w8, scale), in_graph)
        time_variants(row, variants, (x,), dev, warmup, reps, "tflops", lambda ms, flop=flop: flop / ms / 1e9)
        # the input gradient's transposed fp8 weight: PyTorch's strided copy vs flux_kernels' tiled Triton copy
        row["transpose_exact"] = torch.equal(fp8.transpose(w8).view(torch.uint8), w8.t().contiguous().view(torch.uint8))
        for label, fn in (("transpose_torch", lambda w8=w8: w8.t().contiguous()),
                          ("transpose_triton", lambda w8=w8: fp8.transpose(w8))):  # fmt: skip
            ms = gpu_ms(fn, dev, reps) or median_ms(fn, dev, warmup, reps)
            row[f"{label}_us"], row[f"{label}_tbps"] = ms * 1e3, 2 * n * k / ms / 1e9
        best = row.get("fp8_compiled_tflops") or row.get("fp8_tflops")
        if best and row.get("bf16_tflops") and row.get("upcast_tflops"):
            row["vs_bf16"] = best / row["bf16_tflops"]
            row["vs_upcast"] = best / row["upcast_tflops"]
        rows.append(row)
    return rows


LORA_LINEARS = {  # name: (tokens, in, out, how many per step) at 1024² (4096 image + 512 text tokens)
    "single.linear1": (4608, 3072, 21504, 38), "single.linear2": (4608, 15360, 3072, 38),
    "img.qkv": (4096, 3072, 9216, 19), "img.proj": (4096, 3072, 3072, 19), "img.mlp0": (4096, 3072, 12288, 19),
    "img.mlp2": (4096, 12288, 3072, 19), "txt.qkv": (512, 3072, 9216, 19), "txt.mlp0": (512, 3072, 12288, 19),
    "txt.mlp2": (512, 12288, 3072, 19),
}  # fmt: skip


class _HandLora(torch.autograd.Function):
    """sd-scripts' LoRA with a hand-written backward whose adds ride on cuBLAS's epilogue (addmm)."""

    @staticmethod
    def forward(ctx, x, w, bias, a, b, s):
        h = x @ a.t()
        ctx.save_for_backward(x, h, w, a, b)
        ctx.s = s
        return torch.addmm(torch.addmm(bias, x, w.t()), h, b.t(), alpha=s)

    @staticmethod
    def backward(ctx, dy):
        x, h, w, a, b = ctx.saved_tensors
        g = (dy @ b) * ctx.s
        return torch.addmm(dy @ w, g, a), None, None, g.t() @ x, (dy.t() @ h) * ctx.s, None


def _lora_variants(w: torch.Tensor, bias: torch.Tensor, a0: torch.Tensor, b0: torch.Tensor) -> dict:
    """The five ways bench_lora times, as functions of (x, a, b), each followed by the GELU a FLUX block has there."""
    from flux_kernels.patches import lora_fold

    f, (n, k) = torch.nn.functional, w.shape
    wb, wa = torch.cat([w, b0], dim=1), torch.cat([w, a0], dim=0)

    def folded(x, a, b):
        with torch.no_grad():
            wb[:, k:].copy_(b)  # the trained B kept in the frozen weight's buffer, as lora_fold.sync does
        return f.gelu(lora_fold.folded_linear(x, wb, bias, a, b, 1.0), approximate="tanh")

    def folded_down(x, a, b):
        with torch.no_grad():
            wa[n:].copy_(a)  # the trained A kept below the frozen weight, as lora_fold.sync does
        return f.gelu(lora_fold.folded_down_linear(x, wa, bias, a, b, 1.0), approximate="tanh")

    return {
        "frozen": lambda x, a, b: f.gelu(f.linear(x, w, bias), approximate="tanh"),
        "sd_scripts": lambda x, a, b: f.gelu(f.linear(x, w, bias) + f.linear(f.linear(x, a), b), approximate="tanh"),
        "folded": folded,
        "folded_down": folded_down,
        "hand": lambda x, a, b: f.gelu(_HandLora.apply(x, w, bias, a, b, 1.0), approximate="tanh"),
    }


def _lora_row(name: str, shape: tuple, dev, dtype, warmup: int, reps: int, compiled: bool, rank: int) -> dict:
    m, k, n, count = shape
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(m, k, generator=gen).to(dev, dtype).requires_grad_()
    w, bias = (torch.randn(n, k, generator=gen) / k**0.5).to(dev, dtype), torch.randn(n, generator=gen).to(dev, dtype)
    a = (torch.randn(rank, k, generator=gen) / k**0.5).to(dev, dtype).requires_grad_()
    b = (torch.randn(n, rank, generator=gen) * 0.01).to(dev, dtype).requires_grad_()
    row, want = {"name": name, "shape": f"{m}x{k}->{n}", "per_step": count}, None
    for label, fn in _lora_variants(w, bias, a.detach(), b.detach()).items():
        leaves = (x, a, b) if label != "frozen" else (x,)
        fn = torch.compile(fn) if compiled else fn

        def step(fn=fn, leaves=leaves):
            for t in leaves:
                t.grad = None
            out = fn(x, a, b)
            out.backward(torch.ones_like(out))
            return [out.detach()] + [t.grad for t in leaves]

        got = step()
        if label == "sd_scripts":
            want = got
        elif want is not None:
            row[f"{label}_err"] = max(reference.max_rel_err(g, r) for g, r in zip(got, want, strict=True))
        row[f"{label}_gpu_ms"] = gpu_ms(step, dev, reps)
        row[f"{label}_ms"] = median_ms(step, dev, warmup, reps)
    return row


def bench_lora(dev, warmup, reps, tiny: bool, compiled: bool = True, rank: int = 16) -> list[dict]:
    """One FLUX Linear with a LoRA (r16, scale 1), a GELU after it as in the blocks, forward + backward (input and
    LoRA gradients), five ways: the frozen Linear alone (the floor), sd-scripts' LoRA (frozen + up(down(x)) * s),
    the LoRA folded into the frozen GEMM (flux_kernels.patches.lora_fold: B beside W, or A below W) and a hand-written
    backward (_HandLora); GPU ms
    each, the error against sd-scripts' form, and a last row summing each over one step's layers of these shapes."""
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    shapes = {"tiny": (48, 64, 96, 1)} if tiny else LORA_LINEARS
    rows = [_lora_row(name, shape, dev, dtype, warmup, reps, compiled, rank) for name, shape in shapes.items()]
    key = "gpu_ms" if rows[0].get("frozen_gpu_ms") is not None else "ms"
    total = {"name": "one step's layers", "shape": "", "per_step": sum(r["per_step"] for r in rows)}
    for label in ("frozen", "sd_scripts", "folded", "folded_down", "hand"):
        total[f"{label}_{key}"] = sum(r[f"{label}_{key}"] * r["per_step"] for r in rows)
    return [*rows, total]


def _gelu_then(weight, quantize_in_graph: bool | None):
    """torch.compile'd GELU followed by the frozen Linear: bf16 (None), or fp8 with the activation quantised in the
    graph or inside the op (fp8.QUANTIZE_IN_GRAPH set for each call, so each compiled variant keeps its own)."""
    from flux_kernels.patches import fp8

    def f(x):
        h = torch.nn.functional.gelu(x, approximate="tanh")
        if quantize_in_graph is None:
            return torch.nn.functional.linear(h, weight)
        return fp8.fp8_linear(h, *weight)

    compiled = torch.compile(f)

    def run(x):
        before = fp8.QUANTIZE_IN_GRAPH
        fp8.QUANTIZE_IN_GRAPH = bool(quantize_in_graph)
        try:
            return compiled(x)
        finally:
            fp8.QUANTIZE_IN_GRAPH = before

    return run


LORA_SHAPES = {  # (out, in): how many LoRA modules of FLUX.1 have this weight shape (lora_flux, all blocks: 304)
    (9216, 3072): 2 * 19 + 38,  # img/txt qkv; single-block modulation
    (3072, 3072): 2 * 19,  # img/txt attention proj
    (12288, 3072): 2 * 19,  # img/txt mlp.0
    (3072, 12288): 2 * 19,  # img/txt mlp.2
    (18432, 3072): 2 * 19,  # img/txt modulation
    (21504, 3072): 38,  # single linear1
    (3072, 15360): 38,  # single linear2
}


def bench_lora_norms(dev, warmup, reps, tiny: bool, rank: int = 16) -> list[dict]:
    """The LoRA gradient row norms sd-scripts computes after every backward: its weight-sized product under
    autocast (what LoRAModule.update_grad_norms does) against flux_kernels' Gram-matrix version, per weight shape
    and summed over FLUX's 304 modules (one step); errors against the float64 product."""
    from flux_kernels.patches import lora_norms

    def sd_scripts_way(up, down, d_up, d_down, scale):
        with torch.autocast(dev.type):
            return torch.norm(scale * ((up @ d_down) + (d_up @ down)), dim=1, keepdim=True)

    rows, shapes = [], ({(40, 72): 3} if tiny else LORA_SHAPES)
    for (out, inp), count in shapes.items():
        gen = torch.Generator().manual_seed(out + inp)
        up, d_up = (torch.randn(out, rank, generator=gen).to(dev) * s for s in (0.01, 1e-4))
        down, d_down = (torch.randn(rank, inp, generator=gen).to(dev) * s for s in (0.05, 1e-4))
        want = lora_norms.reference_row_norms(up, down, d_up, d_down, 1.0)
        row = {"name": f"{out}x{inp}", "modules": count}
        for label, fn in (("sd_scripts", sd_scripts_way), ("gram", lora_norms.row_norms)):
            got = fn(up, down, d_up, d_down, 1.0).float()
            row[f"{label}_max_rel_err"] = ((got - want).abs() / want.abs().clamp_min(1e-30)).max().item()
            call = functools.partial(fn, up, down, d_up, d_down, 1.0)
            ms = gpu_ms(call, dev, reps) or median_ms(call, dev, warmup, reps)
            row[f"{label}_us"], row[f"{label}_step_ms"] = ms * 1e3, ms * count
        rows.append(row)
    total = {"name": "all (one step)", "modules": sum(r["modules"] for r in rows)}
    for label in ("sd_scripts", "gram"):
        total[f"{label}_step_ms"] = sum(r[f"{label}_step_ms"] for r in rows)
        total[f"{label}_max_rel_err"] = max(r[f"{label}_max_rel_err"] for r in rows)
    total["speedup"] = total["sd_scripts_step_ms"] / total["gram_step_ms"]
    # A whole step's worth, wall time (CUDA events around the loop): per module, ~10 small kernels each, the CPU
    # launching them is the cost; batched per shape is what the installed kernel runs.
    factors = []
    for (out, inp), count in shapes.items():
        gen = torch.Generator().manual_seed(out * inp)
        for _ in range(count):
            up, d_up = (torch.randn(out, rank, generator=gen).to(dev) * s for s in (0.01, 1e-4))
            down, d_down = (torch.randn(rank, inp, generator=gen).to(dev) * s for s in (0.05, 1e-4))
            factors.append((up, down, d_up, d_down))
    groups: dict[tuple, list] = {}
    for f in factors:
        groups.setdefault((f[0].shape, f[1].shape), []).append(f)

    def batched(triton=None):
        for members in groups.values():
            lora_norms.batched_row_norms(*zip(*members, strict=True), 1.0, triton=triton)

    for label, call in (
        ("sd_scripts", lambda: [sd_scripts_way(*f, 1.0) for f in factors]),
        ("gram", lambda: [lora_norms.row_norms(*f, 1.0) for f in factors]),
        ("batched", batched),
    ):
        total[f"{label}_wall_ms"] = median_ms(call, dev, warmup, reps)
    total["batched_gpu_ms"] = gpu_ms(batched, dev, reps)
    if dev.type == "cuda":  # the same with the out-sized side in torch's float64 ops instead of the Triton kernel
        total["batched_torch_gpu_ms"] = gpu_ms(functools.partial(batched, False), dev, reps)
        total["batched_max_diff"] = max(
            (lora_norms.batched_row_norms(*zip(*m, strict=True), 1.0) - lora_norms.batched_row_norms(
                *zip(*m, strict=True), 1.0, triton=False)).abs().max().item() for m in groups.values()
        )  # fmt: skip
    return [*rows, total]


def bench_single_qkv(dev, warmup, reps, tiny: bool) -> list[dict]:
    """The single block's linear1 gradient from q, k, v's and the MLP activation's (flux_kernels' `single_qkv_bwd`
    op) at 4608 tokens x 21504 columns: the Triton kernels writing every column (`gelu_in_kernel`, where lora_fold
    mirror-folds linear2) against the kernel for q, k, v with GELU's part compiled by inductor into the same buffer
    (the path elsewhere), both under torch.compile as the blocks run them. GB/s from the minimum traffic: q, k, v's
    gradients and linear1's qkv columns read and the gradient's written; the MLP's incoming gradient and columns
    read and its gradient written."""
    from flux_kernels.ops import fast, reference
    from flux_kernels.patches import single_qkv
    from flux_kernels.runtime.device import triton_runs_on

    if not triton_runs_on(dev):
        return [{"name": "single_qkv_bwd", "skipped": f"no Triton on {dev.type} (CUDA, or TRITON_INTERPRET=1)"}]
    B, L, H, D, M = (1, 9, 2, 128, 40) if tiny else (1, 4608, 24, 128, 12288)
    width = 3 * H * D
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    gen = torch.Generator().manual_seed(0)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(dev, dtype)

    lin1 = rnd(B, L, width + M, scale=2.0)
    d_act = rnd(B, L, H * D + M)[..., H * D :]  # a column slice of linear2's input gradient, as training hands it
    dq, dk, dv = (rnd(B, L, H, D).transpose(1, 2) for _ in range(3))  # FlashAttention-4's: token-major
    q, k, _ = reference.heads(lin1[..., :width], H)
    rq, rk = (torch.rsqrt(t.float().pow(2).mean(-1, keepdim=True) + single_qkv.EPS) for t in (q, k))
    q_scale, k_scale = (torch.rand(D, generator=gen).to(dev) + 0.5 for _ in range(2))
    pe = reference.make_pe(B, L, D, device=dev).float()
    args = (dq, dk, dv, lin1, rq, rk, q_scale, k_scale, pe, d_act)
    fast._ops_lib()

    def kernel(dq, dk, dv, lin1, rq, rk, q_scale, k_scale, pe, d_act):
        grad = torch.empty_like(lin1)
        fast._kernel("single_qkv_bwd", lin1)(dq, dk, dv, lin1, rq, rk, q_scale, k_scale, pe, grad, d_act)
        return grad

    def inductor_gelu(dq, dk, dv, lin1, rq, rk, q_scale, k_scale, pe, d_act):
        grad = torch.empty_like(lin1)
        grad[..., width:] = torch.ops.aten.gelu_backward(d_act, lin1[..., width:], approximate="tanh")
        fast._kernel("single_qkv_bwd", lin1)(dq, dk, dv, lin1, rq, rk, q_scale, k_scale, pe, grad)
        return grad

    e = torch.empty(0, dtype=dtype).element_size()
    nbytes = (3 * width + 3 * M) * B * L * e
    row = {"name": f"{L}x{width + M}", "bytes": nbytes}
    variants = {"kernels": torch.compile(kernel), "inductor_gelu": torch.compile(inductor_gelu)}
    time_variants(row, variants, args, dev, warmup, reps, "gbps", lambda ms: nbytes / ms / 1e6,
                  make_run=lambda fn, a: functools.partial(fn, *a))  # fmt: skip
    if not [k for k in row if k.endswith("_error")]:
        t = "_gpu_ms" if "kernels_gpu_ms" in row and "inductor_gelu_gpu_ms" in row else "_ms"
        row["speedup"] = row[f"inductor_gelu{t}"] / row[f"kernels{t}"]
        row["max_rel_err"] = reference.max_rel_err(variants["kernels"](*args), variants["inductor_gelu"](*args))
    return [row]


def bench_prodigy(dev, warmup, reps, tiny: bool, rank: int = 16) -> list[dict]:
    """One Prodigy optimizer step over FLUX's LoRA tensors (304 modules: 608 fp32 factors plus nothing else here),
    prodigyopt's own step against flux_kernels.ops.prodigy's: wall time per step (the CPU launching kernels and waiting
    on the device is what differs), GPU time, and how far the parameters are apart after the timed steps."""
    from prodigyopt import Prodigy

    from flux_kernels.ops import prodigy

    shapes = {(40, 72): 3} if tiny else LORA_SHAPES
    gen = torch.Generator().manual_seed(0)
    start = []
    for (out, inp), count in shapes.items():
        for _ in range(count):
            start += [torch.randn(rank, inp, generator=gen) * 0.05, torch.zeros(out, rank)]  # down, up (zero)
    grads = [(torch.randn(t.shape, generator=gen) * 1e-3).to(dev) for t in start]
    row = {"name": f"{len(start)} tensors", "params_m": sum(t.numel() for t in start) / 1e6}
    finals = {}
    for label in ("prodigyopt", "multi_tensor", "flux_kernels"):
        params = [torch.nn.Parameter(t.to(dev)) for t in start]
        opt = Prodigy(params, lr=1.0, weight_decay=0.01, decouple=True, use_bias_correction=True, safeguard_warmup=True)
        if label != "prodigyopt":
            prodigy.install(opt)
        prodigy.FLAT = label == "flux_kernels"  # multi_tensor: the same step without the flat buffers

        def step(params=params, opt=opt):
            for p, g in zip(params, grads, strict=True):
                p.grad = g
            opt.step()

        row[f"{label}_wall_ms"] = median_ms(step, dev, warmup, reps)
        row[f"{label}_gpu_ms"] = gpu_ms(step, dev, reps)
        finals[label] = params
    prodigy.FLAT = True
    row["speedup_wall"] = row["prodigyopt_wall_ms"] / row["flux_kernels_wall_ms"]
    row["speedup_wall_vs_multi_tensor"] = row["multi_tensor_wall_ms"] / row["flux_kernels_wall_ms"]
    for label in ("multi_tensor", "flux_kernels"):
        row[f"{label}_max_rel_diff"] = max(
            reference.max_rel_err(b, a) for a, b in zip(finals["prodigyopt"], finals[label], strict=True)
        )
    return [row]


BLOCK_CONFIGS = ("sd_scripts", "kernels", "compiled", "compiled_kernels")


def random_blocks(dev, dtype, s) -> tuple[dict, dict]:
    """One sd-scripts double and single block (random frozen weights, on the CPU until used) and their inputs on
    `dev` (activations need grad)."""
    from flux_trainer.sdscripts.checkout import import_sd_scripts, locate

    fm = import_sd_scripts(locate().path).flux_models
    B, C, H, lt, li, D = s["batch"], s["hidden"], s["heads"], s["txt"], s["img"], s["head_dim"]
    blocks = {
        "double": fm.DoubleStreamBlock(C, H, 4.0, qkv_bias=True),
        "single": fm.SingleStreamBlock(C, H, 4.0),
    }
    gen = torch.Generator().manual_seed(0)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen).to(dev, dtype).requires_grad_()

    pe = reference.make_pe(1, lt + li, D, device=dev)
    inputs = {
        "double": (rnd(B, li, C), rnd(B, lt, C), rnd(B, C), pe),
        "single": (rnd(B, lt + li, C), rnd(B, C), pe),
    }
    for block in blocks.values():
        block.requires_grad_(False)
        for p in block.parameters():
            p.data = (1 + 0.1 * torch.randn_like(p)) if p.dim() == 1 and p.shape[0] == D else 0.02 * torch.randn_like(p)
    return blocks, inputs


def bench_blocks(dev, dtype, s, warmup, reps) -> list[dict]:
    """Whole sd-scripts blocks (random weights, frozen, inputs need grad) in four configurations, the kernels
    installed as training installs them (apply_kernels verifies them on tiny inputs first)."""
    blocks, inputs = random_blocks(dev, dtype, s)
    kernels = unchecked(list(BLOCK_KERNELS))
    rows = []
    for kind, block in blocks.items():
        block.to(dev, dtype)
        for label in BLOCK_CONFIGS:
            row = {"name": f"{kind}/{label}", "tokens": inputs[kind][0].shape[1]}
            patch.remove_kernels(block)
            torch._dynamo.reset()
            try:
                if "kernels" in label:
                    patch.apply_kernels(block, kernels)
                if label.startswith("compiled"):
                    block.compile()
                run = fwd_bwd(block, inputs[kind])
                row["ms"] = median_ms(run, dev, warmup, reps)
                row["gpu_ms"] = gpu_ms(run, dev, reps)
                row["saved_mib"], row["peak_mib"] = saved_and_peak(block, inputs[kind], dev, list(block.parameters()))
            except Exception as e:  # noqa: BLE001
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
            rows.append(row)
        patch.remove_kernels(block)
        torch._dynamo.reset()
        block.to("cpu")
    return rows


L2_WINDOWS = {  # what an L2 persistence window covers in a compiled block's forward+backward, and its hit ratio
    "double": [("input", "img", 1.0), ("input", "img", 0.5), ("qkv weight", "img_attn.qkv.weight", 1.0),
               ("mlp weight", "img_mlp.0.weight", 1.0)],
    "single": [("input", "x", 1.0), ("input", "x", 0.5), ("linear1 weight", "linear1.weight", 1.0)],
}  # fmt: skip


def bench_l2(dev, dtype, s, warmup, reps) -> list[dict]:
    """A compiled double and single block, forward+backward, without and with an L2 persistence window
    (flux_kernels.memory.l2) over its input activation or one of its weights: GPU time, and the ratio to no window."""
    from flux_kernels.memory import l2

    info = l2.l2_info(dev)
    blocks, inputs = random_blocks(dev, dtype, s)
    rows = []
    for kind, block in blocks.items():
        block.to(dev, dtype)
        torch._dynamo.reset()
        block.compile()
        args = inputs[kind]
        run = fwd_bwd(block, args)
        base = {"name": f"{kind}/none", "gpu_ms": gpu_ms(run, dev, reps), "ms": median_ms(run, dev, warmup, reps)}
        rows.append(base)
        named = {"img": args[0], "x": args[0], **dict(block.named_parameters())}
        for label, what, ratio in L2_WINDOWS[kind]:
            row = {"name": f"{kind}/{label} x{ratio}", "l2_mib": info.l2_bytes / 2**20}
            try:
                with l2.persisting_window(named[what].detach(), ratio) as covered:
                    row["window_mib"] = covered / 2**20
                    row["gpu_ms"] = gpu_ms(run, dev, reps)
                    row["ms"] = median_ms(run, dev, warmup, reps)
                if row["gpu_ms"] and base["gpu_ms"]:
                    row["vs_none"] = row["gpu_ms"] / base["gpu_ms"]
            except Exception as e:  # noqa: BLE001 - report the failure in the table, keep measuring
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
            rows.append(row)
        block.to("cpu")
        torch._dynamo.reset()
    return rows


def bench_offload(dev, warmup: int, reps: int, tiny: bool) -> list[dict]:
    """The host link activation_offload uses: page-locked copies of FLUX-sized saved tensors (27 MiB: [4608, 3072]
    bf16) to the host, back, and both at once on two streams (as the offload's streams run at the turn from forward
    to backward), in GB/s from CUDA events over a batch of copies."""
    n, numel = (4, 4096) if tiny else (32, 4608 * 3072)
    gpu = [torch.randn(numel, device=dev).to(torch.bfloat16) for _ in range(n)]
    host = [torch.empty(numel, dtype=torch.bfloat16, pin_memory=True) for _ in range(n)]
    gpu2 = [torch.empty_like(g) for g in gpu]
    host2 = [torch.empty_like(h, pin_memory=True) for h in host]
    out, back = torch.cuda.Stream(dev), torch.cuda.Stream(dev)
    moved = n * numel * 2

    def to_host():
        with torch.cuda.stream(out):
            for g, h in zip(gpu, host, strict=True):
                h.copy_(g, non_blocking=True)

    def to_gpu():
        with torch.cuda.stream(back):
            for g, h in zip(gpu2, host2, strict=True):
                g.copy_(h, non_blocking=True)

    def timed(*fns) -> float:
        times = []
        for i in range(warmup + reps):
            torch.cuda.synchronize(dev)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for s in (out, back):
                s.wait_event(start)
            for fn in fns:
                fn()
            for s in (out, back):
                torch.cuda.current_stream(dev).wait_stream(s)
            end.record()
            torch.cuda.synchronize(dev)
            if i >= warmup:
                times.append(start.elapsed_time(end) / 1e3)
        return statistics.median(times)

    rows = []
    for name, fns in (("to host", (to_host,)), ("to GPU", (to_gpu,)), ("both at once", (to_host, to_gpu))):
        t = timed(*fns)
        rows.append({"name": name, "tensors": n, "mib_each": numel * 2 / 2**20, "ms": t * 1e3,
                     "gbps_each_way": moved / t / 1e9})  # fmt: skip
    return rows


def print_table(title: str, rows: list[dict], cols: list[str]) -> None:
    print(f"\n{title}")
    name_w = max([4, *(len(r["name"]) for r in rows)])
    widths = [max(9, len(c)) for c in cols]
    print("  ".join([f"{'name':>{name_w}}", *(f"{c:>{w}}" for c, w in zip(cols, widths, strict=True))]))
    for r in rows:
        cells = []
        for c, w in zip(cols, widths, strict=True):
            v = r.get(c)
            cells.append(f"{v:{w}.3f}" if isinstance(v, float) else f"{str(v if v is not None else '-'):>{w}}")
        print("  ".join([f"{r['name']:>{name_w}}", *cells]))
        for k, v in r.items():
            if k == "error" or k.endswith("_error"):
                print(f"{'':>{name_w + 2}}{k}: {v}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, help="write the results as JSON here")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--kernels", default=",".join(OPS), help="comma-separated ops to time")
    ap.add_argument("--no-compiled", action="store_true", help="skip the torch.compile'd reference column")
    ap.add_argument("--no-attention", action="store_true", help="skip the attention backend table")
    ap.add_argument("--blocks", action="store_true", help="also time whole sd-scripts blocks (needs a checkout)")
    ap.add_argument("--fp8", action="store_true", help="also time fp8 frozen matmuls at the FLUX linear shapes")
    ap.add_argument("--lora-norms", action="store_true", help="also time the per-step LoRA gradient row norms")
    ap.add_argument("--lora", action="store_true", help="also time a FLUX Linear's LoRA: as sd-scripts has it, folded")
    ap.add_argument("--prodigy", action="store_true", help="also time one Prodigy step over FLUX's LoRA tensors")
    ap.add_argument("--single-qkv", action="store_true", help="also time the single block's linear1-gradient kernels")
    ap.add_argument("--l2", action="store_true", help="also time compiled blocks with an L2 persistence window")
    ap.add_argument("--offload", action="store_true", help="also time activation_offload's page-locked copies")
    ap.add_argument("--tiny", action="store_true", help="small shapes (a smoke test of this script)")
    ns = ap.parse_args(argv)

    dev = torch.device(ns.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        print("bench_kernels: no CUDA device here; nothing to benchmark (skipped)")
        if ns.out:
            ns.out.write_text(json.dumps({"skipped": "no CUDA device"}) + "\n")
        return 0
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[ns.dtype]
    s = dict(batch=1, heads=24, head_dim=128, txt=512, img=4096, hidden=3072)
    if ns.tiny:
        s = dict(batch=1, heads=2, head_dim=128, txt=3, img=5, hidden=256)
    info = device_info(dev)
    result = {"device": asdict(info), "versions": library_versions(), "dtype": ns.dtype, "shapes": s,
              "reps": ns.reps, "tolerance": TOLERANCE[dtype]}  # fmt: skip
    names = [n for n in ns.kernels.split(",") if n]
    result["ops"] = bench_ops(dev, dtype, s, names, ns.warmup, ns.reps, not ns.no_compiled)
    print(f"{info.name} ({info.family}), {ns.dtype}, shapes {s}, median of {ns.reps}")
    cols = ["ref_ms", "ref_compiled_ms", "fast_ms", "ref_gpu_ms", "ref_compiled_gpu_ms", "fast_gpu_ms", "speedup",
            "speedup_vs_compiled", "ref_compiled_gbps", "fast_gbps"]  # fmt: skip
    print_table("ops, forward+backward (ms = wall of one call, gpu_ms = GPU kernel time; speedups from gpu_ms)",
                result["ops"], cols)  # fmt: skip
    for r in result["ops"]:
        if "speedup_vs_compiled" in r:
            verdict = "beats" if r["speedup_vs_compiled"] > 1 else "does NOT beat"
            basis = "GPU time" if "fast_gpu_ms" in r else "wall time"
            print(f"  {r['name']}: Triton {verdict} the compiled reference ({r['speedup_vs_compiled']:.2f}x {basis})")
    if not ns.no_attention:
        shape = (s["batch"], s["heads"], s["txt"] + s["img"], s["head_dim"])
        result["attention"] = {}
        for mask in (False, True):
            res = probe_attention(shape, dtype, dev, mask, use_cache=False, warmup=ns.warmup, reps=ns.reps)
            result["attention"][f"mask={mask}"] = [asdict(r) for r in res]
            print_table(f"attention {shape} mask={mask}", [asdict(r) for r in res], ["ok", "ms_fwd_bwd", "max_err"])
    if ns.fp8:
        result["fp8"] = bench_fp8(dev, ns.warmup, ns.reps, ns.tiny, not ns.no_compiled)
        print_table("fp8 frozen Linear, forward + input gradient (TFLOP/s from GPU time; vs_*: fp8 (compiled) / other)",
                    result["fp8"], ["shape", "bf16_tflops", "upcast_tflops", "fp8_tflops", "fp8_compiled_tflops",
                                    "vs_bf16", "vs_upcast"])  # fmt: skip
        for row in result["fp8"]:
            if row.get("gelu_fp8_in_op_gpu_ms") and row.get("gelu_fp8_fused_gpu_ms"):
                row["in_op_over_fused"] = row["gelu_fp8_in_op_gpu_ms"] / row["gelu_fp8_fused_gpu_ms"]
        print_table("compiled GELU -> frozen Linear, forward + input gradient (GPU ms): bf16, fp8 quantising inside "
                    "the op, fp8 quantisation fused into the GELU", result["fp8"],
                    ["shape", "gelu_bf16_gpu_ms", "gelu_fp8_in_op_gpu_ms", "gelu_fp8_fused_gpu_ms",
                     "in_op_over_fused"])  # fmt: skip
        print_table("fp8 weight transpose for the input gradient (us and TB/s moved, from GPU time)", result["fp8"],
                    ["shape", "transpose_torch_us", "transpose_triton_us", "transpose_torch_tbps",
                     "transpose_triton_tbps", "transpose_exact"])  # fmt: skip
    if ns.lora:
        result["lora"] = bench_lora(dev, ns.warmup, ns.reps, ns.tiny, not ns.no_compiled)
        print_table("a Linear + LoRA r16 + GELU, forward + backward, GPU ms (last row: x per_step, summed)",
                    result["lora"], ["shape", "per_step", "frozen_gpu_ms", "sd_scripts_gpu_ms", "folded_gpu_ms",
                                     "folded_down_gpu_ms", "hand_gpu_ms", "folded_err", "folded_down_err",
                                     "hand_err"])  # fmt: skip
    if ns.lora_norms:
        result["lora_norms"] = bench_lora_norms(dev, ns.warmup, ns.reps, ns.tiny)
        cols = ["modules", "sd_scripts_us", "gram_us", "sd_scripts_step_ms", "gram_step_ms", "sd_scripts_max_rel_err",
                "gram_max_rel_err", "speedup"]  # fmt: skip
        print_table("LoRA gradient row norms, r16 (GPU time; step_ms: x modules of that shape; error vs float64)",
                    result["lora_norms"], cols)  # fmt: skip
        cols = ["modules", "sd_scripts_wall_ms", "gram_wall_ms", "batched_wall_ms", "batched_gpu_ms",
                "batched_torch_gpu_ms", "batched_max_diff"]  # fmt: skip
        print_table("LoRA gradient row norms of one step's modules, wall time (CPU launches included)",
                    result["lora_norms"][-1:], cols)  # fmt: skip
    if ns.single_qkv:
        result["single_qkv"] = bench_single_qkv(dev, ns.warmup, ns.reps, ns.tiny)
        print_table("the single block's linear1 gradient (q, k, v + GELU), compiled; GB/s from GPU time",
                    result["single_qkv"], ["kernels_gpu_ms", "inductor_gelu_gpu_ms", "kernels_gbps",
                                           "inductor_gelu_gbps", "speedup", "max_rel_err"])  # fmt: skip
    if ns.blocks:
        try:
            result["blocks"] = bench_blocks(dev, dtype, s, ns.warmup, ns.reps)
            bcols = ["tokens", "ms", "gpu_ms", "saved_mib", "peak_mib"]
            print_table("blocks, forward+backward (saved_mib: kept for backward; peak_mib: above the inputs)",
                        result["blocks"], bcols)  # fmt: skip
            for kind in ("double", "single"):
                rows = {r["name"].split("/")[1]: r for r in result["blocks"] if r["name"].startswith(kind)}
                c, ck = rows.get("compiled", {}), rows.get("compiled_kernels", {})
                if c.get("gpu_ms") and ck.get("gpu_ms"):
                    print(f"  {kind}: compiled+kernels / compiled = {ck['gpu_ms'] / c['gpu_ms']:.3f} GPU time, "
                          f"{ck['saved_mib'] / c['saved_mib']:.3f} saved bytes")  # fmt: skip
        except Exception as e:  # noqa: BLE001 - no checkout: say so, keep the op results
            result["blocks"] = {"skipped": f"{type(e).__name__}: {e}"}
            print(f"\nblocks skipped: {e}")
    if ns.prodigy:
        result["prodigy"] = bench_prodigy(dev, ns.warmup, ns.reps, ns.tiny)
        cols = ["params_m", "prodigyopt_wall_ms", "multi_tensor_wall_ms", "flux_kernels_wall_ms", "speedup_wall",
                "speedup_wall_vs_multi_tensor", "prodigyopt_gpu_ms", "multi_tensor_gpu_ms", "flux_kernels_gpu_ms",
                "flux_kernels_max_rel_diff"]  # fmt: skip
        print_table("Prodigy optimizer step over FLUX's LoRA tensors (wall: CUDA events around one step)",
                    result["prodigy"], cols)  # fmt: skip
    if ns.l2:
        if dev.type != "cuda":
            result["l2"] = {"skipped": "L2 persistence windows need a CUDA device"}
            print("\nl2 skipped: L2 persistence windows need a CUDA device")
        else:
            result["l2"] = bench_l2(dev, dtype, s, ns.warmup, ns.reps)
            print_table("compiled blocks, forward+backward, with an L2 persistence window (vs_none: GPU time / none)",
                        result["l2"], ["l2_mib", "window_mib", "ms", "gpu_ms", "vs_none"])  # fmt: skip
    if ns.offload:
        if dev.type != "cuda":
            result["offload"] = {"skipped": "page-locked copies need a CUDA device"}
            print("\noffload skipped: page-locked copies need a CUDA device")
        else:
            result["offload"] = bench_offload(dev, ns.warmup, ns.reps, ns.tiny)
            print_table("activation_offload's host link: page-locked copies, GB/s each way (CUDA events)",
                        result["offload"], ["tensors", "mib_each", "ms", "gbps_each_way"])  # fmt: skip
    if ns.out:
        ns.out.write_text(json.dumps(result, indent=1, default=str) + "\n")
        print(f"\nwrote {ns.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
