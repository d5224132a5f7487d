"""Keep gradient-checkpointed compiled blocks cacheable by torch.compile's FX graph cache.

In a checkpointed region AOTAutograd recomputes the forward in the backward, and every recomputed op tagged
`nondeterministic_seeded` gets its RNG state saved in the forward and restored for the recompute. PyTorch tags
its fused attention ops so (cuDNN, flash, efficient SDPA: their dropout draws random numbers, even at p=0), so each
checkpointed FLUX block has one such op. On CUDA the default way to do this is the CUDA-graph-safe higher-order
op `graphsafe_run_with_rng_state`, which some torch versions (2.11, measured on the H200) mark as not cacheable:
inductor then bypasses its cache for those graphs and compiles them anew in every run (~45 s on the first step
at 1024², fp8 base + checkpointing). The other way, `run_and_save_rng_state` / `run_with_rng_state`, saves the
generator state on the host; it is exactly as deterministic, and cacheable there, but not safe inside CUDA graphs.

So, where the graph-safe op is the uncacheable one and the blocks are not replayed from CUDA graphs, this turns
torch's graph-safe RNG functionalisation off for the process (restored by `restore`). Nothing changes numerically:
the same RNG state is restored either way (and with dropout at 0 no random number is drawn at all).
"""

from __future__ import annotations

_saved: list[bool] = []  # the setting before `prefer_cacheable_rng` changed it (empty when it changed nothing)


def _hops():
    from torch._prims import rng_prims

    return rng_prims.graphsafe_run_with_rng_state, (rng_prims.run_and_save_rng_state, rng_prims.run_with_rng_state)


def graphsafe_rng_blocks_cache() -> bool:
    """Whether this torch would bypass the FX graph cache for a checkpointed graph with a seeded op (see above)."""
    graphsafe, plain = _hops()
    return not graphsafe.cacheable() and all(op.cacheable() for op in plain)


def prefer_cacheable_rng(cuda_graphs: bool) -> str | None:
    """Turn the graph-safe RNG functionalisation off where it is what keeps checkpointed graphs out of the cache
    and CUDA graphs do not need it. Returns a note for the install line, or None when nothing changed."""
    from torch._functorch import config

    if cuda_graphs or not config.graphsafe_rng_functionalization or not graphsafe_rng_blocks_cache():
        return None
    _saved.append(config.graphsafe_rng_functionalization)
    config.graphsafe_rng_functionalization = False
    return "checkpointed blocks' RNG state saved on the host (cacheable on this torch)"


def restore() -> bool:
    """Put torch's setting back as it was before `prefer_cacheable_rng`; True when there was something to undo."""
    from torch._functorch import config

    if not _saved:
        return False
    config.graphsafe_rng_functionalization = _saved[0]
    _saved.clear()
    return True
