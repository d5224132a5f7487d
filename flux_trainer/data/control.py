"""A dataset's reference images (`control_images:`, FLUX.1 Kontext and FLUX.2 editing): checked like the images,
then matched to them by name.

Each image `photo1.jpg` takes the reference `photo1.<any image extension>` from the control folder, or several
numbered ones (`photo1_0.png`, `photo1_1.png`, `photo1_0000.png`: the trainer's own convention for more than one).
Every reference file is opened and measured as the images are (flux_trainer.data.check); an image without a
reference, a reference that matches no image (a typo in a name), and a bad reference file are each one line of one
refusal, before anything is made.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from flux_trainer.config.errors import ConfigError
from flux_trainer.data.check import FolderCheck, check_folder

MAX_LISTED = 5  # names per line before "and N more"
_NUMBERED = re.compile(r"^(?P<stem>.+)_(?P<n>\d{1,4})$")


@dataclass(frozen=True)
class References:
    folder: Path
    by_image: dict[str, list[str]]  # image file name -> its reference file names, in order


def _listed(names: list[str]) -> str:
    shown = ", ".join(names[:MAX_LISTED])
    return shown + (f" and {len(names) - MAX_LISTED} more" if len(names) > MAX_LISTED else "")


def match(images: list[str], references: list[str]) -> tuple[dict[str, list[str]], list[str], list[str]]:
    """(image -> its references, images without one, references that match no image), by name without extension."""
    stems = {os.path.splitext(name)[0]: name for name in images}
    found: dict[str, list[str]] = {name: [] for name in images}
    unmatched = []
    for ref in sorted(references):
        stem = os.path.splitext(ref)[0]
        numbered = _NUMBERED.match(stem)
        if stem in stems:
            found[stems[stem]].append(ref)
        elif numbered and numbered["stem"] in stems:
            found[stems[numbered["stem"]]].append(ref)
        else:
            unmatched.append(ref)
    missing = [name for name, refs in found.items() if not refs]
    return found, missing, unmatched


def check_references(dataset_name: str, control: str, images: FolderCheck, cache_dir: Path | None) -> References:
    """The reference folder checked and matched to the usable images; ConfigError with every problem."""
    folder = Path(control).expanduser()
    if not folder.is_dir():
        raise ConfigError(
            f"dataset '{dataset_name}': control_images={folder} is not a folder; point it at the reference images "
            "(one per image, same name)"
        )
    refs = check_folder(folder, caption_extension=".flux-train-no-captions", cache_dir=cache_dir)
    problems = [f"{folder / name}: {res.problem}" for name, res in refs.images.items() if res.problem]
    problems += [f"{folder / name}: a link that loops or points nowhere" for name in refs.broken_links]
    usable_refs = [name for name, res in refs.images.items() if res.problem is None]
    found, missing, unmatched = match(images.usable(), usable_refs)
    if not usable_refs and not problems:
        problems.append(
            f"dataset '{dataset_name}': control_images={folder} holds no images (.png .jpg .jpeg .webp .bmp); put "
            "one reference per image there, named as the image"
        )
    elif unmatched:
        problems.append(
            f"dataset '{dataset_name}': {len(unmatched)} reference(s) in {folder} match no image of {images.folder} "
            f"({_listed(unmatched)}); name each as its image (photo1.png for photo1.jpg) or remove it"
        )
    if missing and usable_refs:
        problems.append(
            f"dataset '{dataset_name}': {len(missing)} image(s) have no reference in {folder} ({_listed(missing)}); "
            "add one named as the image, or move the image out"
        )
    if problems:
        raise ConfigError(problems)
    return References(folder.resolve(), found)
