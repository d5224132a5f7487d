"""The user's image folder is read, never written: sd-scripts gets a staged copy of it in flux-train's cache.

sd-scripts writes its latent and text-encoder caches beside each image (`img_0512x0512_flux.npz`,
`img_flux_te.npz`), in the user's folder. flux-train hands it `<cache>/datasets/<name>-<key>/` instead: a link to
each usable image and caption, an upright copy of a photo with an EXIF rotation (sd-scripts reads pixels as stored,
so it would train sideways), and a UTF-8 copy of a caption saved in another encoding. sd-scripts' caches land there.

The staged folder is brought up to date at every launch (cheap: links), and its caches are dropped where what they
were made from changed: an image edited in place (its latents), a caption edited or the trigger word / caption
settings changed (its text-encoder outputs). sd-scripts itself would reuse both.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import math
import os
from pathlib import Path
from typing import Any

from flux_trainer.data.check import IMAGE_EXTENSIONS, FolderCheck, caption_of, read_caption

MANIFEST = ".flux-train-stage.json"


def staged_dir(cache_dir: Path, name: str, folder: Path) -> Path:
    key = hashlib.sha256(str(Path(folder).resolve()).encode()).hexdigest()[:12]
    return Path(cache_dir) / "datasets" / f"{name}-{key}"


def _key(path: Path) -> str:
    st = path.stat()
    return f"{st.st_size}:{st.st_mtime_ns}"


def _link(target: Path, link: Path) -> None:
    """`link` -> `target`, replacing whatever is there unless it already is that link."""
    if link.is_symlink() and os.readlink(link) == str(target):
        return
    tmp = link.with_name(f".{link.name}.{os.getpid()}.tmp")
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    tmp.symlink_to(target)
    os.replace(tmp, link)


def _write(path: Path, write) -> None:
    """Write a file aside and rename it, so a staged copy is whole or absent."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    write(tmp)
    os.replace(tmp, path)


def _upright(source: Path, target: Path) -> None:
    from PIL import Image, ImageOps

    with Image.open(source) as im:
        fmt = im.format
        upright = ImageOps.exif_transpose(im)
        options = {"quality": 100, "subsampling": 0} if fmt == "JPEG" else {}
        _write(target, lambda tmp: upright.save(tmp, format=fmt, **options))


def _drop_caches(staged: Path, stem: str, kinds: tuple[str, ...]) -> None:
    """sd-scripts' cache files of one image: `latents` (<stem>_<WxH>_flux.npz) and/or `te` (<stem>_flux_te.npz)."""
    for npz in staged.glob(f"{stem}_*.npz"):
        is_te = npz.name == f"{stem}_flux_te.npz"
        if ("te" in kinds and is_te) or ("latents" in kinds and not is_te):
            with contextlib.suppress(FileNotFoundError):
                npz.unlink()


def stage(
    check: FolderCheck,
    name: str,
    cache_dir: Path,
    caption_extension: str = ".txt",
    te_key: str = "",
    latents_key: str = "",
    masks: dict[str, Path] | None = None,
) -> Path:
    """The staged folder for `check`'s usable images, up to date. `te_key`: what shapes the text-encoder outputs
    (the text encoders' files, the trigger word, caption options); `latents_key`: what shapes the latents (the AE's
    file): when one changes, every cache of that kind is dropped. `masks` (image name -> mask file, from
    data.masks): those images are staged as PNGs with the mask as their alpha channel."""
    staged = staged_dir(cache_dir, name, check.folder)
    staged.mkdir(parents=True, exist_ok=True)
    lock = os.open(staged, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two runs of one dataset stage it one after the other
        _stage_locked(check, staged, caption_extension, te_key, latents_key, masks or {})
    finally:
        os.close(lock)
    return staged


def _stage_locked(
    check: FolderCheck, staged: Path, caption_extension: str, te_key: str, latents_key: str, masks: dict[str, Path]
) -> None:
    manifest_path = staged / MANIFEST
    try:
        before = json.loads(manifest_path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        before = {}
    old = before.get("files", {})
    te_changed = before.get("te_key") != te_key
    latents_changed = before.get("latents_key") != latents_key
    now: dict[str, dict] = {}
    for image in check.usable():
        source = check.folder / image
        result = check.images[image]
        stem = os.path.splitext(image)[0]
        entry = {"image": _key(source), "orientation": result.orientation}
        mask = masks.get(image)
        if mask is not None:  # staged as a PNG with the mask as alpha (data.masks), under the image's stem
            entry.update(mask=f"{mask}:{_key(mask)}", staged=stem + ".png")
        previous = old.get(image, {})
        target = staged / entry.get("staged", image)
        if previous.get("staged", image) != entry.get("staged", image):  # masked now, or no longer: the old file goes
            with contextlib.suppress(FileNotFoundError):
                (staged / previous.get("staged", image)).unlink()
        if previous.get("image") != entry["image"] or previous.get("orientation") != entry["orientation"]:
            _drop_caches(staged, stem, ("latents", "te"))
        elif latents_changed or previous.get("mask") != entry.get("mask"):
            _drop_caches(staged, stem, ("latents",))
        if mask is not None:
            if previous.get("image") != entry["image"] or previous.get("mask") != entry["mask"] or not target.is_file():
                from flux_trainer.data.masks import write_masked

                write_masked(source, mask, target)
        elif result.orientation == 1:
            _link(source, target)
        elif previous.get("image") != entry["image"] or target.is_symlink() or not target.exists():
            _upright(source, target)
        caption = caption_of(check, image, caption_extension)
        if caption is not None:
            source_caption = check.folder / caption
            entry["caption"] = _key(source_caption)
            if check.captions[caption].encoding == "utf-8":
                _link(source_caption, staged / caption)
            elif previous.get("caption") != entry["caption"] or (staged / caption).is_symlink():
                text, _ = read_caption(source_caption.read_bytes())
                _write(staged / caption, lambda tmp, t=text: tmp.write_text(t, encoding="utf-8"))
        else:
            with contextlib.suppress(FileNotFoundError):
                (staged / (stem + caption_extension)).unlink()
        if te_changed or previous.get("caption") != entry.get("caption"):
            _drop_caches(staged, stem, ("te",))
        now[image] = entry
    for image in set(old) - set(now):  # gone from the user's folder (or now unusable): gone from the stage
        stem = os.path.splitext(image)[0]
        for path in (staged / old[image].get("staged", image), staged / (stem + caption_extension)):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        _drop_caches(staged, stem, ("latents", "te"))
    body = {"folder": str(check.folder), "te_key": te_key, "latents_key": latents_key, "files": now}
    _write(manifest_path, lambda tmp: tmp.write_text(json.dumps(body, indent=1), encoding="utf-8"))


MAX_LISTED = 20  # bad files named in one refusal; the rest counted


def _uncaptioned(check: Any, caption_extension: str) -> list[str]:
    """The usable images without a caption file beside them."""
    return [n for n in check.usable() if os.path.splitext(n)[0] + caption_extension not in check.captions]


def _uncaptioned_line(dataset: Any, names: list[str], usable: int) -> str:
    some = ", ".join(names[:3]) + (" ..." if len(names) > 3 else "")
    return (
        f"dataset '{dataset.name}': {len(names)} of {usable} images have no {dataset.caption_extension} caption "
        f"({some}) and there is no trigger word; add captions or set dataset.trigger=WORD"
    )


def split_counts(images: int, split: float) -> tuple[int, int]:
    """(trained, held out) of `images` at `dataset.validation_split`, as sd-scripts 48d368fa counts them
    (train_util.split_train_val): the training part rounds up, the validation part to the nearest (half to even),
    so for some counts one image lands in both."""
    if not split:
        return images, 0
    return math.ceil(images * (1 - split)), round(images * split)


def _split_problem(dataset: Any, usable: int, batch_size: int) -> str | None:
    trained, held = split_counts(usable, float(dataset.validation_split))
    if dataset.validation_split and held == 0:
        least = math.ceil(100 / usable) / 100  # usable x least >= 1 rounds to one image at least
        fix = f"set dataset.validation_split={least:g} or more" if usable > 1 and least <= 0.5 else "add images"
        return (
            f"dataset.validation_split={dataset.validation_split} of dataset '{dataset.name}' ({usable} images) holds "
            f"out no image (sd-scripts rounds {usable} x {dataset.validation_split}); {fix}"
        )
    if held and batch_size > trained:
        return (
            f"train.batch_size={batch_size} is larger than the {trained} images dataset '{dataset.name}' trains on "
            f"after dataset.validation_split={dataset.validation_split}; use train.batch_size={trained} or less"
        )
    return None


def _refuse_bad_files(dataset: Any, check: Any, trigger: str | None) -> None:
    """ConfigError naming every bad file of one folder (up to MAX_LISTED), or its uncaptioned images without a
    trigger word, or no image at all."""
    from flux_trainer.config.errors import ConfigError

    problems = check.problems()
    uncaptioned = [] if trigger else _uncaptioned(check, dataset.caption_extension)
    if problems:
        more = f" ... and {len(problems) - MAX_LISTED} more" if len(problems) > MAX_LISTED else ""
        listed = problems[:MAX_LISTED]
        listed[-1] += more
        listed.append(f"dataset '{dataset.name}': fix or remove the file(s) above (nothing was started)")
        if uncaptioned:
            listed.append(_uncaptioned_line(dataset, uncaptioned, len(check.usable())))
        raise ConfigError(listed)
    if uncaptioned:
        raise ConfigError(_uncaptioned_line(dataset, uncaptioned, len(check.usable())))
    if not check.usable():
        raise ConfigError(f"dataset '{dataset.name}': {check.folder} has no images ({' '.join(IMAGE_EXTENSIONS)})")
    if bucketed := _bucket_problems(dataset, check):
        raise ConfigError(bucketed)


def _bucket_problems(dataset: Any, check: Any) -> list[str]:
    """The images sd-scripts' buckets cannot place at each of the dataset's resolutions (data.buckets)."""
    from flux_trainer.data.buckets import bucket_problem
    from flux_trainer.data.subsets import resolutions_of

    if dataset.get("resolution") is None or not (
        dataset.get("enable_bucket", True) and dataset.get("bucket_no_upscale", True)
    ):
        return []
    sizes = {n: (r.width, r.height) for n, r in check.images.items() if r.problem is None}
    where = f"dataset '{dataset.name}' ({check.folder})"
    found = (bucket_problem(sizes, int(res), where) for res in resolutions_of(dataset))
    return [line for line in found if line]


def _masks(key: str, masks: str | None, check: Any, problems: list[str], notes: list[str]) -> dict[str, Path]:
    """The images' masks (data.masks) where the folder names a mask folder; its problems and notes added."""
    if not masks:
        return {}
    from flux_trainer.data.masks import match_masks

    matched = match_masks(check, Path(str(masks)).expanduser(), key)
    problems += matched.problems
    notes += matched.notes
    return matched.masks


def _stage_keys(
    dataset: Any, model: Any, trigger: str | None, alpha_mask: bool = False, te_fp8: bool = False
) -> tuple[str, str]:
    """What the staged text-encoder outputs and latents are made from (a change drops that kind of cache). `te_fp8`:
    T5-XXL encodes in fp8 (memory.t5xxl_fp8, the 8 GB tier), other numbers than bf16's: sd-scripts would reuse
    either kind for the other."""
    te = [str(model.clip_l), str(model.t5xxl), model.get("t5xxl_max_token_length"), trigger, dataset.keep_tokens,
          dataset.caption_extension] + (["t5xxl_fp8"] if te_fp8 else [])  # fmt: skip
    te_key = json.dumps(te)
    latents = [str(model.ae), bool(dataset.flip_aug)] + (["alpha_mask"] if alpha_mask else [])  # masks cache beside
    return te_key, json.dumps(latents)


def ready(
    dataset: Any, model: Any, cache_dir: Path, batch_size: int = 1, te_fp8: bool = False
) -> tuple[Path, list[str]]:
    """A run's dataset checked and staged: (the staged folder for sd-scripts, notes to show). ConfigError naming
    every bad file (up to MAX_LISTED), or a batch the dataset cannot fill."""
    from flux_trainer.config.errors import ConfigError
    from flux_trainer.data.check import check_folder

    folder = Path(str(dataset.images)).expanduser()
    check = check_folder(folder, dataset.caption_extension, cache_dir)
    _refuse_bad_files(dataset, check, dataset.trigger)
    usable = len(check.usable())
    if batch_size > usable:
        raise ConfigError(
            f"train.batch_size={batch_size} is larger than dataset '{dataset.name}' ({usable} images): sd-scripts "
            f"would train smaller batches than that; use train.batch_size={usable} or less"
        )
    if problem := _split_problem(dataset, usable, batch_size):
        raise ConfigError(problem)
    notes = check.notes()
    trained, held = split_counts(usable, float(dataset.validation_split))
    if held and trained + held > usable:
        notes.append(
            f"dataset.validation_split={dataset.validation_split}: {trained + held - usable} of the {held} held-out "
            f"images also trains (sd-scripts' rounding of {usable} images)"
        )
    problems: list[str] = []
    masks = _masks("dataset.masks", dataset.get("masks"), check, problems, notes)
    if problems:
        raise ConfigError(problems)
    alpha = bool(dataset.get("alpha_mask") or masks)
    te_key, latents_key = _stage_keys(dataset, model, dataset.trigger, alpha, te_fp8)
    staged = stage(check, str(dataset.name), cache_dir, dataset.caption_extension, te_key, latents_key, masks)
    return staged, notes


def ready_all(
    dataset: Any, model: Any, cache_dir: Path, batch_size: int = 1, te_fp8: bool = False
) -> tuple[list[Path], list[str]]:
    """Every folder of a run's dataset checked, then each staged (the single-folder form: `ready`): (the staged
    folders, one per subset in order, and notes to show). Nothing is staged until every folder passed."""
    from flux_trainer.config.errors import ConfigError
    from flux_trainer.data.check import check_folder
    from flux_trainer.data.subsets import subsets_of

    if not dataset.get("subsets"):
        staged, notes = ready(dataset, model, cache_dir, batch_size, te_fp8)
        return [staged], notes
    subsets = subsets_of(dataset)
    checks = [check_folder(Path(s.images).expanduser(), dataset.caption_extension, cache_dir) for s in subsets]
    problems: list[str] = []
    for subset, check in zip(subsets, checks, strict=True):
        try:
            _refuse_bad_files(dataset, check, subset.trigger)
        except ConfigError as exc:
            problems += exc.problems
    if problems:
        raise ConfigError(problems)
    learned = sum(len(c.usable()) for s, c in zip(subsets, checks, strict=True) if not s.is_reg)
    if batch_size > learned:
        raise ConfigError(
            f"train.batch_size={batch_size} is larger than the {learned} images dataset '{dataset.name}' learns "
            f"(its subsets without is_reg); use train.batch_size={learned} or less"
        )
    notes: list[str] = []
    for subset, check in zip(subsets, checks, strict=True):
        if not subset.is_reg and (problem := _split_problem(dataset, len(check.usable()), 1)):
            raise ConfigError(f"{check.folder}: {problem}")
        notes += check.notes()
    masks = [_masks(f"dataset.subsets[{i}].masks", s.masks, c, problems, notes) for i, (s, c) in
             enumerate(zip(subsets, checks, strict=True))]  # fmt: skip
    if problems:
        raise ConfigError(problems)
    staged = []
    for subset, check, masked in zip(subsets, checks, masks, strict=True):
        te_key, latents_key = _stage_keys(dataset, model, subset.trigger, subset.alpha_mask, te_fp8)
        staged.append(
            stage(check, str(dataset.name), cache_dir, dataset.caption_extension, te_key, latents_key, masked)
        )
    return staged, notes
