"""The samples' autoencoder decode, with the CPU to fall back on: on the small tiers the card may have too little left
for the decode of a 1024 px sample (on an H200 under vram16's cap, 10 blocks swapped with CUDA graphs, it asked for
1 GiB more than the cap held, 2026-11-29), and an error there used to end the run. Where the card runs out of memory
for it, the same decode runs on the CPU in float32 (seconds to tens of seconds a sample) and the image goes back to
the card in its dtype; said once a run. Any other error is raised as before."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor

log = logging.getLogger("flux_trainer.runner")


def _on_cpu(ae: Any, z: Tensor) -> Tensor:
    """`ae.decode(z)` on the CPU in float32; the autoencoder put back where it was, in its dtype."""
    param = next(ae.parameters())
    device, dtype = param.device, param.dtype
    if z.is_cuda:
        torch.cuda.empty_cache()
    ae.to("cpu", torch.float32)
    try:
        with torch.autocast("cpu", enabled=False), torch.no_grad():
            image = type(ae).decode(ae, z.detach().to("cpu", torch.float32))
    finally:
        ae.to(device, dtype)
    return image.to(z.device, z.dtype)


@contextlib.contextmanager
def cpu_fallback(ae: Any, said: list[bool]) -> Iterator[None]:
    """`ae.decode` for the block: the card's, and where that runs out of memory, the CPU's (`said[0]`: the line was
    given this run). Nothing changes for an `ae` without `decode` or parameters."""
    if ae is None or not callable(getattr(ae, "decode", None)) or next(iter(ae.parameters()), None) is None:
        yield
        return
    decode: Callable = ae.decode

    def guarded(z: Tensor) -> Tensor:
        try:
            return decode(z)
        except torch.OutOfMemoryError:
            pass  # out of the handler first: the failed decode's frames (and their tensors) go with the exception
        began = time.monotonic()
        image = _on_cpu(ae, z)
        if not said[0]:
            said[0] = True
            log.warning(
                "sample: the card ran out of memory for the autoencoder's decode of a %s latent; decoded on the CPU "
                "instead (%.1f s; later samples too, where the card is short again)",
                "x".join(map(str, z.shape[-2:])), time.monotonic() - began,
            )  # fmt: skip
        return image

    ae.decode = guarded
    try:
        yield
    finally:
        if ae.__dict__.get("decode") is guarded:
            del ae.decode
