"""Selective activation checkpointing of the FLUX blocks (`selective_checkpoint`): a checkpointed block keeps the
outputs of the ops that cost the most time per byte kept, and recomputes the rest in backward.

sd-scripts' gradient checkpointing keeps only each block's inputs and runs the whole forward again in backward:
~a third more work per step. Un-checkpointing whole blocks (memory.checkpoint_skip) removes that for a block at the
price of all its activations (~0.5-0.6 GiB per FLUX block at 1024²). Most of a block's recompute time is in a few
ops whose outputs are small:

  * attention: O(L²) work for an [L, hidden] output (~0.4 ms of cuDNN for 28 MiB per block at 1024² on an H200);
    with its output (and log-sum-exp) kept, the backward recomputes q, k and v but not the attention itself;
  * matmuls whose input is much wider than their output (K >= RATIO · N): the single blocks' linear2
    (15360 -> 3072) and the double blocks' MLP down-projection (12288 -> 3072), and every LoRA down-projection
    (K -> rank: a few KiB that spare a pass over the input).

Kept per block at 1024²: ~54 MiB (attention + one wide-input matmul output), about a tenth of what un-checkpointing
the block keeps, for about a third of its recompute time. The projections that widen (qkv, linear1, MLP up) and all
elementwise work are still recomputed.

How: sd-scripts' blocks call `checkpoint(self._forward, ..., use_reentrant=False)`, the name imported into their
module from torch.utils.checkpoint. `install` points that module's name at `checkpoint` below, which adds a
selective-checkpoint `context_fn` (torch.utils.checkpoint.create_selective_checkpoint_contexts) for the blocks of
the installed model and leaves every other call as it was. torch.compile (compile_blocks) traces the policy into
the compiled graph: its partitioner saves what the policy marks MUST_SAVE. Nothing here imports sd-scripts.

Plainly checkpointed blocks of a compiled model go through the same hook (`route`, which compile_blocks calls): they
get a context whose policy recomputes everything, which is what plain checkpointing means. torch 2.13 does exactly
that itself for a checkpoint without a context_fn, so that its tags reach the ops inside autograd.Functions; torch
2.11 tags the region's ops through FX metadata instead, which misses them, and the partitioner then saved whatever
single_qkv's and lora_fold's autograd.Functions compute (H200, torch 2.11, 1024², every block checkpointed plainly:
the fold's steps peaked at 39.2 GiB against 27.5 without it, 38 linear1 outputs of 189 MiB live at the forward's
end; single_qkv alone kept three [4608, 3072] tensors per single block, ~3 GiB).
"""

from __future__ import annotations

import hashlib
import logging
import sys
import types
from pathlib import Path
from typing import Any

import torch
import torch.utils.checkpoint as tuc
from torch import Tensor, nn

from flux_kernels.patches import fp8  # noqa: F401 - register the custom ops named in _ATTENTION and _FP8
from flux_kernels.patches.attention import fa4  # noqa: F401

ATTR = "_flux_selective_checkpoint"  # on a block: keep its policy's outputs when checkpointed
ROUTED = "_flux_checkpoint_routed"  # on a block: its checkpoint calls come through `checkpoint` below
PATCHED = "_flux_selective_checkpoint_original"  # on a patched module: the `checkpoint` it had
RATIO = 4  # a matmul's output is kept when its contracted dimension is at least RATIO x its output width

# SDPA's backend ops, as a checkpointed region dispatches them (torch.nn.functional.scaled_dot_product_attention
# picks one below autograd)
ATTENTION_OPS = (
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
)


def _packets(names: tuple[str, ...]) -> frozenset:
    return frozenset(p for p in (getattr(torch.ops.aten, n, None) for n in names) if p is not None)


# with the cudnn_fa4 backend's forward (a custom op: flux_kernels.patches.attention.fa4), whose outputs are the
# attention's and its log-sum-exp
_ATTENTION = _packets(ATTENTION_OPS) | {torch.ops.flux_kernels.cudnn_lse_attention}
_MM = _packets(("mm",))
_ADDMM = _packets(("addmm",))


# flux_kernels' fp8 matmuls (custom ops, registered by importing flux_kernels.patches.fp8): x2 first, W8 [N, K] second
# to last
_FP8 = frozenset({torch.ops.flux_kernels.fp8_mm, torch.ops.flux_kernels.fp8_mm_quantized})


def matmul_shape(op: Any, args: tuple) -> tuple[int, int] | None:
    """(K, N) of a matmul op (contracted dimension, output width), None for any other op."""
    packet = getattr(op, "overloadpacket", op)
    if packet in _MM and len(args) >= 2:
        return args[0].shape[-1], args[1].shape[-1]
    if packet in _ADDMM and len(args) >= 3:
        return args[1].shape[-1], args[2].shape[-1]
    if packet in _FP8 and len(args) >= 3:
        return args[0].shape[-1], args[-2].shape[0]
    return None


def keeps(op: Any, args: tuple) -> bool:
    """Whether a checkpointed block keeps this op's output for backward instead of recomputing it."""
    if getattr(op, "overloadpacket", op) in _ATTENTION:
        return True
    shape = matmul_shape(op, args)
    return shape is not None and shape[0] >= RATIO * shape[1]


def policy(ctx, op, *args, **kwargs) -> tuc.CheckpointPolicy:
    return tuc.CheckpointPolicy.MUST_SAVE if keeps(op, args) else tuc.CheckpointPolicy.PREFER_RECOMPUTE


def contexts():
    """The context_fn of a selectively checkpointed block (a plain function: torch.compile traces it as one)."""
    return tuc.create_selective_checkpoint_contexts(policy)


_SOURCE = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16]


def policy_hash() -> str:
    """What AOTAutograd's cache keys a selectively checkpointed graph on. torch cannot hash a context_fn and
    bypasses its cache for a graph whose context_fn has no `cache_hash` (measured on the H200: the 2 checkpointed
    graphs compiled anew in every run); the policy is this module's code and RATIO."""
    return f"{_SOURCE}:{RATIO}"


contexts.cache_hash = policy_hash()


def recompute_all(ctx, op, *args, **kwargs) -> tuc.CheckpointPolicy:
    return tuc.CheckpointPolicy.PREFER_RECOMPUTE


def plain_contexts():
    """The context_fn of a plainly checkpointed block: everything recomputed (see the module's docstring)."""
    return tuc.create_selective_checkpoint_contexts(recompute_all)


plain_contexts.cache_hash = "recompute_all"


def checkpoint(function, *args, **kwargs):
    """torch.utils.checkpoint.checkpoint, with `contexts` for the blocks that checkpoint selectively and
    `plain_contexts` for the other routed blocks (non-reentrant calls without a context_fn of their own); any other
    call is passed through unchanged."""
    # not getattr(function, "__self__", None): torch.compile (2.13) reads that as None for a bound method
    block = function.__self__ if isinstance(function, types.MethodType) else None
    theirs = kwargs.get("use_reentrant", True) is not False or kwargs.get("context_fn") is not None
    if not theirs and getattr(block, ROUTED, False):
        kwargs["context_fn"] = contexts if getattr(block, ATTR, False) else plain_contexts
    return tuc.checkpoint(function, *args, **kwargs)


def _modules_of(blocks: list[nn.Module]) -> list:
    """The modules the blocks' classes are defined in (where their `checkpoint` name lives), each once."""
    found = (sys.modules.get(type(b).__module__) for b in blocks)
    return list({id(m): m for m in found if m is not None}.values())


def route(model: nn.Module) -> str | None:
    """Send the blocks' `checkpoint` calls through `checkpoint` above (plainly, until a block's ATTR says
    selectively). Returns why not (None: routed): the blocks' module must call torch.utils.checkpoint.checkpoint
    by that name."""
    from flux_kernels.patches.blocks import find_blocks

    double, single = find_blocks(model)
    blocks = double + single
    modules = _modules_of(blocks)
    hookable = [m for m in modules if getattr(m, "checkpoint", None) in (tuc.checkpoint, checkpoint)]
    if not blocks or len(hookable) != len(modules):
        found = ", ".join(sorted(m.__name__ for m in modules)) or "no FLUX blocks"
        return f"the blocks' module ({found}) does not call torch.utils.checkpoint.checkpoint as `checkpoint`"
    for m in hookable:
        if m.checkpoint is not checkpoint:
            setattr(m, PATCHED, m.checkpoint)
            m.checkpoint = checkpoint
    for b in blocks:
        setattr(b, ROUTED, True)
    contexts.cache_hash = policy_hash()
    _quiet_torch_warning()
    return None


def install(model: nn.Module, **_) -> str:
    """Route the blocks' `checkpoint` calls through `checkpoint` above, selectively. Raises KernelError where the
    blocks' module does not call torch.utils.checkpoint.checkpoint by that name (nothing to hook)."""
    from flux_kernels.patches.blocks import find_blocks
    from flux_kernels.runtime.errors import KernelError

    why = route(model)
    if why is not None:
        raise KernelError(f"selective_checkpoint: {why}; nothing to hook")
    double, single = find_blocks(model)
    for b in double + single:
        setattr(b, ATTR, True)
    return (
        f"selective_checkpoint: {len(double)} double + {len(single)} single blocks keep their attention and "
        f"wide-input matmul outputs when checkpointed (K >= {RATIO}x N)"
    )


class _InPlaceWarning(logging.Filter):
    """torch.compile warns once that a checkpointed region with a context_fn must not contain in-place ops (their
    output, if kept, would change under the policy). sd-scripts' blocks give the same outputs and gradients with the
    policy as without (tests/unit/test_kernels_selective_checkpoint.py, tests/gpu), so the warning says nothing here
    and is dropped from the run log."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "context_fn is passed to torch.utils.checkpoint" not in record.getMessage()


def _quiet_torch_warning() -> None:
    logger = logging.getLogger("torch._higher_order_ops.wrap")
    if not any(isinstance(f, _InPlaceWarning) for f in logger.filters):
        logger.addFilter(_InPlaceWarning())


def unroute(model: nn.Module) -> None:
    """Undo `route` where `install` did not also make the blocks selective."""
    if not any(ATTR in b.__dict__ for b in model.modules()):
        remove(model)


def remove(model: nn.Module) -> bool:
    """Undo `install` and `route`: this model's blocks lose their switches and their module gets its `checkpoint`
    back (a block of another model with the switches then checkpoints as sd-scripts does). True where blocks had
    been installed selectively."""
    blocks = [b for b in model.modules() if ATTR in b.__dict__ or ROUTED in b.__dict__]
    selective = any(ATTR in b.__dict__ for b in blocks)
    for b in blocks:
        b.__dict__.pop(ATTR, None)
        b.__dict__.pop(ROUTED, None)
    for m in _modules_of(blocks):
        if PATCHED in m.__dict__:
            m.checkpoint = m.__dict__.pop(PATCHED)
    return selective


# ---- the registry probe's pair: one region checkpointed both ways -------------------------------------------------


def _region(x: Tensor, w_qkv: Tensor, w_up: Tensor, w_down: Tensor, heads: int) -> Tensor:
    """x + attention(x) + MLP(x), a FLUX block's kind of work (what the probe checkpoints)."""
    b, n, c = x.shape
    q, k, v = torch.nn.functional.linear(x, w_qkv).view(b, n, 3, heads, c // heads).permute(2, 0, 3, 1, 4)
    attn = torch.nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, c)
    mlp = torch.nn.functional.linear(torch.nn.functional.gelu(torch.nn.functional.linear(x, w_up)), w_down)
    return x + attn + mlp


def reference_region(x: Tensor, w_qkv: Tensor, w_up: Tensor, w_down: Tensor, heads: int) -> Tensor:
    """The region under sd-scripts' checkpointing: everything recomputed in backward."""
    return tuc.checkpoint(_region, x, w_qkv, w_up, w_down, heads, use_reentrant=False)


def selective_region(x: Tensor, w_qkv: Tensor, w_up: Tensor, w_down: Tensor, heads: int) -> Tensor:
    """The same region with the policy: the attention and the wide-input matmul kept."""
    return tuc.checkpoint(_region, x, w_qkv, w_up, w_down, heads, use_reentrant=False, context_fn=contexts)
