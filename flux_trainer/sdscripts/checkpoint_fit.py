"""Gradient checkpointing only where the card needs it (`memory.checkpoint_skip`).

sd-scripts checkpoints either every FLUX block or none: every block's forward runs twice a step (~a third more
work), even on a card with room to keep many blocks' activations. Each sd-scripts block decides at its call, from
its own `gradient_checkpointing` flag, whether to run under `checkpoint(...)`; turning the flag off on some blocks
after sd-scripts turned it on everywhere keeps their activations for the backward instead of recomputing them.

`auto` measures instead of guessing (activations grow with resolution, batch, LoRA targets and kernels):
  1. The first optimizer step runs with every block checkpointed except the last double and the last single
     block; their forward's growth in allocated memory is one block's activations of each kind.
  2. After that step, the room left is the memory this process may use (the card, or the memory tier's size where
     that is smaller, less what the CUDA context and other processes hold, within PyTorch's per-process fraction),
     minus MARGIN of it, minus the step's peak reserved memory. As many more blocks as fit in that room, each at
     its kind's size, run without checkpointing from the second step on; where the room is negative, measured
     ones go back to checkpointing.
The first step's batch may be smaller than the largest the dataset can bring (sd-scripts' `bucket_no_upscale`
keeps small images small): activations grow with the tokens, so each block's measured size, and the part of the
peak above what was allocated before the first forward, are scaled to the largest bucket (`max_image_tokens`, the
resolution's area / 16²) before they are compared with the room.
Blocks leave checkpointing from the end of the model backwards (single blocks, then double blocks): every block
costs the same time, and which ones keep activations does not change the peak.
With flux_kernels' `selective_checkpoint` installed, a checkpointed block can also keep just its attention and
wide-input matmul outputs (~a tenth of its activations for ~a third of its recompute time), so the room goes to
that first: `auto` measures the first step without it, counts what it keeps per block from the block's hidden
states (two hidden-sized tensors per token: the attention output and one matmul output), turns it on for as many
checkpointed blocks as the room holds and, only if it holds all of them, un-checkpoints blocks with what is left
(each then costs its activations less what it kept selectively).
With `activation_offload` as well, what checkpointed blocks keep waits in host memory, so every checkpointed
block keeps its selective outputs and the whole room goes to un-checkpointing blocks (each at its full activations:
an un-checkpointed block is not offloaded).

With several processes (`launcher.gpus`), the processes agree before deciding: each measures its own room and
block sizes, and all of them decide from the tightest room and the largest sizes of any, so every process runs the
same blocks checkpointed (two H200s had split 54 / 55 and 32 / 33 checkpointed blocks; the step waits for the
slowest process at the gradient all-reduce anyway, so the one that kept more gained nothing for its memory).

An explicit count `N` un-checkpoints that many blocks (in the same order) from the first step, without measuring,
and leaves selective checkpointing, where installed, on for the others. `0` checkpoints every block, as sd-scripts
does (selectively where that kernel is installed). `auto` does nothing without CUDA, with block swap or CPU-offloaded
checkpointing (they exist to save memory and move blocks' tensors themselves) and with CUDA graphs (recorded at
the first steps, they would be recorded before the decision).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any

from flux_trainer.config.validate import CHECKPOINT_SKIP_AUTO as AUTO

log = logging.getLogger("flux_trainer.runner")
GIB = 2**30
MARGIN = 0.15  # of the usable memory kept free: at 8% (H200, tier caps) steps slowed and varied near the cap
UNMEASURED = -(1 << 62)  # a process's room where it could not measure: the tightest room then tells every process


@dataclass
class DeviceMemory:
    """The CUDA memory figures the decision reads (a seam for CPU tests)."""

    device: Any

    def __post_init__(self) -> None:
        import torch

        device = torch.device(self.device)
        if device.index is None:  # "cuda": the current one (some of torch's getters want an index)
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device

    def allocated(self) -> int:
        import torch

        return torch.cuda.memory_allocated(self.device)

    def peak_reserved(self) -> int:
        import torch

        return torch.cuda.max_memory_reserved(self.device)

    def reserved(self) -> int:
        import torch

        return torch.cuda.memory_reserved(self.device)

    def free_total(self) -> tuple[int, int]:
        import torch

        return torch.cuda.mem_get_info(self.device)

    def fraction(self) -> float:
        import torch

        get = getattr(torch.cuda, "get_per_process_memory_fraction", None)
        return float(get(self.device)) if get is not None else 1.0


def usable_bytes(free: int, total: int, reserved: int, fraction: float, tier_gib: float | None) -> int:
    """What this process may hold through PyTorch: the card (or the tier's size, where smaller) less what is used
    outside PyTorch's cache (the CUDA context, other processes), within PyTorch's per-process fraction."""
    outside = max(0, total - free - reserved)
    card = min(total, int(tier_gib * GIB)) if tier_gib else total
    return max(0, min(card - outside, int(total * fraction)))


def room_bytes(memory: Any) -> int:
    """What this process may still allocate through PyTorch (a DeviceMemory): what it may hold in all, by
    usable_bytes (the card less what is used outside PyTorch's cache, within its per-process fraction, which
    `flux-train bench --vram-cap` sets), less what it holds now."""
    free, total = memory.free_total()
    return usable_bytes(free, total, memory.reserved(), memory.fraction(), None) - memory.allocated()


def blocks_that_fit(room: int, sizes: list[int]) -> int:
    """How many of the blocks whose activations take `sizes` bytes (in the order they would leave checkpointing)
    fit in `room` bytes, taken in order; negative when the room is negative (that many measured ones must go back:
    each of those is counted at the largest size)."""
    if room < 0:
        return -math.ceil(-room / max(sizes, default=1))
    n = 0
    for size in sizes:
        if size <= 0 or size > room:
            break
        room -= size
        n += 1
    return n


def skip_order(flux: Any) -> list[tuple[str, Any]]:
    """Blocks in the order they leave checkpointing: single blocks from the last, then double blocks from the last,
    except that the last double block comes second (with the last single one, the two `auto` measures)."""
    singles = [("single", b) for b in reversed(list(getattr(flux, "single_blocks", [])))]
    doubles = [("double", b) for b in reversed(list(getattr(flux, "double_blocks", [])))]
    head = singles[:1] + doubles[:1]
    return head + singles[1:] + doubles[1:]


@dataclass
class CheckpointFit:
    """One training process's `memory.checkpoint_skip`: `start` at the first micro-step, `note_peak` before
    anything resets the peak statistics, `decide` once the first optimizer step is done."""

    setting: str | int
    tier_gib: float | None = None
    max_image_tokens: int | None = None  # the largest bucket's image tokens (None: sizes as measured)
    blocked: str | None = None  # why auto does nothing (block swap, CPU offload, CUDA graphs)
    memory: DeviceMemory | None = None  # None: no CUDA
    per_block: dict[str, int] = field(default_factory=dict)
    kept: int = 0  # blocks running without checkpointing now
    total: int = 0
    _order: list[tuple[str, Any]] = field(default_factory=list)
    _handles: list[Any] = field(default_factory=list)
    _peak: int = 0
    _measuring: bool = False
    _static: int = 0  # allocated before the first forward (weights, LoRA): what does not grow with the tokens
    _text_tokens: int | None = None  # the measured forward's (from the double block, which runs first)
    _peak_scale: float | None = None  # the smallest token scale seen: the step's largest batch set its peak
    per_block_selective: dict[str, int] = field(default_factory=dict)  # what that keeps per block, by kind
    _selective_installed: bool = False
    _offloaded: bool = False  # activation_offload: checkpointed blocks keep their saved tensors in host memory

    def start(self, flux: Any) -> str | None:
        """At the first micro-step: apply a count, or un-checkpoint the two blocks `auto` measures. Returns a log
        line where something was decided or will not be."""
        self._order = [(kind, b) for kind, b in skip_order(flux) if getattr(b, "gradient_checkpointing", False)]
        self.total = len(self._order)
        if not self._order:
            return None
        self._selective_installed = any(selective_on(b) for _, b in self._order)
        self._offloaded = any(offloaded(b) for _, b in self._order)
        if self.setting != AUTO:
            self._keep(int(self.setting))
            return self._say(f"memory.checkpoint_skip={self.setting}")
        why = self.blocked or (None if self.memory is not None else "no CUDA device")
        if why:
            return f"gradient checkpointing on all {self.total} blocks (memory.checkpoint_skip=auto: {why})"
        self._static = self.memory.allocated()
        self._select(0)  # the first step measures plain checkpointing; the room decides about selective after it
        measured = self._order[:2]
        for kind, block in measured:
            self._handles.append(block.register_forward_pre_hook(self._before))
            self._handles.append(block.register_forward_hook(self._after(kind), with_kwargs=True))
        self._keep(len(measured))
        self._measuring = True
        return None

    def _before(self, module: Any, args: Any) -> None:
        module._flux_fit_allocated = self.memory.allocated()

    def _after(self, kind: str):
        def hook(module: Any, args: Any, kwargs: dict, output: Any) -> None:
            grown = self.memory.allocated() - getattr(module, "_flux_fit_allocated", 0)
            given = hidden_states(kind, args, kwargs)
            scale = self._token_scale(kind, given)
            self._peak_scale = scale if self._peak_scale is None else min(self._peak_scale, scale)
            self.per_block[kind] = max(self.per_block.get(kind, 0), int(grown * scale))
            if self._selective_installed:
                kept = SELECTIVE_COPIES * sum(t.numel() * t.element_size() for t in given if t is not None)
                self.per_block_selective[kind] = max(self.per_block_selective.get(kind, 0), int(kept * scale))

        return hook

    def _token_scale(self, kind: str, given: list) -> float:
        """How much larger the largest bucket's activations are than this forward's (>= 1; 1 where the shapes are
        not known), from the block's hidden states (`hidden_states`)."""
        tokens = [t.shape[1] if getattr(t, "ndim", 0) == 3 else None for t in given]
        if not self.max_image_tokens or None in tokens:
            return 1.0
        if kind == "double":
            image, self._text_tokens = tokens
        elif self._text_tokens is not None:
            image = tokens[0] - self._text_tokens
        else:
            return 1.0
        text = self._text_tokens
        return max(1.0, (self.max_image_tokens + text) / max(1, image + text))

    def note_peak(self) -> None:
        """Keep the peak reserved memory so far (the step metrics reset PyTorch's peak after every log)."""
        if self._measuring:
            self._peak = max(self._peak, self.memory.peak_reserved())

    def decide(self) -> str | None:
        """After the first optimizer step of `auto`: how many blocks keep their activations from now on."""
        if not self._measuring:
            return None
        self._measuring = False
        for h in self._handles:
            h.remove()
        self._handles.clear()
        try:
            return self._fit()
        except Exception as e:  # noqa: BLE001 - a speed-up that cannot decide leaves sd-scripts' safe default
            self._keep(0)
            log.warning(
                "memory.checkpoint_skip=auto could not decide (%s: %s): every block checkpointed", type(e).__name__, e
            )
            return None

    def _fit(self) -> str:
        scale = self._peak_scale or 1.0
        try:
            self._peak = max(self._peak, self.memory.peak_reserved())
            peak = self._static + int(max(0, self._peak - self._static) * scale)
            free, total = self.memory.free_total()
            usable = usable_bytes(free, total, self.memory.reserved(), self.memory.fraction(), self.tier_gib)
            room, failed = int(usable * (1 - MARGIN)) - peak, None
        except Exception as e:  # noqa: BLE001 - every process must still reach agree's all-reduce, then all give up
            room, failed = UNMEASURED, e
        room, self.per_block, self.per_block_selective, processes = agree(
            room, self.per_block, self.per_block_selective
        )
        if failed is not None:
            raise failed
        if room <= UNMEASURED // 2:
            raise RuntimeError(f"another of the {processes} processes could not measure its memory")
        rest = self._order[self.kept :]
        sizes = [self.per_block.get(kind, 0) for kind, _ in rest]
        selective = [self.per_block_selective.get(kind, 0) for kind, _ in rest] if self.per_block_selective else []
        if self._offloaded and selective:  # what they keep waits in host memory: every checkpointed block keeps it
            selective = [0] * len(selective)
            n_selective = len(selective)
        else:
            n_selective = blocks_that_fit(room, selective) if selective and room > 0 else 0
        more = 0
        if room < 0 or (self.per_block and n_selective == len(selective)):
            # no room: measured blocks go back to checkpointing. Room for every checkpointed block's selective
            # outputs: what is left un-checkpoints whole blocks, each for its activations less what it kept
            left = room - sum(selective) if room > 0 else room
            less = [a - b if a > b else 0 for a, b in zip(sizes, selective or [0] * len(sizes), strict=True)]
            more = blocks_that_fit(left, less)
        self._keep(self.kept + more)
        self._select(self.total if self._offloaded else n_selective - max(0, more))
        measured = ", ".join(f"{k} {v / GIB:.2f}" for k, v in sorted(self.per_block.items()))
        if self.per_block_selective:
            measured += "; selectively " + ", ".join(
                f"{k} {v / GIB:.3f}" for k, v in sorted(self.per_block_selective.items())
            )
        larger = f" (scaled {scale:.2f}x to the largest bucket)" if scale > 1 else ""
        agreed = f"; the tightest of {processes} processes" if processes > 1 else ""
        return self._say(
            f"memory.checkpoint_skip=auto: activations per block {measured} GiB; first step's peak "
            f"{peak / GIB:.1f} GiB reserved{larger} of {usable / GIB:.1f} GiB usable{agreed}"
        )

    def _keep(self, n: int) -> None:
        self.kept = max(0, min(n, self.total))
        for i, (_, block) in enumerate(self._order):
            block.gradient_checkpointing = i >= self.kept

    def _select(self, n: int) -> None:
        """Selective checkpointing on for the first `n` checkpointed blocks (in order), off for the rest."""
        if not self._selective_installed:
            return
        from flux_kernels.memory.selective_checkpoint import ATTR  # here, not at the top: it imports torch

        for i, (_, block) in enumerate(self._order[self.kept :]):
            setattr(block, ATTR, i < n)

    @property
    def selective(self) -> int:
        """Checkpointed blocks keeping their attention and wide-input matmul outputs now."""
        return sum(selective_on(b) for _, b in self._order[self.kept :])

    def _say(self, why: str) -> str:
        selective = f", {self.selective} of them selectively" if self._selective_installed else ""
        return (
            f"gradient checkpointing on {self.total - self.kept} of {self.total} blocks{selective}, {self.kept} keep "
            f"their activations ({why})"
        )


# what selective checkpointing keeps per block, in copies of the block's hidden states: the attention output and one
# matmul output (linear2 / the MLP down-projections), each as large as the hidden states (the LoRA down-projections'
# rank-sized outputs come on top: ~1% at rank 16; 54.4 MiB measured against 54.0 planned on the H200)
SELECTIVE_COPIES = 2


def agree(room: int, per_block: dict[str, int], selective: dict[str, int]) -> tuple[int, dict, dict, int]:
    """The smallest room and the largest per-block sizes over the processes of the default process group (one
    all-reduce: every process decides at the same step), and how many processes there are. One process: as given.
    The processes must have measured the same block kinds (one model)."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return room, per_block, selective, 1
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
    keys, sel_keys = sorted(per_block), sorted(selective)
    values = torch.tensor(
        [-room, *(per_block[k] for k in keys), *(selective[k] for k in sel_keys)], dtype=torch.int64, device=device
    )
    dist.all_reduce(values, op=dist.ReduceOp.MAX)
    out = values.tolist()
    sizes, sel_sizes = out[1 : 1 + len(keys)], out[1 + len(keys) :]
    agreed = dict(zip(keys, sizes, strict=True)), dict(zip(sel_keys, sel_sizes, strict=True))
    return -out[0], *agreed, dist.get_world_size()


def hidden_states(kind: str, args: tuple, kwargs: dict) -> list:
    """A block call's hidden states: sd-scripts' double blocks take (img, txt, ...), single blocks (x, ...) with the
    text and image tokens in one tensor, by position or by name (None where absent)."""
    names = ("img", "txt") if kind == "double" else ("x",)
    return [kwargs.get(n, args[i] if i < len(args) else None) for i, n in enumerate(names)]


def offloaded(block: Any) -> bool:
    from flux_kernels.memory.activation_offload import ATTR

    return ATTR in getattr(block, "__dict__", {})


def selective_on(block: Any) -> bool:
    from flux_kernels.memory.selective_checkpoint import ATTR

    return bool(getattr(block, ATTR, False))
