"""The base model's sha256, computed once per file instead of at every start.

sd-scripts writes the base model's sha256 into the LoRA's metadata (`ss_new_sd_model_hash`, what webui-style
tools match a LoRA to its model by) and computes it at the start of every run, reading the whole file: FLUX.1-dev is
24 GB, 19 s of every start on the lent H200 machine before the first step. The runner wraps sd-scripts' function
for the run (`cached`): a digest is kept in flux-train's cache folder under the file's real path, size and
modification time, the way webui keeps its model hashes, and a file that changes in any of them is read again. The
metadata holds the same digest either way.

A file not in the cache yet (a model's first run, every run on a fresh machine) is read on a thread of its own from the
moment the model has loaded (`ahead`), while the run caches the text encoders' outputs, builds the LoRA and checks its
kernels: sd-scripts' own call, before the first step, then takes the digest (waiting for what is left of it) instead of
reading 24 GB at that point. hashlib lets go of the GIL while it hashes, so the thread costs the run a CPU core, not
its time.
"""

from __future__ import annotations

import json
import logging
import os
import stat
import threading
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


class _Reading:
    """A digest being computed on a thread of its own (`ahead`); `digest` is None until it ends, and after a failure."""

    def __init__(self, work: Callable[[], str]) -> None:
        self.digest: str | None = None

        def run() -> None:
            try:
                self.digest = work()
            except Exception as exc:  # noqa: BLE001 - the caller's own call computes it again
                log.warning("sha256 ahead of time failed (%s: %s): computed when sd-scripts asks", type(exc).__name__,
                            exc)  # fmt: skip

        # a daemon: a run that stops (Ctrl-C, a crash) does not wait for 24 GB to be read
        self.thread = threading.Thread(target=run, name="flux-train sha256", daemon=True)
        self.thread.start()


def cached(compute: Callable[[str], str], cache: Path) -> Callable[[str], str]:
    """`compute(path)` (sd-scripts' calculate_sha256) with its digests of regular files kept in `cache`. Anything
    else (a folder, a missing file, sd-scripts' "NOFILE"-style answers) goes to `compute` and is not kept. The
    function returned has `ahead(path)`: start that file's digest now, on a thread of its own (see the module)."""
    reading: dict[str, _Reading] = {}
    lock = threading.Lock()

    def compute_and_keep(filename: str, st: os.stat_result, key: str, where: str) -> str:
        t0 = time.perf_counter()
        digest = compute(filename)
        if _is_digest(digest):
            with lock:
                table = _read(cache)  # read again: another run may have kept a digest during this one's 20 s
                table.pop(key, None)  # re-inserted last, so the newest entries are the ones kept
                table[key] = digest
                _write(cache, table)
            log.info(
                "sha256 of %s (%.1f GB) took %.1f s%s; kept in %s for later runs",
                filename, st.st_size / 1e9, time.perf_counter() - t0, where, cache,
            )  # fmt: skip
        return digest

    def regular(filename: str) -> tuple[os.stat_result, str] | None:
        try:
            st = os.stat(filename)
        except OSError:
            return None
        return (st, file_key(st, filename)) if stat.S_ISREG(st.st_mode) else None

    def sha256(filename: str) -> str:
        found = regular(filename)
        if found is None:
            return compute(filename)
        st, key = found
        with lock:
            job = reading.pop(key, None)
        if job is not None:
            t0 = time.perf_counter()
            job.thread.join()
            if job.digest is not None:
                log.info("sha256 of %s: read beside the start-up; the run waited %.1f s for it", filename,
                         time.perf_counter() - t0)  # fmt: skip
                return job.digest
        known = _read(cache).get(key)
        if known is not None:
            log.info("sha256 of %s from the cache (%s), not read again", filename, cache)
            return known
        return compute_and_keep(filename, st, key, "")

    def ahead(filename: str) -> bool:
        """Start `filename`'s digest on a thread of its own, unless the cache has it (or it is no regular file, or it
        is being read already). Whether a thread started."""
        found = regular(filename)
        if found is None:
            return False
        st, key = found
        with lock:
            if key in reading or _read(cache).get(key) is not None:
                return False
            reading[key] = _Reading(lambda: compute_and_keep(filename, st, key, " (on a thread beside the start-up)"))
        return True

    sha256.ahead = ahead  # type: ignore[attr-defined]
    return sha256
