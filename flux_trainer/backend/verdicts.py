"""A trainer's own check of the run's files (its parser, its dataset schema) remembered when it passed, for both
backends: an identical set of files is not checked again, so the trainer is not imported for it at every launch.
Problems are never kept: they are found again."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
from collections.abc import Callable, Iterable
from importlib import metadata
from pathlib import Path

log = logging.getLogger("flux_trainer.launch")

KEEP = 64  # passed verdicts kept; the oldest go first


def code_digest(checker: Path, root: Path, files: Iterable[Path], packages: Iterable[str]) -> hashlib._Hash:
    """A running digest of what a trainer's check depends on beyond the run's files: the checking module itself,
    the trainer's code (`files` under `root`, by size and time), the Python and the packages' versions."""
    h = hashlib.sha256(Path(checker).read_bytes())
    h.update(f"{root}|{sys.version}\n".encode())
    for f in sorted(files):
        st = f.stat()
        h.update(f"{f.relative_to(root)}|{st.st_size}|{st.st_mtime_ns}\n".encode())
    for name in packages:
        try:
            h.update(f"{name}={metadata.version(name)}\n".encode())
        except metadata.PackageNotFoundError:
            h.update(f"{name}=-\n".encode())
    return h


def passed(cache: Path) -> list[str]:
    """The keys of the file sets that passed, oldest first (none where the file is missing or unreadable)."""
    try:
        keys = json.loads(cache.read_text())
    except (OSError, ValueError):
        return []
    return [k for k in keys if isinstance(k, str)] if isinstance(keys, list) else []


def remembered(cache: Path, key: str, check: Callable[[], list[str]]) -> list[str]:
    """`check()`'s problems, skipped (none) where `key` passed before; a pass is added to `cache` (written aside and
    renamed; a cache that cannot be written only means checking again next time)."""
    if key in passed(cache):
        return []
    problems = check()
    if not problems:
        keys = [k for k in passed(cache) if k != key] + [key]
        try:
            cache.parent.mkdir(parents=True, exist_ok=True)
            tmp = cache.with_name(f".{cache.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(keys[-KEEP:]))
            os.replace(tmp, cache)
        except OSError as exc:
            log.warning("could not keep the check's verdict in %s (%s): the next run checks again", cache, exc)
    return problems
