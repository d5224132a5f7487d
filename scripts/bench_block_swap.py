"""Time sd-scripts' block swap against flux_kernels' `block_swap` and against no swap, at full size: sd-scripts' FLUX
(19 double + 38 single blocks, hidden 3072) with random weights, 4096 image + 512 text tokens, batch 1, gradient
checkpointing on, forward + backward under bf16 autocast as training runs it, at each --swap count. Each row is the
median of --iters steps after --warmup; it also gives the peak card memory, what the swap copied to the card per step
and, for block_swap, the rate its side stream achieved (bytes / the time between its copies' CUDA events). The host
link itself (one double block's weights, page-locked and pageable, to the card) is timed first.

    PYTHONPATH=/tmp/site:/tmp/pkgs:$PWD FLUX_TRAIN_SD_SCRIPTS=/path/to/sd-scripts \\
        python scripts/bench_block_swap.py --json block_swap.json        # needs a CUDA GPU

--dtype fp8 (default) casts the model to e4m3 as sd-scripts' fp8_base does and routes the blocks' Linear layers
through flux_kernels' fp8_matmul (as kernels=auto does on an fp8 base; --no-fp8-kernel leaves sd-scripts' upcast);
--dtype bf16 keeps bf16 weights. `--tiny` runs the same code on the CPU with a small model (hidden 256, 6 + 10
blocks, 24 tokens): a check that it runs, not numbers (sd-scripts' CPU swap is not even correct there, see
tests/unit/test_kernels_block_swap.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from flux_kernels.memory import block_swap as bs

WAYS = ("sd-scripts", "block_swap")
TINY = {"hidden_size": 256, "num_heads": 2, "depth": 6, "depth_single_blocks": 10, "axes_dim": [16, 56, 56]}


def sd_scripts_flux_models():
    from flux_trainer.sdscripts.checkout import import_sd_scripts, locate

    return import_sd_scripts(locate().path).flux_models


def build_flux(fm, dev: torch.device, dtype: torch.dtype, seed: int = 0, **shapes) -> torch.nn.Module:
    """sd-scripts' Flux (FLUX.1-dev's shapes, `shapes` overriding them) on `dev`, seeded random weights made there
    (normal, std 0.02; norm scales 1 + 0.1 normal), frozen, in `dtype` (float8_e4m3fn as sd-scripts' fp8_base
    casts the whole model)."""
    params = dataclasses.replace(fm.configs["dev"].params, **shapes)
    with torch.device("meta"):
        model = fm.Flux(params).to(torch.bfloat16)  # made in bf16 (fp32 would be 48 GB at full size), then cast
    model = model.to_empty(device=dev).requires_grad_(False)
    gen = torch.Generator(device=dev).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0.0, 0.02, generator=gen)
            if name.endswith("scale"):
                p.mul_(5.0).add_(1.0)
    return model.to(dtype)


def flux_inputs(dev: torch.device, img_tokens: int, txt_tokens: int, context: int, vec: int, seed: int = 1) -> dict:
    """One step's inputs as sd-scripts' FLUX training passes them (packed latents, T5 and CLIP outputs, position
    ids on a square grid), made on the CPU from their own generator; `img` and `txt` require grad, so backward
    reaches every block and their gradients are the blocks' input gradients."""
    g = torch.Generator().manual_seed(seed)
    side = max(1, int(img_tokens**0.5))
    img_ids = torch.zeros(1, img_tokens, 3)
    img_ids[0, :, 1] = torch.arange(img_tokens) // side
    img_ids[0, :, 2] = torch.arange(img_tokens) % side
    d = {
        "img": torch.randn(1, img_tokens, 64, generator=g),
        "img_ids": img_ids,
        "txt": torch.randn(1, txt_tokens, context, generator=g),
        "txt_ids": torch.zeros(1, txt_tokens, 3),
        "timesteps": torch.rand(1, generator=g),
        "y": torch.randn(1, vec, generator=g),
        "guidance": torch.full((1,), 3.5),
    }
    d = {k: v.to(dev) for k, v in d.items()}
    d["img"].requires_grad_()
    d["txt"].requires_grad_()
    return d


def train_step(model, inputs: dict, dtype: torch.dtype) -> list[torch.Tensor]:
    """Forward under autocast (an fp8 base computes in bf16) and backward for a fixed random upstream gradient:
    [output, d img, d txt]."""
    dev = inputs["img"].device
    with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
        out = model(**inputs)
    gout = torch.randn(out.shape, generator=torch.Generator().manual_seed(2)).to(dev, out.dtype)
    grads = torch.autograd.grad(out, [inputs["img"], inputs["txt"]], gout)
    return [out.detach(), *grads]


def unswap(model, dev: torch.device) -> None:
    """Whatever swap is on the model off (ours removed, sd-scripts' hooks taken out), every weight on `dev`."""
    bs.remove(model)
    for off in (model.offloader_double, model.offloader_single):
        if off is not None:
            off.set_forward_only(off.forward_only)  # its transfers in flight done
            for h in getattr(off, "remove_handles", []):
                h.remove()
            off.remove_handles = []
            off.thread_pool.shutdown()
    model.offloader_double = model.offloader_single = None
    model.blocks_to_swap = None
    model.to(dev)
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()


def configure(model, way: str, swap: int, dev: torch.device) -> str:
    """The model ready to train with `swap` blocks swapped by `way` (sd-scripts / block_swap), or none with 0; as
    sd-scripts sets it up (enable_block_swap, the rest to the card, prepare), block_swap installed in between as
    flux-train does. Returns block_swap's line, or ''."""
    unswap(model, dev)
    if not swap:
        return ""
    model.enable_block_swap(swap, dev)
    # install copies the weights from the card here (in training they are on the host then: the GPU test does that)
    line = bs.install(model, cpu_for_tests=dev.type != "cuda") if way == "block_swap" else ""
    model.move_to_device_except_swap_blocks(dev)
    model.prepare_block_swap_before_forward()
    return line


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def time_steps(model, inputs: dict, dtype, dev, warmup: int, iters: int) -> dict:
    ours = bs.installed_on(model)
    offs = (ours.double, ours.single) if ours else ()
    for _ in range(warmup):
        train_step(model, inputs, dtype)
    for off in offs:
        off.time_copies = dev.type == "cuda"
        off.copy_stats()
        off.bytes_moved = 0
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    times = []
    for _ in range(iters):
        sync(dev)
        t0 = time.perf_counter()
        train_step(model, inputs, dtype)
        sync(dev)
        times.append(time.perf_counter() - t0)
    row = {"s_per_step": statistics.median(times), "min_s": min(times)}
    if dev.type == "cuda":
        row["peak_gib"] = torch.cuda.max_memory_allocated(dev) / 2**30
    if offs:
        stats = [off.copy_stats() for off in offs]
        copied, seconds = sum(b for b, _ in stats), sum(t for _, t in stats)
        row["h2d_gib_per_step"] = sum(off.bytes_moved for off in offs) / iters / 2**30
        row["h2d_gb_s"] = copied / seconds / 1e9 if seconds else None
        for off in offs:
            off.time_copies = False
    return row


def link(model, dev: torch.device, reps: int = 5) -> dict:
    """One double block's weights to the card from page-locked and from pageable host memory, GB/s (median)."""
    weights = [m.weight.data for _, m in bs.swap_slots(model.double_blocks[0])]
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    out = {"bytes": nbytes}
    for name, pin in (("pinned_gb_s", True), ("pageable_gb_s", False)):
        host = bs.host_copies(weights, pin=pin) if pin else [w.to("cpu") for w in weights]
        dst = [torch.empty_like(w, device=dev) for w in weights]
        rates = []
        for _ in range(reps):
            sync(dev)
            t0 = time.perf_counter()
            for d, h in zip(dst, host, strict=True):
                d.copy_(h, non_blocking=pin)
            sync(dev)
            rates.append(nbytes / (time.perf_counter() - t0) / 1e9)
        out[name] = statistics.median(rates)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--swap", type=int, nargs="+", default=[8, 18, 28, 31])
    ap.add_argument("--dtype", choices=("fp8", "bf16"), default="fp8")
    ap.add_argument("--no-fp8-kernel", action="store_true", help="fp8: leave sd-scripts' upcast to bf16")
    ap.add_argument("--img", type=int, default=4096)
    ap.add_argument("--txt", type=int, default=512)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--json")
    ap.add_argument("--tiny", action="store_true", help="CPU, small model: checks the script runs (no numbers)")
    ns = ap.parse_args(argv)
    if ns.tiny:
        dev, shapes, dtype = torch.device("cpu"), TINY, torch.float32
        ns.swap, ns.img, ns.txt, ns.iters, ns.warmup = [2, 8], 16, 8, 2, 1
        shapes = {**shapes, "context_in_dim": 64, "vec_in_dim": 64}
    elif not torch.cuda.is_available():
        print("bench_block_swap: needs a CUDA GPU (none here); --tiny runs a small CPU check", file=sys.stderr)
        return 2
    else:
        dev, shapes = torch.device("cuda", torch.cuda.current_device()), {}
        dtype = torch.float8_e4m3fn if ns.dtype == "fp8" else torch.bfloat16
    fm = sd_scripts_flux_models()
    model = build_flux(fm, dev, dtype, **shapes).train()
    model.enable_gradient_checkpointing()
    fp8_kernel = dtype == torch.float8_e4m3fn and not ns.no_fp8_kernel
    if fp8_kernel:
        from flux_kernels.patches import patch

        print(patch.install_fp8(model))
    p = model.params
    inputs = flux_inputs(dev, ns.img, ns.txt, p.context_in_dim, p.vec_in_dim)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu (--tiny: no numbers)"
    result = {"device": name, "dtype": str(dtype).removeprefix("torch."), "fp8_matmul": fp8_kernel,
              "img_tokens": ns.img, "txt_tokens": ns.txt, "iters": ns.iters, "warmup": ns.warmup,
              "blocks": [p.depth, p.depth_single_blocks], "rows": []}  # fmt: skip
    if dev.type == "cuda":
        result["link"] = link(model, dev)
        lk = result["link"]
        print(f"host link, one double block ({lk['bytes'] / 2**20:.0f} MiB): {lk['pinned_gb_s']:.1f} GB/s page-locked, "
              f"{lk['pageable_gb_s']:.1f} pageable")  # fmt: skip
    plans = [("none", 0)] + [(w, s) for s in ns.swap for w in WAYS]
    for way, swap in plans:
        line = configure(model, way, swap, dev)
        if line:
            print(line)
        row = {"way": way, "swap": swap, **time_steps(model, inputs, dtype, dev, ns.warmup, ns.iters)}
        result["rows"].append(row)
        print(f"  {way:>10} swap {swap:2d}: {row['s_per_step']:.4f} s/step", flush=True)
    unswap(model, dev)
    base = result["rows"][0]["s_per_step"]
    print(f"\n{name}, {result['dtype']}{' + fp8_matmul' if fp8_kernel else ''}, {ns.img} + {ns.txt} tokens, "
          f"checkpointing, median of {ns.iters}")  # fmt: skip
    print(f"{'swap':>4} {'way':>10} {'s/step':>8} {'x none':>7} {'peak GiB':>9} {'H2D GiB/step':>13} {'H2D GB/s':>9}")
    for r in result["rows"]:
        peak = f"{r['peak_gib']:.1f}" if "peak_gib" in r else "-"
        h2d = f"{r['h2d_gib_per_step']:.1f}" if "h2d_gib_per_step" in r else "-"
        rate = f"{r['h2d_gb_s']:.1f}" if r.get("h2d_gb_s") else "-"
        print(f"{r['swap']:>4} {r['way']:>10} {r['s_per_step']:>8.4f} {r['s_per_step'] / base:>7.2f} {peak:>9} "
              f"{h2d:>13} {rate:>9}")  # fmt: skip
    if ns.json:
        Path(ns.json).write_text(json.dumps(result, indent=2))
        print(f"wrote {ns.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
