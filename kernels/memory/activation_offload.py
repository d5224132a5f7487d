"""Activation offload (`activation_offload`): what a checkpointed FLUX block keeps for its backward waits in
page-locked host memory instead of on the GPU, and comes back just before that block's backward needs it.

A checkpointed block keeps its inputs (to run its forward again) and, with `selective_checkpoint`, its attention
and wide-input matmul outputs (~54 MiB per block at 1024²). All of it is alive at once at the turn from forward to
backward, which is where a checkpointed step peaks: 57 blocks' worth, ~1.5 GiB of inputs and ~3 GiB of selective
outputs at 1024². Offloaded, that memory is free on the card, so selective checkpointing costs no GPU memory.

How: the compiled block (`compile_blocks`) is one autograd function whose saved tensors pass through
torch.autograd.graph.saved_tensors_hooks; `install` calls each checkpointed block inside this module's hooks.
  * forward: each saved tensor of at least MIN_BYTES that is not one of the model's parameters or buffers (the
    frozen weights stay where they are) is noted; when the block call returns, the noted tensors are copied into
    page-locked host buffers on a side stream, after the work that produced them. The caching allocator is told
    (record_stream) not to reuse their memory before the copies are done, and the GPU tensors are dropped.
    With CUDA graphs (`graphs=True`) that is not enough: the blocks' outputs live in the graphs' own memory pool,
    which a later block's replay writes without asking the allocator. There the GPU tensors are held for HOLD more
    block calls, then the compute stream waits for their copies and they are dropped: a replay can reuse their
    memory only after the copies, and which tensors are alive at each replay is the same every step (as the
    graphs' recording expects). Their backward graphs also take what the blocks saved at fixed addresses (a new
    address means a new recording, ~5 s a step at full size on the H200), so the reloads there land in RING sets
    of GPU buffers, one per group in turn, kept for the run.
  * backward: the first access to a block's tensors starts their copies back on a second stream (after that
    block's copies to the host), unless already started, makes the compute stream wait for them, and starts the
    copies of the block before it (the next one backward reaches), so a block's reload overlaps the backward of
    the block after it.
Host buffers are kept in a pool by shape, stride and dtype and reused every step (the log says how much host memory
they hold); a buffer's next copy to the host waits on the GPU for its last reload. The copies are bit-exact:
nothing changes numerically.

Not offloaded: tensors under MIN_BYTES (modulation vectors, RoPE tables, LoRA down-projections, the attention's
log-sum-exp: little memory, and each copy has a fixed cost), views with gaps (unless VIEWS_ENV is "1"), the last
KEEP_LAST checkpointed blocks' tensors (backward needs them first, while the copies of the forward's last blocks are
still queued: on the H200 the copies each way run at ~55 GB/s, 4.6 GiB a step at 1024² takes ~90 ms, about a forward's
time; with CUDA graphs the copies cannot queue up, since the compute stream waits for them HOLD blocks later, and the
CPU launches nothing per copy, so there MIN_BYTES_GRAPHS and KEEP_LAST_GRAPHS apply), and blocks that are not
checkpointed (their activations are ~10x larger: the copies would take longer than the recompute they replace). Needs
`compile_blocks` (under sd-scripts' eager checkpointing the kept tensors never pass through saved-tensor hooks).
Nothing here imports sd-scripts.
"""

from __future__ import annotations

import contextlib
import os
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

ATTR = "_flux_activation_offload"  # on a block: the Offloader its checkpointed calls go through
MIN_BYTES = 4 * 2**20  # smaller saved tensors stay on the GPU
# with CUDA graphs the copies cost the CPU nothing per step, so the double blocks' 3 MiB text-stream tensors go too
# (H200, fp8 tier: card peak 17.0 against 17.2 GiB with 4 MiB, 0.394 s/step both)
MIN_BYTES_GRAPHS = 2**20
# the last checkpointed blocks in forward order keep their tensors on the GPU: backward needs them first, while the
# copies to the host still queue behind the forward (H200, fp8 tier: 1 kept 0.566 s/step, 8 kept 0.486)
KEEP_LAST = 8
# with CUDA graphs the compute stream waits for each group's copies HOLD block calls later, so they never queue up:
# keeping blocks bought nothing there (H200, fp8 tier: 0.389 s/step with 8, 2 or 0 kept; card peak 17.8 / 17.4 / 17.2)
KEEP_LAST_GRAPHS = 0
KEEP_LAST_ENV = "FLUX_KERNELS_OFFLOAD_KEEP_LAST"  # another count, for measuring the trade
MIN_BYTES_ENV = "FLUX_KERNELS_OFFLOAD_MIN_MIB"  # another threshold (MiB), likewise
# "1": views with gaps go too (their elements, packed on the host; back into a buffer of their strides), as the
# install's `views` asks (flux-train no longer sets it: measured to buy nothing); "0" keeps them on the card. Off by
# default: such a view keeps its whole storage on the card (lora_fold's blocks save views of its concatenated input:
# ~27 MiB a single block), but taking them adds to the host link's traffic, which measured faster left alone
VIEWS_ENV = "FLUX_KERNELS_OFFLOAD_VIEWS"
# with CUDA graphs: block calls an offloaded group's GPU tensors outlive it, so their copies (~1.5 ms a block on the
# H200) run beside the next blocks' compute before the compute stream waits for them
HOLD = 2
# with CUDA graphs: sets of reload buffers, used by the groups in turn. Two suffice: a group's reload starts when
# backward reaches the group after it, after the compute stream's work so far, which includes the backward of the
# group that used the same set before
RING = 2


@dataclass(eq=False)
class Group:
    """One block call's offloaded tensors, in the order they were saved."""

    device: torch.device
    prev: Callable[[], Group | None]  # the group saved before this one in the same forward (a weak reference)
    index: int = 0  # its place in the forward's groups
    pending: list[Tensor] = field(default_factory=list)  # saved during the call, copied out when it returns
    layout: list[tuple] = field(default_factory=list)  # (shape, stride) of each offloaded tensor, as it comes back
    gpu: list[Tensor] = field(default_factory=list)  # with CUDA graphs: the copied GPU tensors, until released
    host: list[Tensor] = field(default_factory=list)
    back: list[Tensor] = field(default_factory=list)  # the reloaded GPU tensors, once the reload started
    saved: Any = None  # the offload stream's event after this group's copies to the host
    ready: Any = None  # the reload stream's event after the copies back
    loading: bool = False


@dataclass(eq=False)
class Packed:
    group: Group
    slot: int


class Offloader:
    """The saved-tensor hooks of one model's checkpointed blocks (see the module docstring)."""

    def __init__(self, model: nn.Module | None = None, min_bytes: int = MIN_BYTES, hold: int = 0, views: bool = False):
        self.model = weakref.ref(model) if model is not None else (lambda: None)
        self.min_bytes = min_bytes
        self.views = views  # views with gaps go too (VIEWS_ENV)
        self.hold = hold  # > 0 (CUDA graphs): copied GPU tensors live this many more block calls (see above)
        self._held: deque[Group] = deque()  # groups whose GPU tensors are held, oldest first
        # host buffers free for reuse, by (shape, stride, dtype), each with the event after which its last reload
        # had read it (None on the CPU)
        self.pool: dict[tuple, list[tuple[Tensor, Any]]] = {}
        self.host_bytes = 0  # page-locked host memory the pool holds (in use or free)
        self.step_bytes = 0  # offloaded since the last forward began
        self.step_tensors = 0
        self._streams: dict[torch.device, tuple[Any, Any]] = {}  # (to the host, back to the GPU)
        self._last: Callable[[], Group | None] = lambda: None
        self._unpacked = True  # an unpack happened since the last group: the next group starts a new forward
        self._frozen: set[int] = set()
        self._frozen_from: list[tuple[Tensor, int]] = []  # a few weights and where they were: moved means recount
        self.blocks: list[nn.Module] = []  # the model's blocks in forward order (install sets them)
        self.keep_last = 0
        self.kept: set[int] = set()  # ids of the blocks whose tensors stay on the GPU this forward
        self._groups = 0  # groups so far this forward
        self._ring: dict[tuple, Tensor] = {}  # CUDA graphs: the reload buffers, by (set, slot, shape, stride, dtype)

    # ---- the context a block call runs in --------------------------------------------------------------------------

    def block_call(self) -> None:
        """A training block call (offloaded or not): the first after a backward starts a new forward."""
        self._release(keep=self.hold)
        if self._unpacked:
            self._unpacked = False
            self.step_bytes = self.step_tensors = self._groups = 0
            self._last = lambda: None
            checkpointed = [b for b in self.blocks if getattr(b, "gradient_checkpointing", False)]
            self.kept = {id(b) for b in checkpointed[-self.keep_last :]} if self.keep_last else set()
            # the weights may have moved since the last forward (sd-scripts moves the model after install)
            if not self._frozen_from or any(t.untyped_storage().data_ptr() != p for t, p in self._frozen_from):
                self._frozen = self._frozen_storages()

    @contextlib.contextmanager
    def group(self, device: torch.device) -> Iterator[None]:
        """Tensors saved inside are offloaded as one group (one block call), copied out when the call returns."""
        self.block_call()
        g = Group(torch.device(device), prev=self._last, index=self._groups)
        self._groups += 1
        self._last = weakref.ref(g)
        try:
            with torch.autograd.graph.saved_tensors_hooks(lambda t: self.pack(g, t), self.unpack):
                yield
        finally:
            self._offload(g)

    def _frozen_storages(self) -> set[int]:
        model = self.model()
        if model is None:
            return set()
        tensors = [t for t in (*model.parameters(), *model.buffers()) if t.device.type != "meta"]
        samples = tensors[:1] + tensors[len(tensors) // 2 : len(tensors) // 2 + 1] + tensors[-1:]
        self._frozen_from = [(t, t.untyped_storage().data_ptr()) for t in samples]
        return {t.untyped_storage().data_ptr() for t in tensors}

    def offloads(self, t: Tensor) -> bool:
        """Whether a saved tensor goes to the host."""
        return (
            t.layout == torch.strided
            and t.numel() * t.element_size() >= self.min_bytes
            and not isinstance(t, nn.Parameter)
            and t.untyped_storage().data_ptr() not in self._frozen
            and (dense(t) or (self.views and not overlapping(t)))
        )

    # ---- the hooks -------------------------------------------------------------------------------------------------

    def pack(self, g: Group, t: Tensor) -> Tensor | Packed:
        if not self.offloads(t):
            return t
        g.pending.append(t)
        return Packed(g, len(g.pending) - 1)

    def unpack(self, packed: Tensor | Packed) -> Tensor:
        self._unpacked = True
        self._release(keep=0)
        if isinstance(packed, Tensor):
            return packed
        g = packed.group
        if not g.loading:
            self._reload(g)
        if g.ready is not None:
            torch.cuda.current_stream(g.device).wait_event(g.ready)
            g.ready = None  # waited for: the group's other tensors need no second wait
        if (prev := g.prev()) is not None and not prev.loading:
            self._reload(prev)  # the block backward reaches next
        return g.back[packed.slot]  # freed with the group, when autograd lets go of the block's saved tensors

    # ---- the copies --------------------------------------------------------------------------------------------------

    def _offload(self, g: Group) -> None:
        """The group's saved tensors to host buffers, after the work that made them; their GPU memory is free for
        the allocator once the copies are done."""
        pending, g.pending = g.pending, []
        if not pending:
            return
        g.layout = [(tuple(t.shape), t.stride()) for t in pending]
        streams = self._streams_of(g.device)
        if streams is None:
            g.host = [self._host_buffer(t)[0] for t in pending]
            for h, t in zip(g.host, pending, strict=True):
                h.copy_(t)
        else:
            out = streams[0]
            out.wait_stream(torch.cuda.current_stream(g.device))
            with torch.cuda.stream(out):
                for t in pending:
                    h, read = self._host_buffer(t)
                    if read is not None:
                        out.wait_event(read)  # last step's reload of this buffer is done
                    h.copy_(t, non_blocking=True)
                    if not self.hold:
                        t.record_stream(out)  # the allocator waits for the copy before reusing t's memory
                    g.host.append(h)
                g.saved = torch.cuda.Event()
                g.saved.record(out)
            if self.hold:
                g.gpu = pending
                self._held.append(g)
        self.step_bytes += sum(t.numel() * t.element_size() for t in pending)
        self.step_tensors += len(pending)

    def _release(self, keep: int) -> None:
        """Drop the held GPU tensors of all but the `keep` newest groups, once the compute stream waits for their
        copies to the host (CUDA graphs: nothing replayed after this point can overwrite them mid-copy)."""
        while len(self._held) > keep:
            g = self._held.popleft()
            torch.cuda.current_stream(g.device).wait_event(g.saved)
            g.gpu = []

    def _reload(self, g: Group) -> None:
        g.loading = True
        streams = self._streams_of(g.device)
        if streams is None:
            g.back = [
                torch.empty_strided(shape, stride, dtype=h.dtype, device=g.device).copy_(h)
                for h, (shape, stride) in zip(g.host, g.layout, strict=True)
            ]
            read = None
        else:
            back = streams[1]
            compute = torch.cuda.current_stream(g.device)
            if self.hold:
                g.back = [self._ring_buffer(g, slot, h, *g.layout[slot]) for slot, h in enumerate(g.host)]
            else:
                g.back = [
                    torch.empty_strided(shape, stride, dtype=h.dtype, device=g.device)
                    for h, (shape, stride) in zip(g.host, g.layout, strict=True)
                ]
            back.wait_stream(compute)  # the new tensors' memory may still be in use by earlier compute work
            if g.saved is not None:
                back.wait_event(g.saved)  # the copies to the host are done
            with torch.cuda.stream(back):
                for dst, h in zip(g.back, g.host, strict=True):
                    dst.copy_(h, non_blocking=True)
                g.ready = read = torch.cuda.Event()
                g.ready.record(back)
            if not self.hold:
                for dst in g.back:
                    dst.record_stream(back)  # written there: not reused before the copy, even if never read
        for h in g.host:  # free for the next step's copies, which wait for `read` first
            self.pool.setdefault(_key(h), []).append((h, read))
        g.host = []

    def _ring_buffer(self, g: Group, slot: int, host: Tensor, shape: tuple, stride: tuple) -> Tensor:
        """The GPU buffer a group's slot reloads into under CUDA graphs: the same one every step."""
        key = (g.index % RING, slot, shape, stride, host.dtype)
        if key not in self._ring:
            self._ring[key] = torch.empty_strided(shape, stride, dtype=host.dtype, device=g.device)
        return self._ring[key]

    def _host_buffer(self, t: Tensor) -> tuple[Tensor, Any]:
        """A free host buffer for t: its strides where t is dense, else packed (a view's elements, not its gaps)."""
        stride = t.stride() if dense(t) else torch.empty(t.shape, device="meta").stride()
        free = self.pool.get((tuple(t.shape), stride, t.dtype))
        if free:
            return free.pop()
        pin = t.device.type == "cuda"
        buf = torch.empty_strided(t.shape, stride, dtype=t.dtype, device="cpu", pin_memory=pin)
        self.host_bytes += buf.untyped_storage().nbytes()
        return buf, None

    def _streams_of(self, device: torch.device):
        if device.type != "cuda":
            return None
        if device not in self._streams:
            self._streams[device] = (torch.cuda.Stream(device), torch.cuda.Stream(device))
        return self._streams[device]


def dense(t: Tensor) -> bool:
    """Whether t's elements fill its storage span exactly once in some order of its dimensions (a permutation of
    a contiguous tensor): it then copies as one block and comes back with the same strides."""
    expected = 1
    for stride, size in sorted((st, s) for s, st in zip(t.shape, t.stride(), strict=True) if s != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def overlapping(t: Tensor) -> bool:
    """Whether two of t's elements may share memory (a broadcast or other overlapping view); a view with gaps
    between its elements is not overlapping."""
    reach = 0  # the largest offset the dimensions so far reach
    for stride, size in sorted((st, s) for s, st in zip(t.shape, t.stride(), strict=True) if s != 1):
        if stride <= reach:
            return True
        reach += stride * (size - 1)
    return False


def _key(t: Tensor) -> tuple:
    return tuple(t.shape), t.stride(), t.dtype


# ---- install into the FLUX model ------------------------------------------------------------------------------------


def _blocks(model: nn.Module) -> list[nn.Module]:
    from flux_kernels.patches.blocks import find_blocks

    double, single = find_blocks(model)
    return double + single


def _wrap(block: nn.Module, offloader: Offloader) -> None:
    """Call the compiled block inside the offloader's hooks when it is checkpointed and training."""
    compiled = block._compiled_call_impl

    def call(*args, **kwargs):
        if not (torch.is_grad_enabled() and block.training):
            return compiled(*args, **kwargs)
        offloader.block_call()
        if not getattr(block, "gradient_checkpointing", False):
            return compiled(*args, **kwargs)
        if id(block) in offloader.kept:
            return compiled(*args, **kwargs)
        device = next((a.device for a in (*args, *kwargs.values()) if isinstance(a, Tensor)), None)
        if device is None:
            return compiled(*args, **kwargs)
        with offloader.group(device):
            return compiled(*args, **kwargs)

    block._compiled_call_impl = call


def install(
    model: nn.Module,
    min_bytes: int | None = None,
    keep_last: int | None = None,
    graphs: bool = False,
    views: bool = False,
    **_,
) -> str:
    """Route the compiled blocks' checkpointed calls through one Offloader (`graphs`: the compiled blocks replay
    from CUDA graphs). Raises KernelError without compiled blocks, and with block swap or CPU-offloaded
    checkpointing (which move the blocks' tensors themselves)."""
    from flux_kernels.runtime.errors import KernelError

    if getattr(model, "blocks_to_swap", None) or getattr(model, "cpu_offload_checkpointing", False):
        raise KernelError(
            "activation_offload: block swap / CPU-offloaded checkpointing already move the blocks' tensors "
            "(use one of them, not both)"
        )
    blocks = _blocks(model)
    if not blocks or any(getattr(b, "_compiled_call_impl", None) is None for b in blocks):
        raise KernelError(
            "activation_offload: needs compile_blocks (a compiled block saves its tensors through saved-tensor "
            "hooks; sd-scripts' eager checkpointing does not); add compile_blocks or drop activation_offload"
        )
    if keep_last is None:
        keep_last = KEEP_LAST_GRAPHS if graphs else KEEP_LAST
    if min_bytes is None:
        min_bytes = MIN_BYTES_GRAPHS if graphs else MIN_BYTES
    keep_last = int(os.environ.get(KEEP_LAST_ENV, keep_last))
    min_bytes = int(float(os.environ.get(MIN_BYTES_ENV, min_bytes / 2**20)) * 2**20)
    asked = os.environ.get(VIEWS_ENV, "").strip()  # set and not empty: wins over `views`, as the other two
    views = asked == "1" if asked else views
    offloader = Offloader(model, min_bytes=min_bytes, hold=HOLD if graphs else 0, views=views)
    model.__dict__[ATTR] = offloader
    offloader.blocks, offloader.keep_last = blocks, keep_last
    for b in blocks:
        _wrap(b, offloader)
        b.__dict__[ATTR] = offloader
    return (
        f"activation_offload: {len(blocks)} blocks' saved tensors of >= {min_bytes / 2**20:g} MiB to page-locked "
        f"host memory when checkpointed (not the last {keep_last}), reloaded one block ahead in backward"
        + (f"; CUDA graphs: each block's tensors held {HOLD} block calls, until copied" if graphs else "")
        + ("; views with gaps too" if views else "")
    )


def offloader_of(model: nn.Module) -> Offloader | None:
    return model.__dict__.get(ATTR)


def remove(model: nn.Module) -> bool:
    """Forget the offloader (compile_blocks.remove drops the wrapped compiled calls)."""
    found = model.__dict__.pop(ATTR, None) is not None
    for b in model.modules():
        b.__dict__.pop(ATTR, None)
    return found


# ---- the registry probe's pair ---------------------------------------------------------------------------------------


def _region(x: Tensor, w_up: Tensor, w_down: Tensor) -> Tensor:
    h = torch.nn.functional.gelu(x @ w_up.t())
    return x + torch.nn.functional.layer_norm(h @ w_down.t(), (x.shape[-1],))


def reference_region(x: Tensor, w_up: Tensor, w_down: Tensor) -> Tensor:
    """Two blocks' worth of work with their saved tensors left where they are."""
    return _region(_region(x, w_up, w_down), w_up, w_down)


def offloaded_region(x: Tensor, w_up: Tensor, w_down: Tensor) -> Tensor:
    """The same, every saved tensor (threshold 0) through host memory, one group per call: the copies, the
    streams, the reload order and the prefetch of the earlier group on this device."""
    offloader = Offloader(min_bytes=0)
    with offloader.group(x.device):
        y = _region(x, w_up, w_down)
    with offloader.group(x.device):
        return _region(y, w_up, w_down)
