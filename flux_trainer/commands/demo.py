"""A synthetic captioned dataset, so a first run (and every smoke test) needs nothing downloaded.

Each image is one coloured shape on a plain background, with a caption that says exactly that ("a large red
circle on a blue background"): simple enough to generate anywhere, varied enough that a LoRA has something to
learn, and checkable, since the caption can be compared to the pixels.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

from PIL import Image, ImageDraw

COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "green": (30, 160, 60),
    "blue": (30, 60, 200),
    "yellow": (240, 210, 40),
    "purple": (130, 40, 160),
    "orange": (245, 130, 20),
    "white": (245, 245, 245),
    "black": (15, 15, 15),
}
SHAPES = ("circle", "square", "triangle", "diamond")
SIZES = {"small": 0.3, "large": 0.6}  # shape extent as a fraction of the image side
MANIFEST = "demo.json"
PREFIX = "demo_"


def _draw(
    shape: str,
    colour: tuple[int, int, int],
    background: tuple[int, int, int],
    extent: float,
    centre: tuple[float, float],
    size: int,
) -> Image.Image:
    image = Image.new("RGB", (size, size), background)
    draw = ImageDraw.Draw(image)
    cx, cy = centre[0] * size, centre[1] * size
    r = extent * size / 2
    if shape == "circle":
        draw.ellipse((cx - r, cy - r, cx + r, cy + r), fill=colour)
    elif shape == "square":
        draw.rectangle((cx - r, cy - r, cx + r, cy + r), fill=colour)
    elif shape == "triangle":
        draw.polygon([(cx, cy - r), (cx + r, cy + r), (cx - r, cy + r)], fill=colour)
    else:
        draw.polygon([(cx, cy - r), (cx + r, cy), (cx, cy + r), (cx - r, cy)], fill=colour)
    return image


def demo_items(n: int, seed: int) -> list[dict]:
    """The n (shape, colours, size, position) choices for a seed. Shapes cycle so any n >= 4 has all four, and the
    shape keeps a margin from the edges, so the corners always show the background."""
    rng = random.Random(seed)
    items = []
    for i in range(n):
        colour, background = rng.sample(sorted(COLOURS), 2)
        size_word = rng.choice(sorted(SIZES))
        margin = SIZES[size_word] / 2 + 0.05
        items.append(
            {
                "shape": SHAPES[(i + seed) % len(SHAPES)],
                "colour": colour,
                "background": background,
                "size": size_word,
                "centre": (rng.uniform(margin, 1 - margin), rng.uniform(margin, 1 - margin)),
            }
        )
    return items


def caption(item: dict) -> str:
    return f"a {item['size']} {item['colour']} {item['shape']} on a {item['background']} background"


def _atomic_write(path: Path, write) -> None:
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def make_demo_dataset(folder: Path, n: int = 8, size: int = 256, seed: int = 0) -> Path:
    """Write n PNG images with `.txt` captions into folder and return it. Idempotent: when the manifest says the
    folder already holds this (n, size, seed) and every file is there, nothing is rewritten; otherwise our own
    `demo_*` files are replaced (files not made here are left alone). Each file is written to a temporary name
    and renamed, and the manifest last, so an interrupted run is redone rather than trusted."""
    if n < 1 or size < 16:
        raise ValueError(f"demo dataset needs n >= 1 and size >= 16, got n={n}, size={size}")
    folder = Path(folder)
    params = {"n": n, "size": size, "seed": seed}
    names = [f"{PREFIX}{i:03d}" for i in range(n)]
    manifest = folder / MANIFEST
    if manifest.is_file() and all((folder / f"{s}{ext}").is_file() for s in names for ext in (".png", ".txt")):
        try:
            if json.loads(manifest.read_text()) == params:
                return folder
        except ValueError:
            pass
    folder.mkdir(parents=True, exist_ok=True)
    manifest.unlink(missing_ok=True)
    for stale in folder.glob(f"{PREFIX}*"):
        if stale.stem not in names and stale.suffix in (".png", ".txt"):
            stale.unlink()
    for stem, item in zip(names, demo_items(n, seed), strict=True):
        image = _draw(
            item["shape"],
            COLOURS[item["colour"]],
            COLOURS[item["background"]],
            SIZES[item["size"]],
            item["centre"],
            size,
        )
        _atomic_write(folder / f"{stem}.png", lambda p, image=image: image.save(p, format="PNG"))
        _atomic_write(folder / f"{stem}.txt", lambda p, item=item: p.write_text(caption(item) + "\n"))
    _atomic_write(manifest, lambda p: p.write_text(json.dumps(params) + "\n"))
    return folder


def demo_dir() -> Path:
    from flux_trainer.config.paths import cache_root

    return cache_root() / "demo"


def demo_command(extra: list[str]) -> int:
    """Generated images + the tiny random model, a few steps: the whole product with no downloads."""
    from flux_trainer.commands.dataset import write_dataset_config
    from flux_trainer.commands.train import run_training
    from flux_trainer.config.paths import user_config_dirs

    images = make_demo_dataset(demo_dir() / "images", n=8, size=128)
    configs = demo_dir() / "configs"
    write_dataset_config(
        configs,
        "demo",
        images,
        trigger="demo",
        resolution=128,
        repeats=1,
        force=True,
        extra={"min_bucket_reso": 64, "max_bucket_reso": 256},
    )
    overrides = [
        "+dataset=demo",
        "model=random_tiny",
        "train.max_steps=4",
        "train.save_every_n_steps=2",
        "train.data_loader_workers=0",
        *extra,
    ]
    print("[flux-train] demo: RANDOM tiny FLUX on 8 generated images; it shows the pipeline, not a useful LoRA")
    return run_training(overrides, [*user_config_dirs(), configs])
