"""Benchmark flux_kernels at FLUX.1 shapes: fast vs reference, forward+backward, on one CUDA GPU.

    python scripts/bench_kernels.py --out bench_kernels.json            # ops + attention backends
    python scripts/bench_kernels.py --blocks --out bench_kernels.json   # + whole sd-scripts blocks (needs a checkout)

Per op: median of --reps CUDA-event timings of forward+backward (gradients of every input that needs one), for
the eager reference, the reference under torch.compile (what `compile_blocks` would make of it; the number to
beat) and the Triton kernel; GB/s is the kernel's minimum traffic (bytes it must read and write, forward and
backward) over the time, the same byte count for every column so the columns compare. With --blocks, one
double and one single block at full size: sd-scripts as is, patched with the kernels, compiled, and both.
Without CUDA it says so and exits 0 (`--device cpu --tiny` runs the same code on CPU, for its own test).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

from flux_kernels import patch, reference
from flux_kernels.attention import library_versions, probe_attention
from flux_kernels.device import device_info
from flux_kernels.registry import REGISTRY, TOLERANCE, gated_example, modulate_example, qk_example, unchecked

OPS = ("qk_norm_rope", "modulate", "gated_residual")


def timed(fn, dev: torch.device, warmup: int, reps: int) -> float:
    """Median milliseconds of fn() over reps (CUDA events on GPU, perf_counter on CPU)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if dev.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


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
    }


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
        for label, fn in variants.items():
            try:
                row[f"{label}_ms"] = timed(fwd_bwd(fn, args), dev, warmup, reps)
                row[f"{label}_gbps"] = nbytes / row[f"{label}_ms"] / 1e6
            except Exception as e:  # noqa: BLE001 - report and go on with the other columns
                row[f"{label}_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        if "ref_ms" in row and "fast_ms" in row:
            row["speedup"] = row["ref_ms"] / row["fast_ms"]
            if "ref_compiled_ms" in row:
                row["speedup_vs_compiled"] = row["ref_compiled_ms"] / row["fast_ms"]
        rows.append(row)
    return rows


def bench_blocks(dev, dtype, s, warmup, reps) -> list[dict]:
    """Whole sd-scripts blocks (random weights, frozen, inputs need grad) in four configurations."""
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
    kernels = unchecked(["attention", "qk_norm_rope", "modulate", "gated_residual"])
    rows = []
    for kind, block in blocks.items():
        block.to(dev, dtype).requires_grad_(False)
        row = {"name": f"{kind}_block", "tokens": inputs[kind][0].shape[1]}
        for label in ("sd_scripts", "kernels", "compiled", "compiled_kernels"):
            patch.remove_kernels(block)
            torch._dynamo.reset()
            if "kernels" in label:
                patch.apply_kernels(block, kernels, verify=False)
            if label.startswith("compiled"):
                block.compile()
            try:
                row[f"{label}_ms"] = timed(fwd_bwd(block, inputs[kind]), dev, warmup, reps)
            except Exception as e:  # noqa: BLE001
                row[f"{label}_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        patch.remove_kernels(block)
        rows.append(row)
        block.to("cpu")
    return rows


def print_table(title: str, rows: list[dict], cols: list[str]) -> None:
    print(f"\n{title}")
    print("  ".join(f"{c:>18}" for c in ["name", *cols]))
    for r in rows:
        cells = [r.get(c) for c in cols]
        text = [f"{c:18.3f}" if isinstance(c, float) else f"{str(c if c is not None else '-'):>18}" for c in cells]
        print("  ".join([f"{r['name']:>18}", *text]))
        for k, v in r.items():
            if k.endswith("_error"):
                print(f"{'':>20}{k}: {v}")


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
    cols = ["ref_ms", "ref_compiled_ms", "fast_ms", "speedup", "speedup_vs_compiled", "ref_gbps", "fast_gbps"]
    print_table("ops, forward+backward", result["ops"], cols)
    if not ns.no_attention:
        shape = (s["batch"], s["heads"], s["txt"] + s["img"], s["head_dim"])
        result["attention"] = {}
        for mask in (False, True):
            res = probe_attention(shape, dtype, dev, mask, use_cache=False, warmup=ns.warmup, reps=ns.reps)
            result["attention"][f"mask={mask}"] = [asdict(r) for r in res]
            print_table(f"attention {shape} mask={mask}", [asdict(r) for r in res], ["ok", "ms_fwd_bwd", "max_err"])
    if ns.blocks:
        try:
            result["blocks"] = bench_blocks(dev, dtype, s, ns.warmup, ns.reps)
            bcols = ["tokens", "sd_scripts_ms", "kernels_ms", "compiled_ms", "compiled_kernels_ms"]
            print_table("blocks, forward+backward", result["blocks"], bcols)
        except Exception as e:  # noqa: BLE001 - no checkout: say so, keep the op results
            result["blocks"] = {"skipped": f"{type(e).__name__}: {e}"}
            print(f"\nblocks skipped: {e}")
    if ns.out:
        ns.out.write_text(json.dumps(result, indent=1, default=str) + "\n")
        print(f"\nwrote {ns.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
