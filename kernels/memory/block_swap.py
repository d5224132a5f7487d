"""Block swap (`block_swap`): sd-scripts' `--blocks_to_swap` schedule with the copies done the way a copy engine
wants them. A drop-in for the model's two sd-scripts `ModelOffloader` objects (`offloader_double`,
`offloader_single`): the same interface sd-scripts' `Flux.forward` calls (`wait_for_block`, `submit_move_blocks`,
`prepare_block_devices_before_forward`, `set_forward_only`) and the same backward hooks per block, so the same block
leaves the card and the same block arrives at the same forward step or backward hook, and the card holds the
weights of N - S blocks of each list at any time, as with sd-scripts.

What changes is how a swap is done. sd-scripts (custom_offloading_utils.swap_weight_devices_cuda), per swap: waits
on the host for the whole compute stream, copies the outgoing block's weights to fresh pageable host tensors, copies
the incoming block's from pageable memory (~half the speed of page-locked), and waits on the host again, all in a
one-thread pool whose future the main thread waits on. Here:
  * every block weight that ever lives on the host has one page-locked copy, made once at install from what the
    weights are then (fp8 or bf16, dtype kept). The weights are frozen (LoRA training; install refuses trained
    ones), so "to the host" is pointing `module.weight.data` back at that copy: no copy at all;
  * "to the card" copies the page-locked copy into the card buffers the outgoing block gives up (sd-scripts reuses
    them the same way: within one list every block has the same weight shapes), on a side stream, non_blocking.
    The side stream waits for an event recorded on the compute stream when the move is asked for (after the
    outgoing block's last use was queued); the compute stream waits for the copy's event when sd-scripts waits for
    the block. The host never waits. The buffers are marked used by the side stream (record_stream), so the
    caching allocator cannot hand them out again before the copy ran even if a buffer is freed (after `remove`,
    sd-scripts' offloader may drop them), and the page-locked sources live as long as the offloader.
What is moved mirrors sd-scripts: the `.weight` of every submodule that has one (Linear layers, not the plain
LayerNorms, whose weight is None); biases, RMSNorm scales and buffers (fp8_matmul's row scales among them) go to the
card once, in `prepare_block_devices_before_forward`, and stay there.

Page-locked memory comes from PyTorch's host allocator, which rounds every allocation up to a power of two: one
allocation per weight would waste up to half (FLUX's 3072 x 21504 fp8 linear1: 63 MiB in a 128 MiB block). The copies
are packed into power-of-two slabs instead (pack), a few MiB lost in all.

The schedule (which block leaves, which arrives, at which step) is the pure functions below, checked against
sd-scripts' ModelOffloader in the tests; nothing here imports sd-scripts. Installed after sd-scripts enabled block
swap (load_target_model) and before its first `prepare_block_swap_before_forward` (flux-train installs kernels just
before accelerate's prepare); `remove` gives sd-scripts' offloaders and their hooks back.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from flux_kernels.runtime.errors import KernelError

ATTR = "_flux_block_swap"  # on the model: the Installed record
ALIGN = 512  # bytes: each host copy starts on this boundary in its slab
SLAB = 256 * 2**20  # bytes: host copies are packed into page-locked slabs of this size (a power of two)


# ---- the schedule: sd-scripts' ModelOffloader, as plain functions ---------------------------------------------


def forward_move(num_blocks: int, swap: int, block_idx: int, forward_only: bool) -> tuple[int, int] | None:
    """After block `block_idx` ran forward: (block to the host, block to the card), or None. With backward to come
    only the first `swap` blocks leave (the last ones stay for backward); forward-only, every block does, and the
    one arriving wraps around to the front for the next forward."""
    if not swap or (not forward_only and block_idx >= swap):
        return None
    return block_idx, (num_blocks - swap + block_idx) % num_blocks


def backward_step(num_blocks: int, swap: int, block_idx: int) -> tuple[tuple[int, int] | None, int | None]:
    """At block `block_idx`'s backward hook: (the move to start: (to the host, to the card), or None; the block to
    wait for before backward goes on, or None). The block after it (done with backward) leaves, and the front
    blocks that left in forward come back in reverse, one hook ahead of their backward."""
    propagated = num_blocks - block_idx - 1
    move = (num_blocks - propagated, swap - propagated) if 0 < propagated <= swap else None
    wait = block_idx - 1 if 0 < block_idx <= swap else None
    return move, wait


def host_blocks(num_blocks: int, swap: int, forward_only: bool = False) -> list[int]:
    """The blocks whose weights ever live on the host: the last `swap` (at the start) and the first `swap` (they
    leave in forward); forward-only, all of them."""
    if not swap:
        return []
    if forward_only:
        return list(range(num_blocks))
    return sorted(set(range(swap)) | set(range(num_blocks - swap, num_blocks)))


# ---- what is swapped, and the page-locked copies ----------------------------------------------------------------


def swap_slots(block: nn.Module) -> list[tuple[str, nn.Module]]:
    """The submodules whose `.weight` moves, in sd-scripts' order (named_modules, those with a weight not None)."""
    return [(name, m) for name, m in block.named_modules() if getattr(m, "weight", None) is not None]


def pack(sizes: Sequence[int], slab: int = SLAB, align: int = ALIGN) -> tuple[list[tuple[int, int]], list[int]]:
    """Place byte sizes in slabs, largest first, each into the first slab with room: ([(slab, offset)] per size,
    each slab's size). Slabs are `slab` bytes (or the next power of two of a larger size); the last one only the
    next power of two of what it holds, since the host allocator would round it up to that anyway."""
    cap = max([slab] + [1 << (s - 1).bit_length() for s in sizes if s])
    where: list[tuple[int, int]] = [(0, 0)] * len(sizes)
    used: list[int] = []
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        need = -(-sizes[i] // align) * align
        k = next((k for k, u in enumerate(used) if u + need <= cap), len(used))
        if k == len(used):
            used.append(0)
        where[i] = (k, used[k])
        used[k] += need
    slabs = [cap] * len(used)
    if used:
        slabs[-1] = 1 << (max(used[-1], 1) - 1).bit_length()
    return where, slabs


def host_copies(tensors: Sequence[Tensor], pin: bool) -> list[Tensor]:
    """One host copy of each tensor (same dtype and shape, contiguous), packed into page-locked slabs with `pin`."""
    sizes = [t.numel() * t.element_size() for t in tensors]
    where, slab_sizes = pack(sizes)
    slabs = [torch.empty(n, dtype=torch.uint8, pin_memory=pin) for n in slab_sizes]
    out = []
    for t, n, (k, off) in zip(tensors, sizes, where, strict=True):
        h = slabs[k][off : off + n].view(t.dtype).view(t.shape)
        h.copy_(t.detach())
        out.append(h)
    return out


# ---- the offloader ----------------------------------------------------------------------------------------------


class BlockSwapOffloader:
    """One list of blocks (double or single) swapped as sd-scripts' ModelOffloader schedules it. `device` is the
    card; a CPU `device` runs the same bookkeeping with plain synchronous copies (tests: where each block's weights
    are is then told by which tensor they point at)."""

    def __init__(
        self,
        blocks: Sequence[nn.Module],
        blocks_to_swap: int | None,
        device: torch.device,
        debug: bool = False,
        check: bool = True,
    ):
        self.blocks = list(blocks)
        self.num_blocks = len(self.blocks)
        self.blocks_to_swap = blocks_to_swap or 0
        self.device = torch.device(device)
        self.debug = debug
        self.supports_backward = True
        self.forward_only = False
        self.cuda = self.device.type == "cuda"
        self.slots = [swap_slots(b) for b in self.blocks]
        self.host: dict[int, list[Tensor]] = {}
        self.pending: dict[int, torch.cuda.Event] = {}  # block -> its copy's event on the side stream
        self.copy_stream = None
        self.handles: list = []
        self.moves = 0
        self.bytes_moved = 0
        self.time_copies = False  # benchmarks: each move's copies between two events on the side stream
        self._timed: list[tuple[torch.cuda.Event, torch.cuda.Event, int]] = []
        self.seconds_copying = 0.0  # host time spent making the page-locked copies
        problem = self.problem() if check else None
        if problem:
            raise KernelError(f"block_swap: {problem}")

    def problem(self) -> str | None:
        """Why this list cannot be swapped this way, or None."""
        if self.blocks_to_swap and self.blocks_to_swap > self.num_blocks - 2:
            return f"{self.blocks_to_swap} of {self.num_blocks} blocks to swap (at most {self.num_blocks - 2})"
        first = [(n, tuple(m.weight.shape), m.weight.dtype) for n, m in self.slots[0]] if self.slots else []
        for i, slots in enumerate(self.slots):
            if [(n, tuple(m.weight.shape), m.weight.dtype) for n, m in slots] != first:
                return f"block {i}'s weights differ from block 0's in name, shape or dtype (their buffers are shared)"
            for n, m in slots:
                if m.weight.requires_grad:
                    return f"block {i}'s {n}.weight is trained (the page-locked copies are of frozen weights)"
                if not m.weight.is_contiguous():
                    return f"block {i}'s {n}.weight is not contiguous"
        return None

    # ---- where the weights are

    def on_host(self, idx: int) -> bool:
        """Whether block `idx`'s weights are its page-locked copies (on the host)."""
        h = self.host.get(idx)
        return h is not None and all(
            m.weight.data_ptr() == t.data_ptr() for (_, m), t in zip(self.slots[idx], h, strict=True)
        )

    def on_device(self, idx: int) -> bool:
        """Whether block `idx`'s weights are card buffers (on a CPU `device`: any tensor but the host copies)."""
        ws = [m.weight for _, m in self.slots[idx]]
        here = all(w.device.type == self.device.type for w in ws)
        return here and not (self.host.get(idx) is not None and any(self._is_host(idx, j) for j in range(len(ws))))

    def _is_host(self, idx: int, j: int) -> bool:
        return self.slots[idx][j][1].weight.data_ptr() == self.host[idx][j].data_ptr()

    def weight_bytes(self) -> int:
        """Bytes of one block's swapped weights."""
        return sum(m.weight.numel() * m.weight.element_size() for _, m in self.slots[0]) if self.slots else 0

    def host_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for ts in self.host.values() for t in ts)

    # ---- install-time work

    def make_host_copies(self, indices: Sequence[int]) -> None:
        """The page-locked copies of these blocks' weights (those not made yet); the blocks whose weights are on the
        host now point at their copies at once (the pageable originals can go)."""
        todo = [i for i in indices if i not in self.host]
        if not todo:
            return
        start = time.perf_counter()
        flat = [m.weight.data for i in todo for _, m in self.slots[i]]
        if any(w.is_cuda for w in flat):
            torch.cuda.current_stream(self.device).synchronize()  # they may still be being written
        copies = host_copies(flat, pin=self.cuda)
        per = len(self.slots[0])
        for k, i in enumerate(todo):
            self.host[i] = copies[k * per : (k + 1) * per]
            if all(m.weight.device.type == "cpu" for _, m in self.slots[i]):
                self._point(i, self.host[i])
        self.seconds_copying += time.perf_counter() - start

    def register_hooks(self) -> None:
        for i, block in enumerate(self.blocks):
            hook = self._backward_hook(i)
            if hook is not None:
                self.handles.append(block.register_full_backward_hook(hook))

    def close(self) -> None:
        """Wait for every copy (the host too), and take the hooks out."""
        self._wait_all()
        if self.cuda and self.copy_stream is not None:
            self.copy_stream.synchronize()
        for h in self.handles:
            h.remove()
        self.handles = []

    # ---- sd-scripts' interface

    def set_forward_only(self, forward_only: bool) -> None:
        self._wait_all()
        self.forward_only = forward_only
        if forward_only:  # every block leaves in turn now
            self.make_host_copies(host_blocks(self.num_blocks, self.blocks_to_swap, True))

    def wait_for_block(self, block_idx: int) -> None:
        if self.blocks_to_swap:
            self._wait(block_idx)

    def submit_move_blocks(self, blocks, block_idx: int) -> None:
        move = forward_move(self.num_blocks, self.blocks_to_swap, block_idx, self.forward_only)
        if move is not None:
            self._move(*move)

    def prepare_block_devices_before_forward(self, blocks) -> None:
        """The start of a forward: the first N - S blocks on the card, the others on the host, everything that
        is not a swapped weight (biases, norm scales, buffers) on the card. Buffers freed by blocks that go to the
        host are given to the blocks that come back; copies go on the compute stream, after everything before.

        Each move hands the outgoing block's buffers to the block `keep` = N - S places after it (forward) or before
        it (backward), so block j always runs from the buffers block `j % keep` started with, as long as this
        hands them back the same way: after a forward without backward (a sample, a validation step) the blocks on
        the card are the last ones, and block i < keep gets the buffers of the block of its class (`j % keep == i`).
        Fixed addresses per block are what lets CUDA graphs replay over swapped blocks (see
        flux_kernels.runtime.policy); sd-scripts hands them back in reverse."""
        if not self.blocks_to_swap:
            return
        self._wait_all()
        swapped = {id(m.weight) for i in self.host for _, m in self.slots[i]}
        for b in self.blocks:  # what sd-scripts' block.to(device) moves, less the swapped weights
            b._apply(lambda t: t.data if id(t) in swapped else t.to(self.device))
        keep = self.num_blocks - self.blocks_to_swap
        free: dict[int, list[list[Tensor]]] = {}  # buffer class (block index % keep) -> buffers given up
        for i in sorted(self.host):
            self._check_copies(i)
            if i >= keep and not self.on_host(i):
                if self.on_device(i):
                    free.setdefault(i % keep, []).append([m.weight.data for _, m in self.slots[i]])
                self._point(i, self.host[i])
        for i in sorted(self.host):
            if i < keep and not self.on_device(i):
                mine = free.get(i) or next((v for v in free.values() if v), None)
                bufs = mine.pop() if mine else [torch.empty_like(h, device=self.device) for h in self.host[i]]
                for buf, h in zip(bufs, self.host[i], strict=True):
                    buf.copy_(h, non_blocking=self.cuda)
                self._point(i, bufs)

    # ---- the moves

    def _point(self, idx: int, tensors: Sequence[Tensor]) -> None:
        for (_, m), t in zip(self.slots[idx], tensors, strict=True):
            m.weight.data = t

    def _check_copies(self, idx: int) -> None:
        for (n, m), h in zip(self.slots[idx], self.host[idx], strict=True):
            if m.weight.shape != h.shape or m.weight.dtype != h.dtype:
                raise KernelError(
                    f"block_swap: block {idx}'s {n}.weight is now {m.weight.dtype} {tuple(m.weight.shape)}, its "
                    f"page-locked copy {h.dtype} {tuple(h.shape)}: the weights were replaced after install "
                    "(install block_swap after the kernels that change them)"
                )

    def _move(self, to_host: int, to_device: int) -> None:
        if not self.on_device(to_host) or not self.on_host(to_device):
            raise RuntimeError(
                f"block_swap: block {to_host} should be on {self.device} and block {to_device} on the host before "
                "swapping them (sd-scripts' prepare_block_swap_before_forward must run before each forward)"
            )
        if self.debug:
            print(f"block_swap: block {to_host} to the host, block {to_device} to {self.device}")
        bufs = [m.weight.data for _, m in self.slots[to_host]]
        self._point(to_host, self.host[to_host])
        src = self.host[to_device]
        if self.cuda:
            if self.copy_stream is None:
                self.copy_stream = torch.cuda.Stream(device=self.device)
            used = torch.cuda.Event()
            used.record(torch.cuda.current_stream(self.device))  # after the outgoing block's last queued use
            self.copy_stream.wait_event(used)
            start = torch.cuda.Event(enable_timing=True) if self.time_copies else None
            if start is not None:
                start.record(self.copy_stream)
            with torch.cuda.stream(self.copy_stream):
                for buf, h in zip(bufs, src, strict=True):
                    buf.copy_(h, non_blocking=True)
                    buf.record_stream(self.copy_stream)
            done = torch.cuda.Event(enable_timing=start is not None)
            done.record(self.copy_stream)
            if start is not None:
                self._timed.append((start, done, sum(t.numel() * t.element_size() for t in src)))
            self.pending[to_device] = done
        else:
            for buf, h in zip(bufs, src, strict=True):
                buf.copy_(h)
        self._point(to_device, bufs)
        self.moves += 1
        self.bytes_moved += sum(t.numel() * t.element_size() for t in src)

    def copy_stats(self) -> tuple[int, float]:
        """(bytes, seconds) the side stream spent copying since the last call, with `time_copies` (waits for them)."""
        if self._timed:
            self._timed[-1][1].synchronize()
        done = sum(n for _, _, n in self._timed), sum(a.elapsed_time(b) for a, b, _ in self._timed) / 1e3
        self._timed = []
        return done

    def _wait(self, block_idx: int) -> None:
        done = self.pending.pop(block_idx, None)
        if done is not None:
            torch.cuda.current_stream(self.device).wait_event(done)

    def _wait_all(self) -> None:
        for idx in list(self.pending):
            self._wait(idx)

    def _backward_hook(self, block_idx: int):
        move, wait = backward_step(self.num_blocks, self.blocks_to_swap, block_idx)
        if move is None and wait is None:
            return None

        def hook(module, grad_input, grad_output):
            if move is not None:
                self._move(*move)
            if wait is not None:
                self._wait(wait)
            return None

        return hook


# ---- install / remove -------------------------------------------------------------------------------------------


@dataclass
class Installed:
    """What install replaced, to give it back."""

    sd_double: object
    sd_single: object
    double: BlockSwapOffloader
    single: BlockSwapOffloader


def installed_on(model: nn.Module) -> Installed | None:
    return model.__dict__.get(ATTR)


def _sd_offloader_problem(off: object, blocks: Sequence[nn.Module]) -> str | None:
    needed = ("num_blocks", "blocks_to_swap", "device", "create_backward_hook", "remove_handles", "set_forward_only")
    missing = [a for a in needed if not hasattr(off, a)]
    if missing:
        return f"{type(off).__name__} is not sd-scripts' ModelOffloader (no {', '.join(missing)})"
    if off.num_blocks != len(blocks):
        return f"its offloader has {off.num_blocks} blocks, the model {len(blocks)}"
    return None


def refusal(model: nn.Module, cpu_for_tests: bool = False) -> str | None:
    """Why block_swap cannot replace this model's offloaders, or None; changes nothing (auto asks before install)."""
    if installed_on(model) is not None:
        return "already installed on this model"
    if not getattr(model, "blocks_to_swap", None):
        return "the model does not swap blocks (memory.blocks_to_swap=0)"
    lists = (getattr(model, "double_blocks", None), getattr(model, "single_blocks", None))
    olds = (getattr(model, "offloader_double", None), getattr(model, "offloader_single", None))
    if any(b is None for b in lists) or any(o is None for o in olds):
        return "the model has no double_blocks/single_blocks with sd-scripts' offloaders"
    for old, blocks in zip(olds, lists, strict=True):
        problem = _sd_offloader_problem(old, blocks)
        if problem:
            return problem
    device = torch.device(olds[0].device)
    if device.type != "cuda" and not cpu_for_tests:
        return f"needs a CUDA device (sd-scripts swaps to {device})"
    for old, blocks in zip(olds, lists, strict=True):
        problem = BlockSwapOffloader(blocks, old.blocks_to_swap, device, check=False).problem()
        if problem:
            return problem
    return None


def install(model: nn.Module, cpu_for_tests: bool = False, **_) -> str:
    """Replace sd-scripts' two offloaders on `model` (after `enable_block_swap`, before the first forward) with
    BlockSwapOffloaders of the same schedule, their backward hooks for sd-scripts'. Everything is checked before
    anything changes; KernelError says why it cannot apply. `cpu_for_tests`: allow a CPU device (no streams)."""
    why = refusal(model, cpu_for_tests)
    if why:
        raise KernelError(f"block_swap: {why}")
    olds = (model.offloader_double, model.offloader_single)
    lists = (model.double_blocks, model.single_blocks)
    device = torch.device(olds[0].device)
    news = [BlockSwapOffloader(blocks, old.blocks_to_swap, device) for old, blocks in zip(olds, lists, strict=True)]
    for old, new in zip(olds, news, strict=True):
        old.set_forward_only(old.forward_only)  # waits for its transfers in flight, if any
        new.forward_only = old.forward_only
    try:
        for new in news:
            new.make_host_copies(host_blocks(new.num_blocks, new.blocks_to_swap, new.forward_only))
    except RuntimeError as e:  # page-locked memory refused: the weights that moved to copies are the same values
        raise KernelError(
            f"block_swap: the page-locked host copies failed ({str(e).splitlines()[0][:200]}); "
            "kernels.set='auto,-block_swap' keeps sd-scripts' own swap"
        ) from e
    for old, new in zip(olds, news, strict=True):
        for h in old.remove_handles:
            h.remove()
        old.remove_handles = []
        new.register_hooks()
    model.offloader_double, model.offloader_single = news
    model.__dict__[ATTR] = Installed(olds[0], olds[1], news[0], news[1])
    d, s = news
    gib = (d.host_bytes() + s.host_bytes()) / 2**30
    return (
        f"block_swap: {d.blocks_to_swap} of {d.num_blocks} double and {s.blocks_to_swap} of {s.num_blocks} single "
        f"blocks swapped by copies from page-locked host memory on a side stream ({gib:.2f} GiB page-locked, made in "
        f"{d.seconds_copying + s.seconds_copying:.1f} s), no host waits; sd-scripts' schedule"
    )


def remove(model: nn.Module) -> bool:
    """Give sd-scripts' offloaders back, with their backward hooks registered again. The weights stay where they
    are (sd-scripts' swap copies from whatever host tensor a block points at)."""
    state = model.__dict__.pop(ATTR, None)
    if state is None:
        return False
    for new, old in ((state.double, state.sd_double), (state.single, state.sd_single)):
        new.close()
        handles = []
        for i, block in enumerate(new.blocks):
            hook = old.create_backward_hook(new.blocks, i)
            if hook is not None:
                handles.append(block.register_full_backward_hook(hook))
        old.remove_handles = handles
        old.forward_only = new.forward_only
    model.offloader_double, model.offloader_single = state.sd_double, state.sd_single
    return True


# ---- the registry's check ---------------------------------------------------------------------------------------


class _TinyBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, 2 * width)
        self.norm = nn.LayerNorm(2 * width, elementwise_affine=False)
        self.down = nn.Linear(2 * width, width)

    def _forward(self, x: Tensor) -> Tensor:
        return x + self.down(torch.nn.functional.gelu(self.norm(self.up(x))))

    def forward(self, x: Tensor) -> Tensor:
        return torch.utils.checkpoint.checkpoint(self._forward, x, use_reentrant=False)


def run_blocks(blocks: Sequence[nn.Module], offloader, x: Tensor) -> Tensor:
    """sd-scripts' swapped loop (Flux.forward): wait for a block, run it, submit its move."""
    for i, block in enumerate(blocks):
        offloader.wait_for_block(i)
        x = block(x)
        offloader.submit_move_blocks(blocks, i)
    return x


def self_check(device) -> tuple[bool, str]:
    """Six small checkpointed blocks, four swapped, two forward+backward passes through BlockSwapOffloader against
    the same blocks left on the card: outputs and input gradients bit for bit."""
    device = torch.device(device)
    gen = torch.Generator().manual_seed(0)
    blocks = nn.ModuleList(_TinyBlock(64) for _ in range(6)).requires_grad_(False)
    for p in blocks.parameters():
        p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    x = torch.randn(3, 5, 64, generator=gen)
    gy = torch.randn(3, 5, 64, generator=gen)

    def step(offloader) -> list[Tensor]:
        xi = x.to(device).requires_grad_()
        y = run_blocks(blocks, offloader, xi) if offloader else nn.Sequential(*blocks)(xi)
        (gx,) = torch.autograd.grad(y, xi, gy.to(device))
        return [y.detach(), gx]

    blocks.to(device)
    want = step(None)
    off = BlockSwapOffloader(blocks, 4, device)
    off.make_host_copies(host_blocks(6, 4))
    off.register_hooks()
    got = []
    for _ in range(2):
        off.prepare_block_devices_before_forward(blocks)
        got.append(step(off))
    resident = sum(off.on_device(i) for i in range(6))
    off.close()
    for k, g in enumerate(got):
        if not all(torch.equal(a, b) for a, b in zip(g, want, strict=True)):
            return False, f"pass {k + 1}: outputs or input gradients differ from the blocks left on the card"
    if resident != 2:
        return False, f"{resident} blocks on the card after backward, not 2"
    return True, "matches the blocks left on the card bit for bit (2 passes, 4 of 6 blocks swapped)"
