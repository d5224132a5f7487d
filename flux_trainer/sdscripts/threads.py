"""Start-up work on the CPU with this process's share of the cores.

Training runs torch's CPU ops on launcher.cpu_threads_per_process threads (2 by default, so that training processes
and their data loaders do not oversubscribe the cores). While sd-scripts loads the base model nothing else competes,
and on an fp8 base (the 12-24 GB tiers) it casts a bf16 FLUX.1-dev to fp8 on the CPU at every start, 11.9B elements,
which scales with threads (on the lent H200's 16 cores 6.8-8.5 s with two threads, 1.2-1.4 s with sixteen). For
that, torch may use the share of the cores this process may run on, divided among the node's training processes
(LOCAL_WORLD_SIZE); the setting is put back after. Not every start-up step gains: the kernels' check of the patched
blocks on the CPU model took 5.0-5.5 s with the lent H200's 16 threads against 2.3-3.1 s with 2.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator

log = logging.getLogger("flux_trainer.runner")


def core_share() -> int:
    """The cores this process may run on, divided among the node's training processes (LOCAL_WORLD_SIZE)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // max(int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1), 1))


@contextlib.contextmanager
def cpu_share(what: str) -> Iterator[int]:
    """torch's CPU threads raised to core_share() (never lowered) while `what` runs; logs "WHAT with N CPU
    threads" where that is more than training keeps."""
    import torch

    before = torch.get_num_threads()
    share = max(before, core_share())
    if share > before:
        log.info("%s with %d CPU threads (training keeps %d)", what, share, before)
    torch.set_num_threads(share)
    try:
        yield share
    finally:
        torch.set_num_threads(before)
