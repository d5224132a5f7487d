"""Images that sd-scripts' aspect-ratio buckets cannot place, found before a run starts.

With `enable_bucket` and `bucket_no_upscale` (flux-train's defaults), sd-scripts 48d368fa shrinks an image larger than
the resolution's area to that area at its own aspect ratio, then floors both sides to whole 64-pixel steps. A side
that floors to 0 makes it divide by zero while it sorts the images (a ZeroDivisionError naming no file, after the
run dir exists): at resolution 64 almost every image that is not square, at 128 those about 2:1 or wider, at 512
beyond about 60:1. The arithmetic below is the documented behaviour of its `BucketManager.select_bucket` (round to
steps: add 0.5, truncate, floor to the step), written out here so the launch can refuse naming the images and the
resolution that fits them.
"""

from __future__ import annotations

import math

STEP = 64  # sd-scripts' bucket_reso_steps for FLUX
LARGEST = 2048  # the largest resolution suggested as a fix


def _floor_to_step(x: float) -> int:
    x = int(x + 0.5)
    return x - x % STEP


def zero_side(width: int, height: int, resolution: int) -> bool:
    """Whether an image of this size (as shown) gets a bucket side of 0 pixels at `resolution` (no upscaling)."""
    area = resolution * resolution
    if width * height <= area:
        return False  # kept at its own size, floored to steps: a short side of 64 px or more (data.check) stays
    aspect = width / height
    fit_w = math.sqrt(area * aspect)
    fit_h = area / fit_w
    by_width, by_height = _floor_to_step(fit_w), _floor_to_step(fit_h)
    height_for_width, width_for_height = _floor_to_step(by_width / aspect), _floor_to_step(by_height * aspect)
    if height_for_width == 0 or by_height == 0:
        return True  # the aspect ratio of a side of 0: the division itself fails
    # the pair whose aspect ratio is nearer the image's is the bucket
    if abs(by_width / height_for_width - aspect) < abs(width_for_height / by_height - aspect):
        size = (by_width, int(by_width / aspect + 0.5))
    else:
        size = (int(by_height * aspect + 0.5), by_height)
    return any(side - side % STEP == 0 for side in size)


def bucket_problem(sizes: dict[str, tuple[int, int]], resolution: int, where: str) -> str | None:
    """One line naming the images of `sizes` (name -> as-shown size) that cannot be bucketed at `resolution`, and the
    smallest resolution (in 64-pixel steps) that buckets them all; None when every image fits."""
    bad = sorted(n for n, (w, h) in sizes.items() if zero_side(w, h, resolution))
    if not bad:
        return None
    fits = next(
        (r for r in range(resolution + STEP, LARGEST + 1, STEP)
         if not any(zero_side(*sizes[n], r) for n in bad)),
        None,
    )  # fmt: skip
    some = ", ".join(f"{n} ({sizes[n][0]}x{sizes[n][1]})" for n in bad[:3]) + (" ..." if len(bad) > 3 else "")
    fix = f"use a resolution of {fits} or more" if fits else "crop them nearer to square"
    return (
        f"{where}: at resolution {resolution}, {len(bad)} image(s) are too far from square for sd-scripts' 64-pixel "
        f"buckets (a side rounds to 0; it would stop with ZeroDivisionError): {some}; {fix}, or crop them"
    )
