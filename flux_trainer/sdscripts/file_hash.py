"""The base model's sha256, computed once per file instead of at every start.

sd-scripts writes the base model's sha256 into the LoRA's metadata (`ss_new_sd_model_hash`, what webui-style
tools match a LoRA to its model by) and computes it at the start of every run, reading the whole file: FLUX.1-dev is
24 GB, 19 s of every start on the lent H200 machine before the first step. The runner wraps sd-scripts' function
for the run (`cached`): a digest is kept in flux-train's cache folder under the file's real path, size and
modification time, the way webui keeps its model hashes, and a file that changes in any of them is read again. The
metadata holds the same digest either way.
"""

from __future__ import annotations

import json
import logging
import os
import stat
import time
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger("flux_trainer.file_hash")
CACHE_FILE = "file_hashes.json"
KEEP = 64  # digests kept; the oldest go first


def file_key(st: os.stat_result, path: str) -> str:
    return f"{os.path.realpath(path)}|{st.st_size}|{st.st_mtime_ns}"


def _is_digest(value: object) -> bool:
    return isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value)


def _read(cache: Path) -> dict[str, str]:
    try:
        table = json.loads(cache.read_text())
    except (OSError, ValueError):
        return {}
    return {k: v for k, v in table.items() if _is_digest(v)} if isinstance(table, dict) else {}


def write_json_atomic(path: Path, data: object) -> None:
    """`data` as JSON into `path`, whole or not at all (other processes, e.g. a multi-GPU run's, may write it too);
    raises OSError."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(data, indent=1) + "\n")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _write(cache: Path, table: dict[str, str]) -> None:
    """Atomically, or not at all."""
    try:
        write_json_atomic(cache, dict(list(table.items())[-KEEP:]))
    except OSError as exc:
        log.warning("could not keep the model hash in %s (%s): the next run computes it again", cache, exc)


def cached(compute: Callable[[str], str], cache: Path) -> Callable[[str], str]:
    """`compute(path)` (sd-scripts' calculate_sha256) with its digests of regular files kept in `cache`. Anything
    else (a folder, a missing file, sd-scripts' "NOFILE"-style answers) goes to `compute` and is not kept."""

    def sha256(filename: str) -> str:
        try:
            st = os.stat(filename)
        except OSError:
            return compute(filename)
        if not stat.S_ISREG(st.st_mode):
            return compute(filename)
        key = file_key(st, filename)
        known = _read(cache).get(key)
        if known is not None:
            log.info("sha256 of %s from the cache (%s), not read again", filename, cache)
            return known
        t0 = time.perf_counter()
        digest = compute(filename)
        if _is_digest(digest):
            table = _read(cache)  # read again: another run may have kept a digest during this one's 20 s
            table.pop(key, None)  # re-inserted last, so the newest entries are the ones kept
            table[key] = digest
            _write(cache, table)
            log.info(
                "sha256 of %s (%.1f GB) took %.1f s; kept in %s for later runs",
                filename, st.st_size / 1e9, time.perf_counter() - t0, cache,
            )  # fmt: skip
        return digest

    return sha256
