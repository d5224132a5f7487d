"""How long the launch's dataset check takes: N generated photos, checked cold (every image decoded, on every core)
and warm (results kept per file in the cache: nothing decoded), median of a few repeats. Prints a table, writes
JSON. docs/performance.md quotes it ("Dataset check").

    python scripts/bench_datacheck.py --images 1000 --size 1024 --json datacheck.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path


def make_photos(folder: Path, n: int, size: int, fmt: str, noise: bool) -> None:
    import numpy as np
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    if noise:  # the worst case for the decoders: every pixel random (a 1024² JPEG ~0.9 MB)
        base = rng.integers(0, 255, (size, size, 3), dtype=np.uint8)
    else:  # photo-like: smooth gradients with a little grain (a 1024² JPEG ~0.2 MB, as phone photos downscaled are)
        y, x = np.mgrid[0:size, 0:size] / size
        smooth = np.stack([x, y, (x + y) / 2], axis=-1) * 200 + 25
        base = np.clip(smooth + rng.normal(0, 6, (size, size, 3)), 0, 255).astype(np.uint8)
    for i in range(n):
        img = Image.fromarray(np.roll(base, i, axis=1))
        img.save(folder / f"photo{i:05d}.{fmt}", quality=90) if fmt == "jpg" else img.save(
            folder / f"photo{i:05d}.{fmt}"
        )
        (folder / f"photo{i:05d}.txt").write_text(f"a photo number {i}", encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    from flux_trainer.data.check import check_folder

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=1000)
    ap.add_argument("--size", type=int, default=1024, help="square side in pixels")
    ap.add_argument("--format", default="jpg", choices=("jpg", "png", "webp"))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--noise", action="store_true", help="random pixels (the decoders' worst case), not photo-like")
    ap.add_argument("--json", type=Path)
    ns = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="bench_datacheck_"))
    try:
        folder, cache = work / "pics", work / "cache"
        make_photos(folder, ns.images, ns.size, ns.format, ns.noise)
        mb = round(sum(p.stat().st_size for p in folder.iterdir()) / ns.images / 2**20, 2)
        cold, warm = [], []
        for _ in range(ns.repeats):
            shutil.rmtree(cache, ignore_errors=True)
            t = time.perf_counter()
            check = check_folder(folder, cache_dir=cache)
            cold.append(time.perf_counter() - t)
            assert len(check.usable()) == ns.images, check.problems()[:3]
            t = time.perf_counter()
            check_folder(folder, cache_dir=cache)
            warm.append(time.perf_counter() - t)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    row = {
        "images": ns.images,
        "size": ns.size,
        "format": ns.format,
        "content": "noise" if ns.noise else "photo-like",
        "mb_per_image": mb,
        "cores": os.cpu_count(),
        "cold_s": statistics.median(cold),
        "warm_s": statistics.median(warm),
    }
    head = f"{'images':>7} {'size':>6} {'format':>6} {'content':>10} {'MB each':>8} {'cores':>5}"
    print(f"{head} {'cold s':>8} {'warm s':>8}")
    print(
        f"{row['images']:>7} {row['size']:>6} {row['format']:>6} {row['content']:>10} {mb:>8} {row['cores']:>5} "
        f"{row['cold_s']:>8.2f} {row['warm_s']:>8.3f}"
    )
    if ns.json:
        ns.json.write_text(json.dumps(row, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
