"""Diagnose fp8_matmul's memory in training: a stack of full-size sd-scripts double blocks at fp8 base (autocast
bf16, gradient checkpointing), eager / compiled, upcast (sd-scripts) / fp8_matmul: memory held between forward and
backward, the peak of forward+backward, what one block saves for backward, ms per fwd+bwd. Needs CUDA + sd-scripts.

    python scripts/fp8_memory.py [--blocks 6] [--out fp8_memory.json]
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter

import torch

from flux_kernels.ops import reference
from flux_kernels.patches import fp8, patch
from flux_kernels.runtime.registry import unchecked


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=6)
    ap.add_argument("--out")
    ns = ap.parse_args()
    from flux_trainer.sdscripts.checkout import import_sd_scripts, locate

    fm = import_sd_scripts(locate().path).flux_models
    dev = torch.device("cuda")
    torch.manual_seed(0)
    model = torch.nn.Module()
    blocks = [fm.DoubleStreamBlock(3072, 24, 4.0, qkv_bias=True) for _ in range(ns.blocks)]
    model.double_blocks = torch.nn.ModuleList(blocks)
    model.single_blocks = torch.nn.ModuleList()
    for p in model.parameters():
        p.data = 0.02 * torch.randn_like(p)
    model.to(dev, torch.bfloat16).to(fp8.E4M3).requires_grad_(False).train()
    gen = torch.Generator().manual_seed(0)
    img = torch.randn(1, 4096, 3072, generator=gen).to(dev, torch.bfloat16).requires_grad_()
    txt = torch.randn(1, 512, 3072, generator=gen).to(dev, torch.bfloat16).requires_grad_()
    vec = torch.randn(1, 3072, generator=gen).to(dev, torch.bfloat16)
    pe = reference.make_pe(1, 4608, 128, device=dev)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    rows = []
    for ckpt in (True, False):
        for label in ("upcast_eager", "fp8_eager", "upcast_compiled", "fp8_compiled"):
            patch.remove_kernels(model)
            torch._dynamo.reset()
            for b in model.double_blocks:
                b.enable_gradient_checkpointing() if ckpt else b.disable_gradient_checkpointing()
            if label.startswith("fp8"):
                patch.apply_kernels(model, unchecked(["fp8_matmul"]))
            if label.endswith("compiled"):
                for b in model.double_blocks:
                    b.compile()

            def fwd():
                i, t = img, txt
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    for b in model.double_blocks:
                        i, t = b(i, t, vec, pe)
                return i.float().square().mean() + t.float().square().mean()

            for _ in range(2):  # compile + warm
                fwd().backward()
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            loss = fwd()
            torch.cuda.synchronize()
            held = torch.cuda.memory_allocated() - base
            loss.backward()
            torch.cuda.synchronize()
            ms = (time.perf_counter() - t0) * 1e3
            peak = torch.cuda.max_memory_allocated() - base
            seen = {}

            def pack(t, seen=seen):
                st = t.untyped_storage()
                if st.data_ptr() not in params:
                    seen[st.data_ptr()] = (st.nbytes(), f"{tuple(t.shape)} {str(t.dtype)[6:]}")
                return t

            hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
            with hooks, torch.autocast("cuda", dtype=torch.bfloat16):
                out = model.double_blocks[0](img, txt, vec, pe)
            del out
            kinds = Counter(v[1] for v in seen.values())
            row = {
                "name": f"{label}{'_ckpt' if ckpt else ''}",
                "held_gib": held / 2**30,
                "peak_gib": peak / 2**30,
                "ms": ms,
                "saved_one_block_mib": sum(v[0] for v in seen.values()) / 2**20,
                "saved_kinds": dict(kinds.most_common(8)),
            }
            rows.append(row)
            print(
                f"{row['name']:<24} held {row['held_gib']:6.2f} GiB  peak {row['peak_gib']:6.2f} GiB  {ms:8.1f} ms  "
                f"one block saves {row['saved_one_block_mib']:8.1f} MiB: {row['saved_kinds']}",
                flush=True,
            )
    patch.remove_kernels(model)
    if ns.out:
        with open(ns.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
