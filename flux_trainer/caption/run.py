"""A folder captioned: which images get a caption, the batches through the model, each caption written atomically.

The user's folder receives caption files and nothing else: a caption is written to a hidden temporary file beside
its image and renamed over `NAME.txt`, so an interrupted run (Ctrl-C, a crash, a full disk) leaves every caption
either as it was or complete, never half-written, and no temporary file behind.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from flux_trainer.caption.models import RANDOM_TINY, CaptionerSpec, captioner_dir, missing_files, setup_command
from flux_trainer.config import ConfigError
from flux_trainer.data.check import IMAGE_EXTENSIONS

CAPTION_EXTENSION = ".txt"  # what sd-scripts reads beside each image (flux-train's datasets use .txt)


@dataclass
class Plan:
    folder: Path
    todo: list[str]  # image names to caption, sorted
    kept: list[str]  # images whose caption stays as it is
    failed: dict[str, str] = field(default_factory=dict)  # image name -> why it cannot be captioned


@dataclass
class Outcome:
    written: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    interrupted: bool = False
    seconds: float = 0.0
    captioned: int = 0  # images through the model (written, or shown by a dry run)

    def summary(self) -> str:
        line = f"{len(self.written)} written, {len(self.kept)} kept, {len(self.failed)} failed"
        if self.failed:
            line += ": " + ", ".join(f"{n} ({why})" for n, why in sorted(self.failed.items()))
        if self.interrupted:
            line = "interrupted: " + line + "; the images not reached have no caption yet (run it again)"
        return line


def caption_path(folder: Path, image: str) -> Path:
    return folder / (os.path.splitext(image)[0] + CAPTION_EXTENSION)


def _blank(path: Path) -> bool:
    """An empty (or whitespace-only) caption file holds nothing to keep."""
    try:
        return path.stat().st_size < 4096 and not path.read_bytes().strip()
    except OSError:
        return False


def plan_folder(folder: Path, overwrite: bool = False) -> Plan:
    """The images of `folder` (top level, as training reads it): each to caption, kept, or failed with the reason.

    Every image is checked as `dataset init` and a launch check it (flux_trainer.data.check): one that cannot be
    trained on is not captioned either. An existing caption file is kept unless `overwrite` (an empty one is not a
    caption). Two images with one stem (a.png, a.jpg) would share a.txt: both are refused, naming the other.
    """
    from flux_trainer.config.paths import cache_root
    from flux_trainer.data.check import check_folder

    folder = Path(folder).expanduser()
    if not folder.is_dir():
        raise ConfigError(f"{folder}: no such folder")
    check = check_folder(folder, CAPTION_EXTENSION, cache_root())
    broken = [n for n in check.broken_links if os.path.splitext(n)[1].lower() in IMAGE_EXTENSIONS]
    if not check.images and not broken:
        raise ConfigError(f"{check.folder}: no images ({' '.join(IMAGE_EXTENSIONS)}) at its top level")
    plan = Plan(check.folder, [], [])
    plan.failed.update({n: r.problem for n, r in check.images.items() if r.problem})
    plan.failed.update({n: "a symbolic link that loops or points nowhere" for n in broken})
    usable = sorted(check.usable())
    stems: dict[str, list[str]] = {}
    for name in usable:
        stems.setdefault(os.path.splitext(name)[0], []).append(name)
    for name in usable:
        stem = os.path.splitext(name)[0]
        others = [n for n in stems[stem] if n != name]
        path = caption_path(plan.folder, name)
        if others:
            plan.failed[name] = f"shares {path.name} with {', '.join(others)}; rename one"
        elif path.exists() and not overwrite and not _blank(path):
            plan.kept.append(name)
        else:
            plan.todo.append(name)
    return plan


def model_folder(spec: CaptionerSpec) -> Path:
    """The captioner's files, ready to load: random_tiny is built here once; a downloaded one must be complete."""
    folder = captioner_dir(spec)
    if spec.name == RANDOM_TINY:
        from flux_trainer.caption.tiny import ensure_random_tiny

        return ensure_random_tiny(folder)
    missing = missing_files(spec, folder)
    if missing:
        what = "is not downloaded"
        if folder.is_dir():
            what = f"is not completely downloaded ({folder} lacks {missing[0]})"
        raise ConfigError(f"captioner {spec.name} {what}; get it with: {setup_command(spec)}")
    return folder


def write_caption(path: Path, text: str) -> None:
    """`text` to `path` completely or not at all: a hidden temporary file beside it, synced, then renamed over it."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.flux-train.tmp")
    try:
        with open(tmp, "w", encoding="utf-8", newline="\n") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:  # Ctrl-C or a full disk mid-write: no partial file, no temporary file left
        tmp.unlink(missing_ok=True)
        raise


def with_trigger(text: str, trigger: str | None) -> str:
    """The trigger word first, once."""
    if not trigger or text.lower().startswith(trigger.lower()):
        return text
    return f"{trigger}, {text}" if text else trigger


def open_image(path: Path):
    """RGB and upright as a viewer shows it (EXIF orientation applied), as training sees it."""
    from PIL import Image, ImageOps

    with Image.open(path) as im:
        return ImageOps.exif_transpose(im).convert("RGB")


def _reason(exc: BaseException) -> str:
    return " ".join(f"{type(exc).__name__}: {exc}".split())[:160]


def caption_folder(
    plan: Plan,
    caption: Callable[[list], list[str]],
    *,
    trigger: str | None = None,
    batch_size: int = 1,
    dry_run: int = 0,
    show: Callable[[str], None] = print,
    progress: bool = True,
) -> Outcome:
    """Caption `plan.todo` in batches through `caption` (images -> texts) and write each caption as it comes.

    A batch that fails is tried again image by image (a batch too large for the GPU still captions its images);
    an image that still fails is named in the outcome with the reason. `dry_run` N: the first N captions are shown
    and nothing is written. Ctrl-C stops after the write in progress: the outcome says what was written.
    """
    from tqdm import tqdm

    out = Outcome(kept=list(plan.kept), failed=dict(plan.failed))
    todo = plan.todo[:dry_run] if dry_run else plan.todo
    start = time.perf_counter()
    bar = tqdm(total=len(todo), unit="img", desc="captioning", disable=not progress, file=sys.stderr)
    try:
        with stop_requests() as stop:
            _caption_batches(plan, todo, caption, out, trigger, batch_size, dry_run, show, bar, stop)
    except KeyboardInterrupt:  # a second Ctrl-C: at once (no write is half done: each one is a rename)
        out.interrupted = True
    bar.close()
    out.seconds = time.perf_counter() - start
    return out


@contextlib.contextmanager
def stop_requests():
    """Ctrl-C (or SIGTERM) asks to stop after the batch in progress (`stop["asked"]`); a second one stops at once.
    A flag, not an exception, so the request is not lost inside the model's code (an exception raised in a finaliser
    there is only printed). Only in the main thread, where Python delivers signals; elsewhere nothing changes."""
    stop = {"asked": False}
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return

    def asked(signum, frame):
        if stop["asked"]:
            raise KeyboardInterrupt
        stop["asked"] = True
        print("\nstopping after this batch (Ctrl-C again: at once)", file=sys.stderr, flush=True)

    before = {sig: signal.signal(sig, asked) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield stop
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def _caption_batches(plan, todo, caption, out, trigger, batch_size, dry_run, show, bar, stop) -> None:
    """The batches of `todo`, each captioned and written as it comes; stops between batches when asked."""
    for i in range(0, len(todo), batch_size):
        if stop["asked"]:
            out.interrupted = True
            return
        names, images = [], []
        for name in todo[i : i + batch_size]:
            try:
                images.append(open_image(plan.folder / name))
                names.append(name)
            except Exception as exc:  # noqa: BLE001 - one unreadable image is named, the rest go on
                out.failed[name] = f"cannot be opened: {_reason(exc)}"
        for name, text in _through_model(caption, names, images, out.failed):
            out.captioned += 1
            text = with_trigger(text, trigger)
            if dry_run:
                show(f"{name}: {text}")
                continue
            try:
                write_caption(caption_path(plan.folder, name), text)
            except OSError as exc:
                out.failed[name] = f"cannot write {caption_path(plan.folder, name).name}: {exc.strerror or exc}"
                continue
            out.written.append(name)
        bar.update(len(todo[i : i + batch_size]))


def _through_model(caption, names: list[str], images: list, failed: dict[str, str]):
    """(name, caption) for each image that the model captioned; the others into `failed`."""
    if not images:
        return []
    try:
        return list(zip(names, caption(images), strict=True))
    except Exception as exc:  # noqa: BLE001 - retried one by one below, then named
        if len(images) == 1:
            failed[names[0]] = f"the captioner failed: {_reason(exc)}"
            return []
    done = []
    for name, image in zip(names, images, strict=True):
        done += _through_model(caption, [name], [image], failed)
    return done
