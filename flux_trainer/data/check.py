"""Every file of a dataset folder checked before anything is made: at `dataset init` and at every launch.

sd-scripts meets a bad file mid-run (a truncated PNG, a zero-byte .jpg, a text file named .png: a traceback after
the run dir exists; a 1x1 image: ZeroDivisionError naming no file; a UTF-16 caption: UnicodeDecodeError). Here each
image is read through (PNG: every chunk's checksum; JPEG and others: decoded), measured (short side at least
MIN_SIDE pixels, as a viewer shows it: EXIF rotation applied), and each caption is read as text; every problem names
its file, all of them in one refusal.

A folder of 1,000 images is decoded once: results are kept per file, keyed by its size and modification time, in
flux-train's cache (`<cache>/datacheck/`), so a launch re-reads only the files that changed. Large uncached folders
are checked on every core.
"""

from __future__ import annotations

import codecs
import hashlib
import json
import os
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".bmp")
MIN_SIDE = 64  # pixels on the short side: FLUX's smallest bucket; smaller ones divide by zero in sd-scripts
ROTATED = (5, 6, 7, 8)  # EXIF orientations that swap width and height
CHECK_VERSION = 1  # bump when what a file's result holds changes: cached results of another version are redone
PARALLEL_FROM = 64  # uncached images from which the check uses a process per core


@dataclass
class ImageResult:
    width: int = 0  # as shown (after the EXIF orientation)
    height: int = 0
    orientation: int = 1  # EXIF orientation tag (1: upright as stored)
    problem: str | None = None


@dataclass
class CaptionResult:
    encoding: str = "utf-8"  # what it was read as: utf-8, utf-8-sig, utf-16, cp1252
    problem: str | None = None


@dataclass
class FolderCheck:
    folder: Path
    images: dict[str, ImageResult] = field(default_factory=dict)  # file name -> result, usable or not
    captions: dict[str, CaptionResult] = field(default_factory=dict)  # caption file name -> result
    broken_links: list[str] = field(default_factory=list)  # entries that loop or point nowhere

    def usable(self) -> list[str]:
        return [n for n, r in self.images.items() if r.problem is None]

    def problems(self) -> list[str]:
        """One line per bad file, naming it."""
        out = [f"{self.folder / n}: {r.problem}" for n, r in sorted(self.images.items()) if r.problem]
        out += [f"{self.folder / n}: {r.problem}" for n, r in sorted(self.captions.items()) if r.problem]
        out += [f"{self.folder / n}: a symbolic link that loops or points nowhere" for n in self.broken_links]
        return out

    def notes(self) -> list[str]:
        """What is fine but done for the user: rotated photos trained upright, captions read in another encoding."""
        rotated = sorted(n for n, r in self.images.items() if r.problem is None and r.orientation != 1)
        recoded = sorted(
            (n, r.encoding) for n, r in self.captions.items() if r.problem is None and r.encoding != "utf-8"
        )
        out = []
        if rotated:
            some = ", ".join(rotated[:3]) + (" ..." if len(rotated) > 3 else "")
            out.append(
                f"{len(rotated)} photo(s) carry an EXIF rotation and are trained upright, as viewers show them: {some}"
            )
        for name, enc in recoded:
            out.append(f"{self.folder / name}: caption read as {enc}, not UTF-8 (save it as UTF-8 to silence this)")
        return out


def check_image(path: str) -> ImageResult:
    """Open and decode one image fully; its size as shown; a problem naming what is wrong, else None."""
    from PIL import Image, UnidentifiedImageError

    try:
        if os.path.getsize(path) == 0:
            return ImageResult(problem="empty file (0 bytes)")
        with Image.open(path) as im:
            png = im.format == "PNG"
            if png:
                im.verify()  # every chunk's CRC: truncated (IEND too) or damaged data fails, ~15x cheaper than decoding
        with Image.open(path) as im:
            orientation = _orientation(im, png)
            w, h = im.size
            if not png:
                if im.format == "JPEG":  # decoded at 1/8 scale: every byte is still read, ~30% less time
                    im.draft("RGB", (max(1, w // 8), max(1, h // 8)))
                im.load()  # decodes every byte: a truncated or damaged file fails here, not mid-training
    except UnidentifiedImageError:
        return ImageResult(problem="not an image PIL can read (wrong extension, or not an image at all)")
    except (OSError, SyntaxError, ValueError) as exc:  # truncated, damaged, unreadable (PIL raises all three)
        return ImageResult(problem=f"cannot be decoded: {exc}")
    except Image.DecompressionBombError as exc:
        return ImageResult(problem=f"too large to decode safely: {exc}")
    if orientation in ROTATED:
        w, h = h, w
    if min(w, h) < MIN_SIDE:
        return ImageResult(w, h, orientation, f"{w}x{h} pixels: the short side must be at least {MIN_SIDE}")
    return ImageResult(w, h, orientation if 1 <= orientation <= 8 else 1)


def _orientation(im, png: bool) -> int:
    """The EXIF orientation tag (1 where none). A PNG's getexif() decodes the whole image to look for an eXIf chunk
    after the pixels; one before them (where writers put it) is already in `info`, and that is read alone."""
    from PIL import Image

    if png:
        data = im.info.get("exif")
        if not data:
            return 1
        exif = Image.Exif()
        exif.load(data)
        return int(exif.get(0x0112, 1) or 1)
    return int(im.getexif().get(0x0112, 1) or 1)


def read_caption(data: bytes) -> tuple[str, str]:
    """(text, encoding) of a caption file: UTF-8 (with or without a BOM), UTF-16 with a BOM, else Windows-1252
    (Latin-1's superset); ValueError where none of them reads it as text."""
    if data.startswith(codecs.BOM_UTF8):
        return data[len(codecs.BOM_UTF8) :].decode("utf-8"), "utf-8-sig"
    if data.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):
        return data.decode("utf-16"), "utf-16"
    try:
        return data.decode("utf-8"), "utf-8"
    except UnicodeDecodeError:
        pass
    text = data.decode("cp1252", errors="strict")  # ValueError (UnicodeDecodeError) for bytes it does not map
    if "\x00" in text:
        raise ValueError("binary data")
    return text, "cp1252"


def check_caption(path: Path) -> CaptionResult:
    try:
        data = path.read_bytes()
    except OSError as exc:
        return CaptionResult(problem=f"caption unreadable: {exc.strerror or exc}")
    try:
        _, encoding = read_caption(data)
    except ValueError:
        return CaptionResult(problem="caption is not text (neither UTF-8, UTF-16 nor Windows-1252): save it as UTF-8")
    return CaptionResult(encoding)


def _cache_file(cache_dir: Path, folder: Path) -> Path:
    key = hashlib.sha256(str(folder).encode()).hexdigest()[:16]
    return cache_dir / "datacheck" / f"{key}.json"


def _load_cache(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data.get("files", {}) if data.get("version") == CHECK_VERSION else {}


def _save_cache(path: Path, folder: Path, files: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"version": CHECK_VERSION, "folder": str(folder), "files": files}), encoding="utf-8")
    os.replace(tmp, path)


def check_folder(folder: Path, caption_extension: str = ".txt", cache_dir: Path | None = None) -> FolderCheck:
    """Every image of `folder` (top level, as sd-scripts reads an image_dir) and the caption beside it."""
    folder = Path(folder).expanduser().resolve()
    result = FolderCheck(folder)
    cache_path = _cache_file(cache_dir, folder) if cache_dir is not None else None
    cached = _load_cache(cache_path) if cache_path else {}
    fresh: dict[str, list] = {}
    todo: list[tuple[str, str]] = []  # (name, key) of images to decode
    with os.scandir(folder) as entries:
        for entry in sorted(entries, key=lambda e: e.name):
            ext = os.path.splitext(entry.name)[1].lower()
            is_image = ext in IMAGE_EXTENSIONS
            if not is_image and ext != caption_extension:
                continue
            try:
                st = os.stat(entry.path)  # follows links: a loop (ELOOP) or a dangling link fails here
            except OSError:
                result.broken_links.append(entry.name)
                continue
            if not os.path.isfile(entry.path):
                continue
            key = f"{st.st_size}:{st.st_mtime_ns}"
            if not is_image:
                result.captions[entry.name] = CaptionResult(encoding="?")  # read below, beside its image
                continue
            hit = cached.get(entry.name)
            if hit and hit[0] == key:
                result.images[entry.name] = ImageResult(**hit[1])
                fresh[entry.name] = hit
            else:
                todo.append((entry.name, key))
    paths = [str(folder / name) for name, _ in todo]
    if len(paths) >= PARALLEL_FROM and (os.cpu_count() or 1) > 1:
        with ProcessPoolExecutor(max_workers=os.cpu_count()) as pool:
            checked = list(pool.map(check_image, paths, chunksize=16))
    else:
        checked = [check_image(p) for p in paths]
    for (name, key), res in zip(todo, checked, strict=True):
        result.images[name] = res
        fresh[name] = [key, asdict(res)]
    stems = {os.path.splitext(n)[0] for n in result.images}
    for name in list(result.captions):
        if os.path.splitext(name)[0] in stems:
            result.captions[name] = check_caption(folder / name)
        else:
            del result.captions[name]  # a text file without an image: not sd-scripts' business, nor ours
    if cache_path is not None and fresh != cached:
        try:
            _save_cache(cache_path, folder, fresh)
        except OSError:
            pass  # a read-only cache only costs the next launch its time
    return result


def caption_of(check: FolderCheck, image: str, caption_extension: str) -> str | None:
    """The caption file name of `image` when it has a usable one."""
    name = os.path.splitext(image)[0] + caption_extension
    res = check.captions.get(name)
    return name if res is not None and res.problem is None else None
