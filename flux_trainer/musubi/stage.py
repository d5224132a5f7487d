"""The folders musubi-tuner's dataset config names: images with their captions as trained, references, caches.

flux-train has already checked and staged the user's images (flux_trainer.data.stage: links, upright copies, UTF-8
captions). musubi-tuner reads each caption file as is (it has no caption prefix), so the trigger word is written
into the captions here, in a folder of our cache: `<cache>/musubi/<dataset>-<key>/images/` (links to the staged
images, captions written out), `control/` (links to the references, named as musubi-tuner pairs them) and
`cache-<key>/` (its latent and text-encoder caches). The key covers what the caches are made from (each image's and
caption's file key, the trigger, the model files, the resolution), so a change starts a fresh cache folder and
musubi-tuner's caching scripts, run with --skip_existing, never reuse a stale one. Nothing is written in the user's
folders.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flux_trainer.data.check import caption_of


@dataclass(frozen=True)
class MusubiFolders:
    images: Path  # image_directory
    control: Path | None  # control_directory
    cache: Path  # cache_directory


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:12]


def _relink(target: Path, link: Path) -> None:
    if link.is_symlink() and os.readlink(link) == str(target):
        return
    with contextlib.suppress(FileNotFoundError):
        link.unlink()
    link.symlink_to(target)


def _write_text(path: Path, text: str) -> None:
    if path.is_file() and not path.is_symlink() and path.read_text(encoding="utf-8") == text:
        return
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def caption_text(trigger: str | None, caption: str | None) -> str:
    """What trains for one image: the trigger word in front of its caption (sd-scripts' caption_prefix), the trigger
    alone for an image without a caption file."""
    caption = (caption or "").strip()
    if trigger:
        return f"{trigger}, {caption}" if caption else trigger
    return caption


def stage_for_musubi(
    cache_dir: Path,
    dataset: Any,
    staged: Path,
    check: Any,
    references: Any | None,
    model_key: Any,
) -> MusubiFolders:
    """The three folders for one dataset folder (`staged`, whose check is `check`). `references`:
    flux_trainer.data.control.References or None; `model_key`: what of the model shapes the caches."""
    ext = str(dataset.caption_extension)
    trigger = dataset.get("trigger")
    entries = {}
    for image in sorted(check.usable()):
        caption = caption_of(check, image, ext)
        text = (staged / caption).read_text(encoding="utf-8") if caption else None
        entries[image] = (os.stat(staged / image).st_size, os.stat(staged / image).st_mtime_ns, text)
    refs = {} if references is None else {k: list(v) for k, v in references.by_image.items()}
    root = cache_dir / "musubi" / f"{dataset.name}-{_digest(str(check.folder))}"
    images, control = root / "images", (root / "control" if references is not None else None)
    images.mkdir(parents=True, exist_ok=True)
    keep: set[str] = set()
    for image, (_, _, text) in entries.items():
        stem = os.path.splitext(image)[0]
        _relink((staged / image).resolve(), images / image)
        _write_text(images / f"{stem}{ext}", caption_text(trigger, text))
        keep |= {image, f"{stem}{ext}"}
    for old in images.iterdir():  # gone from the dataset: gone here
        if old.name not in keep:
            old.unlink()
    if control is not None:
        control.mkdir(parents=True, exist_ok=True)
        wanted = set()
        for image, names in refs.items():
            stem = os.path.splitext(image)[0]
            for i, name in enumerate(names):
                # one reference: the image's own name; several: musubi-tuner's numbered names, in order
                suffix = os.path.splitext(name)[1]
                own = f"{stem}{suffix}" if len(names) == 1 else f"{stem}_{i}{suffix}"
                _relink(references.folder / name, control / own)
                wanted.add(own)
        for old in control.iterdir():
            if old.name not in wanted:
                old.unlink()
    ref_keys = {
        image: [os.stat(references.folder / n).st_size for n in names] for image, names in refs.items()
    }  # fmt: skip
    key = _digest([entries, ref_keys, trigger, model_key, dataset.resolution])
    cache = root / f"cache-{key}"
    cache.mkdir(exist_ok=True)
    return MusubiFolders(images=images, control=control, cache=cache)
