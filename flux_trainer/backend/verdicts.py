"""A trainer's own check of the run's files (its parser, its dataset schema) remembered when it passed, for both
backends: an identical set of files is not checked again, so the trainer is not imported for it at every launch.
Problems are never kept: they are found again."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger("flux_trainer.launch")

KEEP = 64  # passed verdicts kept; the oldest go first


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
