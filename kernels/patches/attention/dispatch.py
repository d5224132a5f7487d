"""The attention the patched blocks call (`AttentionDispatch`): the backend the probe chose, per shape for eager
calls and once per run for compiled blocks.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import torch
from torch import Tensor

from flux_kernels.patches.attention.backends import BACKENDS, AttentionBackend, heads_to_tokens
from flux_kernels.patches.attention.probe import BackendResult, chosen, describe, probe_attention
from flux_kernels.runtime.device import as_device_info
from flux_kernels.runtime.errors import KernelError

log = logging.getLogger(__name__)


def _isolated(fn: Callable, *args, **kwargs):
    """Run fn(*args, **kwargs) in a fresh thread and return its result (or raise its exception there).

    The attention probe runs at the first eager call of a new shape, i.e. inside some block's forward. Grad mode,
    autocast and saved-tensor hooks are thread-local, so the probe sees none of the caller's: gradient
    checkpointing's hooks do not record the probe's own tensors (the original forward and its recomputation then
    save the same tensors), a no_grad or autocast context around the forward does not change the probe's verdict,
    and the probe's backward passes happen in its own autograd graph."""
    box: dict = {}

    def target():
        try:
            box["value"] = fn(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001 - handed back to the caller's thread below
            box["error"] = e

    worker = threading.Thread(target=target, name="flux_kernels-attention-probe", daemon=True)
    worker.start()
    worker.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


def _probe_on(device: torch.device, *args, **kwargs) -> list[BackendResult]:
    """probe_attention with `device` as the thread's current CUDA device (events time on its stream)."""
    if device.type == "cuda":
        with torch.cuda.device(device):
            return probe_attention(*args, **kwargs)
    return probe_attention(*args, **kwargs)


def _fallback(results: Sequence[BackendResult], shape, dtype: torch.dtype, dev: torch.device, with_mask: bool) -> str:
    """What runs where no probed backend passed: PyTorch's own SDPA, unless it was probed and failed too. Then
    nothing correct is left (the math backend was not tried, its weights too large, or failed as well), and
    KernelError says so: a rejected backend is never used, and training on wrong attention gradients would
    only look like training."""
    if not any(r.name == "sdpa" for r in results):
        return "sdpa"
    where = f"{tuple(shape)} {str(dtype).removeprefix('torch.')} mask={with_mask} on {as_device_info(dev).name}"
    raise KernelError(
        f"attention: no backend is correct at {where} ({describe(results)}). PyTorch's own SDPA, which sd-scripts "
        "calls with the kernels off too, is among them: this PyTorch build's attention is wrong or broken on this GPU"
    )


class AttentionDispatch:
    """Callable (q, k, v, mask) -> [B, H, L, D] that uses the backend chosen by measurement.

    Eager calls use the backend chosen for their exact shape, dtype, device and mask: the first call at a new shape
    probes (in a thread of its own, see `_isolated`); later calls, and the recomputation of a checkpointed forward,
    reuse that choice. A call on another device than the one training runs on (`device`; `verify_blocks` runs the
    blocks on tiny inputs wherever the model is, often the CPU) uses PyTorch's SDPA and probes nothing: a verdict
    there says nothing about the GPU, and the math backend it may pick would materialise [B, H, L, L] weights at
    4608 tokens.

    Compiled code (regional torch.compile of the blocks) never probes while tracing: it uses `run_choice`, the
    backend that `decide_run` chose at the run's first real forward (called from a forward pre-hook on the model,
    see `flux_kernels.patches.patch`, before any block is traced), for every shape; only SDPA backends qualify there
    (others would break the graph), else PyTorch's own SDPA. One attribute, set once, rather than a lookup per
    shape: torch.compile guards on what traced code reads, and a table that gains an entry for each new bucket
    shape would make every compiled block recompile."""

    def __init__(
        self,
        cache_path: Path | str | None = None,
        backends: Mapping[str, AttentionBackend] | None = None,
        device=None,
    ):
        self.cache_path = cache_path
        self.backends = BACKENDS if backends is None else backends
        self.device = None if device is None else as_device_info(device).torch_device
        self.choice: dict[tuple, str] = {}
        self.run_choice: str | None = None
        self.run_line: str | None = None  # what decide_run chose and why, for the run's log and TensorBoard

    @staticmethod
    def key(q: Tensor, k: Tensor, mask: Tensor | None) -> tuple:
        return (tuple(q.shape), k.shape[2], q.dtype, q.device, mask is not None)

    @staticmethod
    def shape_key(shape: Sequence[int], dtype: torch.dtype, device, with_mask: bool) -> tuple:
        """`key` of a self-attention call at `shape` (keys as long as queries)."""
        return (tuple(shape), shape[2], dtype, as_device_info(device).torch_device, with_mask)

    def prepare(self, shape: Sequence[int], dtype: torch.dtype, device, with_mask: bool) -> str:
        dev = as_device_info(device).torch_device
        start = time.perf_counter()
        results = _isolated(
            _probe_on, dev, tuple(shape), dtype, dev, with_mask, backends=self.backends, cache_path=self.cache_path
        )
        took = time.perf_counter() - start  # a cached verdict's: its choice's check (and first call) alone
        name = chosen(results) or _fallback(results, shape, dtype, dev, with_mask)
        log.info("attention %s %s mask=%s: %s (%s; %.1f s)", tuple(shape), dtype, with_mask, name,
                 describe(results) or "nothing ran", took)  # fmt: skip
        self.choice[self.shape_key(shape, dtype, dev, with_mask)] = name
        return name

    def decide_run(self, shape: Sequence[int], dtype: torch.dtype, device, with_mask: bool) -> str:
        """Choose the backend compiled blocks use, by a probe at the run's real shape (cached on disk)."""
        name = self.choice.get(self.shape_key(shape, dtype, device, with_mask))
        name = name or self.prepare(shape, dtype, device, with_mask)
        backend = self.backends.get(name)
        self.run_choice = name if backend is not None and backend.compilable else "sdpa"
        self.run_line = f"{name} at {tuple(shape)} {str(dtype).removeprefix('torch.')} mask={with_mask}"
        if self.run_choice != name:
            self.run_line += f"; compiled blocks use sdpa ({name} is not compiled)"
        self._agree_with_rank_zero()
        return self.run_choice

    def _agree_with_rank_zero(self) -> None:
        """Several processes (one per GPU): each probed on its own GPU, and timing noise can make them choose
        differently (cuDNN and PyTorch's own choice are within 2% on the H200); every rank takes rank 0's verdict, so
        all of them run the same attention. A collective: every rank gets here at its model's first forward."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
            return
        verdict = [self.run_choice, self.run_line]
        dist.broadcast_object_list(verdict, src=0)
        if verdict[0] != self.run_choice:
            rank = dist.get_rank()
            log.info("attention: rank %d uses rank 0's choice %s (its own: %s)", rank, verdict[0], self.run_choice)
        self.run_choice, self.run_line = verdict

    def compiled_context(self) -> contextlib.AbstractContextManager:
        """Held around every call of a compiled block (flux_kernels.patches.compile_blocks): the run's SDPA backend,
        which the traced code then calls (it uses plain SDPA itself)."""
        return self.backends.get(self.run_choice or "sdpa", BACKENDS["sdpa"]).backend_context()

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None) -> Tensor:
        _, fn = self._pick(q, k, mask)
        return fn(q, k, v, mask)

    def tokens(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None) -> Tensor:
        """The attention as tokens [B, L, H*D] (sd-scripts' "B H L D -> B L (H D)"), what the blocks call: the
        backend's own tokens form where it has one (no copy), else `heads_to_tokens` over its output."""
        backend, fn = self._pick(q, k, mask)
        if backend.tokens is not None:
            return backend.tokens(q, k, v, mask)
        return heads_to_tokens(fn(q, k, v, mask))

    def _pick(self, q: Tensor, k: Tensor, mask: Tensor | None) -> tuple[AttentionBackend, Callable]:
        """The backend for this call and what to call of it."""
        if torch.compiler.is_compiling():
            backend = self.backends.get(self.run_choice or "sdpa")
            if backend is not None and backend.op is not None:
                return backend, backend.op  # custom ops, traced as they are
            name = "sdpa"  # an SDPA backend is set around the compiled call: compiled_context
        else:
            name = self.choice.get(self.key(q, k, mask))
            if name is None:
                elsewhere = self.device is not None and q.device != self.device
                cross = q.shape[2] != k.shape[2]
                name = "sdpa" if elsewhere or cross else self.prepare(q.shape, q.dtype, q.device, mask is not None)
        backend = self.backends.get(name, BACKENDS["sdpa"])
        return backend, backend.run
