"""Time the base model's move to the GPU: `Module.to` (what accelerate's prepare does) against
`model_copy.staged_copy` (train.staged_copy) at several thread counts and staging-buffer sizes. The model is a
safetensors file loaded as sd-scripts loads it (memory-mapped: the move also reads the file's pages; warm page cache
after the first pass), and the same tensors in anonymous host memory (an fp8 base that sd-scripts cast on the CPU).
Each row is the median of --repeat moves; every staged move is checked bit for bit against the plain one.

    python scripts/bench_model_copy.py FILE.safetensors [--repeat 3] [--json out.json]

(`--device cpu` runs the same code path host to host, without page-locked buffers: for tests, not for numbers.)
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from safetensors.torch import load_file

from flux_trainer.sdscripts import model_copy


def holder(tensors: dict[str, torch.Tensor]) -> torch.nn.Module:
    m = torch.nn.Module()
    for i, t in enumerate(tensors.values()):
        m.register_parameter(f"p{i}", torch.nn.Parameter(t, requires_grad=False))
    return m


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def timed_move(make, how, dev: torch.device) -> tuple[float, torch.nn.Module]:
    module = make()
    sync(dev)
    t0 = time.perf_counter()
    how(module)
    sync(dev)
    return time.perf_counter() - t0, module


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("file")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--chunk-mib", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--json")
    ap.add_argument("--device", default="cuda")
    ns = ap.parse_args(argv)
    dev = torch.device(ns.device)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else str(dev)
    resident = {k: v.clone() for k, v in load_file(ns.file).items()}
    sources = {"mmap": lambda: holder(load_file(ns.file)), "memory": lambda: holder(resident)}
    nbytes = sum(t.numel() * t.element_size() for t in resident.values())
    print(f"{ns.file}: {len(resident)} tensors, {nbytes / 1e9:.2f} GB; {name}")
    ref = {k: v.to(dev) for k, v in resident.items()}
    rows = []
    for source, make in sources.items():
        ways = [("Module.to", lambda m: m.to(dev))]
        ways += [
            (
                f"staged {t} threads, {c} MiB",
                lambda m, t=t, c=c: model_copy.staged_copy(m, dev, threads=t, chunk=c << 20),
            )
            for t in ns.threads
            for c in ns.chunk_mib
        ]
        for name, how in ways:
            times = []
            for _ in range(ns.repeat):
                s, module = timed_move(make, how, dev)
                times.append(s)
                same = all(
                    torch.equal(model_copy._bytes(p.detach()), model_copy._bytes(r))
                    for p, r in zip(module.parameters(), ref.values(), strict=True)
                )
                del module
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
            med = statistics.median(times)
            rows.append(
                {
                    "source": source,
                    "way": name,
                    "median_s": med,
                    "times_s": times,
                    "gb_s": nbytes / med / 1e9,
                    "same_bits": same,
                }
            )
    base = {r["source"]: r["median_s"] for r in rows if r["way"] == "Module.to"}
    print(f"\n{'source':<8} {'way':<28} {'median s':>9} {'GB/s':>6} {'speed-up':>8} same bits")
    for r in rows:
        r["speedup"] = base[r["source"]] / r["median_s"]
        s, way = r["source"], r["way"]
        print(f"{s:<8} {way:<28} {r['median_s']:9.2f} {r['gb_s']:6.1f} {r['speedup']:7.2f}x {r['same_bits']}")
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump({"file": ns.file, "bytes": nbytes, "device": name, "rows": rows}, f, indent=1)
    return 0 if all(r["same_bits"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
