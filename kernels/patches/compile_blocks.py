"""Regional torch.compile of the FLUX blocks (`compile_blocks`), and what keeps its start-up short: one compiled
graph per block kind, and graphs that torch.compile's FX graph cache keeps for the next run.

Cacheable with gradient checkpointing. In a checkpointed region AOTAutograd recomputes the forward in the
backward, and every recomputed op tagged `nondeterministic_seeded` gets its RNG state saved in the forward and
restored for the recompute. PyTorch tags its fused attention ops so (cuDNN, flash, efficient SDPA: their dropout
draws random numbers, even at p=0), so each checkpointed FLUX block has one such op. On CUDA the default way to do
this is the CUDA-graph-safe higher-order op `graphsafe_run_with_rng_state`, which some torch versions (2.11,
measured on the H200) mark as not cacheable: inductor then bypasses its cache for those graphs and compiles them
anew in every run (~45 s on the first step at 1024², fp8 base + checkpointing). The other way,
`run_and_save_rng_state` / `run_with_rng_state`, saves the generator state on the host; it is exactly as
deterministic, and cacheable there, but not safe inside CUDA graphs. So, where the graph-safe op is the uncacheable
one and the blocks are not replayed from CUDA graphs, `install` turns torch's graph-safe RNG functionalisation off
for the process (`remove` restores it). Nothing changes numerically: the same RNG state is restored either way (and
with dropout at 0 no random number is drawn at all).

Cacheable with flux_kernels' autograd.Functions (single_qkv's `_QKV`, lora_fold's `FoldedLoRA`). Dynamo traces
their forward and backward into the block's graph, but AOTAutograd's cache refuses any graph holding one unless
torch's `autograd_cache_allow_custom_autograd_functions` is on: at `memory=vram80` the single-block graph was
compiled anew in every run (H100, warm cache: "autograd 2 hit / 0 miss / 1 bypass ... autograd_function_apply",
4.2 s of compiling in the first step). Its key is the traced graph, forward and backward bodies included: a change
in what a backward computes is a miss (a CPU test changes one and sees the miss). `install` turns the setting on
for the process, `remove` puts it back. With it, a warm H100 run logged "autograd 3 hit / 0 miss / 0 bypass" (the
double and the single block, and the registry's compile probe before training, which the run log now names apart).

Plainly checkpointed blocks recompute everything, the ops inside those autograd.Functions included: `install` routes
the blocks' checkpoint calls through flux_kernels.memory.selective_checkpoint's hook, which gives a block that does not
checkpoint selectively a recompute-everything context (torch 2.11 saved what the autograd.Functions compute: ~11 GiB
a step with lora_fold at 1024², ~3 GiB with single_qkv; see there). `remove` undoes it."""

from __future__ import annotations

import contextlib
import os
from typing import Any

import torch
from torch import Tensor, nn

GRAPH_RECORD_ENV = "FLUX_KERNELS_GRAPH_RECORD"  # "torch": keep torch's own recording lookups (to compare them)
GRAD_HOOKS = "_flux_kernels_grad_hooks"  # img_in / txt_in forward hooks: one compiled double-block variant
_saved: dict[str, Any] = {}  # torch._functorch.config patches `install` holds open, by key
GRAPHSAFE_RNG = "graphsafe_rng_functionalization"  # torch._functorch.config's switches changed here
AUTOGRAD_FUNCTIONS = "autograd_cache_allow_custom_autograd_functions"


def _hops():
    from torch._prims import rng_prims

    return rng_prims.graphsafe_run_with_rng_state, (rng_prims.run_and_save_rng_state, rng_prims.run_with_rng_state)


def graphsafe_rng_blocks_cache() -> bool:
    """Whether this torch would bypass the FX graph cache for a checkpointed graph with a seeded op (see above)."""
    graphsafe, plain = _hops()
    return not graphsafe.cacheable() and all(op.cacheable() for op in plain)


def _override(name: str, value: bool) -> None:
    """Set torch._functorch.config.<name> for the process through the config's own patch() (never setattr: torch's
    config modules are changed only that way), kept open until `_put_back`."""
    from torch._functorch import config

    if name in _saved:
        return
    change = config.patch({name: value})
    change.__enter__()
    _saved[name] = change


def _put_back(name: str) -> bool:
    """Undo `_override(name, ...)` (the patch exited: the value before it is back); True when there was something
    to undo."""
    change = _saved.pop(name, None)
    if change is None:
        return False
    change.__exit__(None, None, None)
    return True


def prefer_cacheable_rng(cuda_graphs: bool) -> str | None:
    """Turn the graph-safe RNG functionalisation off where it is what keeps checkpointed graphs out of the cache
    and CUDA graphs do not need it. Returns a note for the install line, or None when nothing changed."""
    from torch._functorch import config

    if cuda_graphs or not config.graphsafe_rng_functionalization or not graphsafe_rng_blocks_cache():
        return None
    _override(GRAPHSAFE_RNG, False)
    return "checkpointed blocks' RNG state saved on the host (cacheable on this torch)"


def restore() -> bool:
    """Put torch's setting back as it was before `prefer_cacheable_rng`; True when there was something to undo."""
    return _put_back(GRAPHSAFE_RNG)


def cache_autograd_functions() -> str | None:
    """Let AOTAutograd's cache keep graphs that hold autograd.Functions (see above). Returns a note for the install
    line, or None when nothing changed (already on, or a torch without the switch)."""
    from torch._functorch import config

    if getattr(config, AUTOGRAD_FUNCTIONS, True):
        return None
    _override(AUTOGRAD_FUNCTIONS, True)
    return "graphs with autograd.Functions cached"


def restore_autograd_functions() -> bool:
    """Put `cache_autograd_functions`' switch back; True when there was something to undo."""
    return _put_back(AUTOGRAD_FUNCTIONS)


def install(model: nn.Module, **opts) -> str:
    """`block.compile(**opts)` per block (compiles at first call, one graph per block kind and shape; numerically
    the same program, fused by inductor)."""
    from flux_kernels.patches.blocks import patched_blocks

    double, single = patched_blocks(model)  # FLUX.1's, or Chroma's with our forward (no host sync inside)
    for b in double + single:
        b.compile(**opts)
        _hold_run_backend(b)
    chosen = {**torch._inductor.list_mode_options(opts.get("mode") or "default"), **(opts.get("options") or {})}
    graphs = bool(chosen.get("triton.cudagraphs"))
    fused = _fused_ops(double + single)
    # the host-side RNG variant with the fused ops' blocks: wrong gradients at a second shape on the H200, see TRACED
    rng = prefer_cacheable_rng(cuda_graphs=graphs or bool(fused))
    combo = "combo kernels" if chosen.get("combo_kernels") else None
    cached = cache_autograd_functions()
    routed = _route_checkpoints(model)
    one_double = _one_double_variant(model, double)
    notes = [n for n in (rng, cached, routed, one_double, combo, graphs and _graph_record()) if n]
    if fused:
        notes.append(
            f"{', '.join(fused)}: inductor's code inside the compiled blocks, see flux_kernels.ops.fast.TRACED"
        )
    return f"compile_blocks: {len(double)} double + {len(single)} single blocks" + "".join(f" ({n})" for n in notes)


def _route_checkpoints(model: nn.Module) -> str | None:
    """The blocks' checkpoint calls through selective_checkpoint's hook, so that a plainly checkpointed block
    recomputes everything on every torch, the ops inside autograd.Functions included (see
    flux_kernels.memory.selective_checkpoint). A note for the install line where the blocks checkpoint."""
    from flux_kernels.memory import selective_checkpoint as sac

    why = sac.route(model)
    if not getattr(model, "gradient_checkpointing", False):
        return None
    return "plainly checkpointed blocks recompute all their ops" if why is None else f"checkpoints not routed: {why}"


def _graph_record() -> str:
    """flux_kernels.patches.graph_record where the blocks replay from CUDA graphs, unless
    $FLUX_KERNELS_GRAPH_RECORD=torch."""
    from flux_kernels.patches import graph_record

    if os.environ.get(GRAPH_RECORD_ENV, "").strip().lower() == "torch":
        return f"CUDA graph recording: torch's own lookups ({GRAPH_RECORD_ENV}=torch)"
    return graph_record.install()


def _fused_ops(blocks: list[nn.Module]) -> list[str]:
    """The fused Triton ops patched into these blocks (which take their reference path when traced)."""
    from flux_kernels.patches.blocks import ATTR, TRITON_BLOCK_OPS

    ops = next((getattr(b, ATTR) for b in blocks if hasattr(b, ATTR)), None)
    if ops is None:
        return []
    return [name for name in TRITON_BLOCK_OPS if getattr(ops, name)]


def _hold_run_backend(block: nn.Module) -> None:
    """Call the compiled block inside the run's SDPA backend switch (flux_kernels.patches.attention: the backend the
    probe chose at the run's shape), looked up at each call, so traced code gets the backend without a switch of its
    own."""
    from flux_kernels.patches.blocks import ATTR, chroma_kind

    compiled = block._compiled_call_impl
    chroma_double = chroma_kind(block) == "double"

    def call(*args, **kwargs):
        dispatch = getattr(getattr(block, ATTR, None), "attention", None)
        if chroma_double and isinstance(kwargs.get("txt"), Tensor):
            kwargs["txt"] = _laid_out_plainly(kwargs["txt"])
        with dispatch.compiled_context() if dispatch is not None else contextlib.nullcontext():
            return compiled(*args, **kwargs)

    block._compiled_call_impl = call


def _laid_out_plainly(t: Tensor) -> Tensor:
    """`t` with a row-major tensor's strides: Chroma's first double block gets the text as a slice of txt_in's output
    (the text trimmed to the longest caption), whose batch stride is the untrimmed length's even with one sample,
    every later block a plain tensor; torch.compile guards on strides, so the first block would compile a graph of
    its own (two, once the text length turns dynamic). One copy of the text before the first block instead."""
    want, step = [], 1
    for size in reversed(t.shape):
        want.append(step)
        step *= size
    if tuple(reversed(want)) == t.stride():
        return t
    return t.clone(memory_format=torch.contiguous_format)


def remove(model: nn.Module) -> list[str]:
    """Undo `install`: the blocks run uncompiled, the hooks go, torch's settings are put back."""
    from flux_kernels.memory import selective_checkpoint as sac
    from flux_kernels.patches import graph_record
    from flux_kernels.patches.blocks import block_kind, chroma_kind

    sac.unroute(model)
    undone = ["compile_rng"] if restore() else []
    undone += ["compile_autograd_cache"] if restore_autograd_functions() else []
    undone += ["graph_record"] if graph_record.remove() else []
    for handle in model.__dict__.pop(GRAD_HOOKS, []):
        handle.remove()
    for b in model.modules():
        if getattr(b, "_compiled_call_impl", None) is not None and (block_kind(b) or chroma_kind(b)):
            b._compiled_call_impl = None
            undone.append("compile")
    return undone


def _trainable(block: nn.Module) -> bool:
    from flux_kernels.patches import lora_norms

    return any(p.requires_grad for m in (block, *lora_norms.lora_modules(block)) for p in m.parameters())


def _inputs_need_grad(module: nn.Module, args: tuple, out):
    if torch.is_grad_enabled() and isinstance(out, Tensor) and out.is_floating_point() and not out.requires_grad:
        return out.requires_grad_()  # a leaf here: frozen embedder, inputs without grad
    return out


def _one_double_variant(model: nn.Module, double: list[nn.Module]) -> str | None:
    """The first double block's img / txt come from frozen embedders (img_in, txt_in) and need no grad, while every
    later block's come from a block with a LoRA: torch.compile guards on requires_grad, so it would build and load
    the double block twice (on the H200 a second pair of graphs in every run: ~1.7 s of a warm first step, a whole
    compile of a cold one). Where the first block trains, its inputs are marked as needing grad; the cost is one
    small input gradient ([B, L, hidden]) in that block's backward."""
    embedders = [m for m in (getattr(model, name, None) for name in ("img_in", "txt_in")) if isinstance(m, nn.Module)]
    if not double or not embedders or not _trainable(double[0]):
        return None
    model.__dict__[GRAD_HOOKS] = [m.register_forward_hook(_inputs_need_grad) for m in embedders]
    return "one double-block graph: the first block's inputs require grad"
