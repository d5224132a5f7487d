"""A folder of loss masks beside a folder of images (`masks:`): white is learned, black is not, grey in between.

sd-scripts 48d368fa reads a mask folder only in a ControlNet-style dataset (`conditioning_data_dir`), which cannot
hold regularisation images, class tokens or several folders; what its DreamBooth datasets do read is the image's own
alpha channel (`alpha_mask`: the loss of each latent pixel weighted by it). So flux-train makes that alpha channel:
the staged copy of a masked image (`data.stage`, in flux-train's cache, never the user's folder) is a PNG of the image
with the mask as its alpha, and the subset trains with `alpha_mask`. The user's files are only read.

A mask is matched to an image by name (`photo1.png` for `photo1.jpg`, any image extension). Checked before anything
is made, every problem in one refusal: the folder exists, every mask names an image (a mask matching none is a typo
that would silently leave its image unmasked), one mask per image, masks that open, and a size the image's (as shown,
EXIF rotation applied) or the same shape scaled (then resized to it; a different aspect ratio is refused). An image
without a mask trains whole, as sd-scripts trains an image without alpha under `alpha_mask`; a note says how many.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from flux_trainer.data.check import IMAGE_EXTENSIONS, FolderCheck

ASPECT_TOLERANCE = 0.01  # a mask of another size is resized when its aspect ratio is within 1% of its image's


@dataclass
class MaskMatch:
    """The masks of one image folder: image file name -> its mask's path; the problems and notes found."""

    folder: Path
    masks: dict[str, Path] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def _mask_size(path: Path) -> tuple[int, int] | str:
    """(width, height) as shown, from the header (EXIF rotation applied), or what is wrong with the file."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as im:
            w, h = im.size
            orientation = im.getexif().get(0x0112, 1) if hasattr(im, "getexif") else 1
    except (OSError, UnidentifiedImageError, ValueError) as exc:
        return f"not a readable image ({type(exc).__name__})"
    return (h, w) if orientation in (5, 6, 7, 8) else (w, h)


def match_masks(check: FolderCheck, masks_folder: Path, key: str = "dataset.masks") -> MaskMatch:
    """The masks of `masks_folder` matched to `check`'s usable images by name, every problem found."""
    out = MaskMatch(folder=Path(masks_folder))
    if not out.folder.is_dir():
        out.problems.append(f"{key}={masks_folder} does not exist; set it to the folder of your mask images")
        return out
    images = {os.path.splitext(n)[0]: n for n in check.usable()}
    by_stem: dict[str, list[str]] = {}
    for entry in sorted(os.scandir(out.folder), key=lambda e: e.name):
        stem, ext = os.path.splitext(entry.name)
        if ext.lower() in IMAGE_EXTENSIONS and entry.is_file():
            by_stem.setdefault(stem, []).append(entry.name)
    if not by_stem:
        out.problems.append(f"{key}={masks_folder} has no mask images ({' '.join(IMAGE_EXTENSIONS)})")
        return out
    unmatched = sorted(n for stem, names in by_stem.items() if stem not in images for n in names)
    if unmatched:
        some = ", ".join(unmatched[:3]) + (" ..." if len(unmatched) > 3 else "")
        out.problems.append(
            f"{key}: {len(unmatched)} mask(s) in {masks_folder} match no image of {check.folder} by name ({some}); "
            f"name each mask as its image (photo1.png for photo1.jpg)"
        )
    for stem, names in sorted(by_stem.items()):
        if stem not in images:
            continue
        if len(names) > 1:
            both = ", ".join(names)
            out.problems.append(f"{key}: {both} in {masks_folder} are all masks of {images[stem]}; keep one")
            continue
        path = out.folder / names[0]
        size = _mask_size(path)
        if isinstance(size, str):
            out.problems.append(f"{key}: {path}: {size}")
            continue
        result = check.images[images[stem]]
        if not same_shape(size, (result.width, result.height)):
            out.problems.append(
                f"{key}: {path} is {size[0]}x{size[1]}, but {images[stem]} is {result.width}x{result.height} "
                "(as shown); make the mask the image's size"
            )
            continue
        out.masks[images[stem]] = path
    unmasked = len(images) - len(out.masks)
    if unmasked and not out.problems:
        out.notes.append(f"{check.folder}: {unmasked} of {len(images)} images have no mask in {masks_folder}: "
                         f"each of those is learned whole")  # fmt: skip
    return out


def same_shape(mask: tuple[int, int], image: tuple[int, int]) -> bool:
    """The mask's size is the image's, or the same aspect ratio within ASPECT_TOLERANCE (then resized)."""
    if mask == image:
        return True
    (mw, mh), (iw, ih) = mask, image
    return min(mw, mh, iw, ih) > 0 and abs((mw / mh) / (iw / ih) - 1) <= ASPECT_TOLERANCE


def write_masked(image: Path, mask: Path, target: Path) -> None:
    """`image` as shown (EXIF rotation applied) with `mask`'s grey level as its alpha channel, a PNG at `target`
    (written aside and renamed: whole or absent)."""
    from PIL import Image, ImageOps

    with Image.open(image) as im, Image.open(mask) as m:
        rgb = ImageOps.exif_transpose(im).convert("RGB")
        grey = ImageOps.exif_transpose(m).convert("L")
        if grey.size != rgb.size:
            grey = grey.resize(rgb.size, Image.Resampling.BILINEAR)
        rgba = rgb.copy()
        rgba.putalpha(grey)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    rgba.save(tmp, format="PNG")
    os.replace(tmp, target)
