"""The base model to the GPU before accelerate's prepare, through page-locked staging buffers on several threads.

`accelerator.prepare(unet)` moves the model with `Module.to`: one tensor at a time from pageable host memory, where
the driver stages every byte through its own small pinned buffer, and sd-scripts' model is memory-mapped from the
safetensors file, so that same single thread also takes the page faults of reading the file. A 24 GB FLUX.1-dev
took 2.9 s that way on the lent H200. Here each of a few threads copies slices of the tensors into its own pinned
buffers (the host copy and its page faults in parallel) and sends them on its own CUDA stream while it fills the
next (0.6 s there); the module's tensors are then swapped for the device copies exactly as `Module.to` would swap
them, so accelerate's own move finds nothing left to do. Same bits, same tensor layout, same parameters
(`train.staged_copy`, on by default; with block swap sd-scripts moves the model itself and this does nothing).
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass
from typing import Any

# Two staging buffers per thread, so the host fills one while the other is in flight. Page-locking them costs
# time too: on the lent H200 (23.8 GB, scripts/bench_model_copy.py) 4 threads of 16 MiB took 0.56-0.60 s, 1 thread
# 0.68-0.74, 8 threads 0.76 (16 MiB) and 1.12-1.17 s (64 MiB), against 2.86-2.89 s through Module.to.
CHUNK_BYTES = 16 << 20
MAX_THREADS = 4
MIN_TENSOR_BYTES = 1 << 20  # smaller tensors go the plain way (their count, not their bytes, is what costs)


@dataclass(frozen=True)
class CopyReport:
    tensors: int  # moved through the staging buffers
    bytes: int
    seconds: float
    threads: int
    pinned: bool

    def line(self, device: Any) -> str:
        rate = self.bytes / max(self.seconds, 1e-9) / 1e9
        how = "pinned staging" if self.pinned else "staging"
        return (
            f"base model to {device}: {self.bytes / 1e9:.1f} GB in {self.seconds:.1f} s ({rate:.1f} GB/s, "
            f"{how}, {self.threads} threads; train.staged_copy)"
        )


def moves_whole_model(accelerator: Any) -> bool:
    """Whether accelerate's prepare would move the whole model to a CUDA device: one device per process (no FSDP,
    DeepSpeed or XLA wrapping of its own), device placement on."""
    device = getattr(accelerator, "device", None)
    kind = str(getattr(getattr(accelerator, "distributed_type", None), "value", "NO"))
    return (
        getattr(device, "type", str(device)) == "cuda"
        and bool(getattr(accelerator, "device_placement", True))
        and kind in ("NO", "MULTI_GPU")
    )


def attached_modules(model: Any) -> list[Any]:
    """Modules whose forward replaced one of `model`'s own and that are not among its children: sd-scripts' LoRA
    (`org_module.forward = lora.forward`, the LoRA kept in its network), each once."""
    found: dict[int, Any] = {}
    for m in model.modules():
        owner = getattr(m.__dict__.get("forward"), "__self__", None)
        if owner is not None and owner is not m and callable(getattr(owner, "parameters", None)):
            found.setdefault(id(owner), owner)
    return list(found.values())


def host_bytes(module: Any) -> int:
    """Bytes of the module's tensors still on the host (what a move to the device adds there)."""
    return sum(t.nbytes for t in module_tensors(module) if t.device.type == "cpu")


def module_tensors(module: Any) -> list[Any]:
    """The module's parameters and buffers, each tensor once (a shared one is reached through several modules)."""
    seen: dict[int, Any] = {}
    for t in [*module.parameters(), *module.buffers()]:
        seen.setdefault(id(t), t)
    return list(seen.values())


def pieces(tensors: list[Any], targets: dict[int, Any], chunk: int) -> list[tuple[Any, Any]]:
    """(source, destination) byte slices of at most `chunk` bytes, largest tensors first, so that the threads
    finish together."""
    out = []
    for t in sorted(tensors, key=lambda t: -t.nbytes):
        dst = targets.get(id(t))
        if dst is None:
            continue
        src_b, dst_b = _bytes(t.detach()), _bytes(dst)
        out += [(src_b[i : i + chunk], dst_b[i : i + chunk]) for i in range(0, src_b.numel(), chunk)]
    return out


def _bytes(t: Any) -> Any:
    import torch

    return t.reshape(-1).view(torch.uint8)


def staged_copy(module: Any, device: Any, *, threads: int, chunk: int = CHUNK_BYTES) -> CopyReport | None:
    """Move `module` to `device` (as `module.to(device)` does) through staging buffers on `threads` threads.
    Tensors already there, small or non-contiguous ones go the plain way. None when nothing is on the host."""
    import torch

    device = torch.device(device)
    started = time.perf_counter()
    movable = [
        t
        for t in module_tensors(module)
        if t.device.type == "cpu" and t.is_contiguous() and t.nbytes >= MIN_TENSOR_BYTES
    ]
    if not movable:
        return None
    targets = {id(t): torch.empty_like(t, device=device) for t in movable}
    work = pieces(movable, targets, chunk)
    pinned = device.type == "cuda"
    threads = max(1, min(threads, MAX_THREADS, len(work)))
    jobs: queue.SimpleQueue = queue.SimpleQueue()
    for w in work:
        jobs.put(w)
    errors: list[BaseException] = []
    after = torch.cuda.current_stream(device) if pinned else None  # the targets' memory may be in use there until now
    workers = [
        threading.Thread(target=_worker, args=(jobs, device, chunk, after, errors), daemon=True) for _ in range(threads)
    ]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    if errors:
        raise errors[0]
    if pinned:  # the staging buffers, not kept page-locked for the rest of the run (where torch can say so)
        release = getattr(getattr(torch, "accelerator", None), "empty_host_cache", None)
        (release or getattr(torch._C, "_host_emptyCache", lambda: None))()
    module._apply(lambda t: targets[id(t)] if id(t) in targets else t.to(device))
    total = sum(t.nbytes for t in movable)
    return CopyReport(len(movable), total, time.perf_counter() - started, threads, pinned)


def _worker(jobs: queue.SimpleQueue, device: Any, chunk: int, after: Any, errors: list) -> None:
    """Take slices until none is left: host copy into a free staging buffer (the GIL is released while torch
    copies), then the device copy on this thread's stream (which first waits for `after`, the caller's stream),
    while the other buffer is filled. `after` None: no CUDA, plain copies."""
    import torch

    try:
        stream = None
        if after is not None:
            stream = torch.cuda.Stream(device)
            stream.wait_stream(after)
        buffers = [torch.empty(chunk, dtype=torch.uint8, pin_memory=after is not None) for _ in range(2)]
        in_flight: list[Any] = [None, None]
        n = 0
        while not errors:
            try:
                src, dst = jobs.get_nowait()
            except queue.Empty:
                break
            i = n % 2
            if in_flight[i] is not None:
                in_flight[i].synchronize()  # that buffer's last copy has left
            staging = buffers[i][: src.numel()]
            staging.copy_(src)
            if stream is None:
                dst.copy_(staging)
            else:
                with torch.cuda.stream(stream):
                    dst.copy_(staging, non_blocking=True)
                    in_flight[i] = torch.cuda.Event()
                    in_flight[i].record(stream)
            n += 1
        if stream is not None:
            stream.synchronize()
    except BaseException as e:  # reported by the caller, on its own thread
        errors.append(e)
