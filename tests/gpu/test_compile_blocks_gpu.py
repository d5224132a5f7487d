"""On the GPU: a gradient-checkpointed compiled function with PyTorch's fused attention (a seeded op, so its RNG state
is functionalised for the recompute) is cached by inductor's FX graph cache once flux_kernels.patches.compile_blocks has
done its part. Where this torch marks the graph-safe RNG op uncacheable (2.11), the same function without it must bypass
the cache: the test shows the bypass before it shows the fix."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from flux_kernels.patches import compile_blocks
from tests.conftest import undoing

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def block(x, w):
    q, k, v = (x @ w).unflatten(-1, (3, 4, 64)).permute(2, 0, 3, 1, 4)  # [3, B, H, L, D]
    return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2)


def cache_outcomes(tmp_path, monkeypatch) -> dict[str, int]:
    """Compile `block` under checkpoint afresh (an empty in-memory state, the on-disk cache kept), one forward and
    backward; inductor's cache outcomes for it."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    before = {k: counters["inductor"][f"fxgraph_cache_{k}"] for k in ("hit", "miss", "bypass")}
    fn = torch.compile(lambda x, w: checkpoint(block, x, w, use_reentrant=False))
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 256, 256, generator=gen).to("cuda", torch.bfloat16).requires_grad_()
    w = (torch.randn(256, 768, generator=gen) * 0.05).to("cuda", torch.bfloat16).requires_grad_()
    fn(x, w).float().square().mean().backward()
    torch.cuda.synchronize()
    return {k: counters["inductor"][f"fxgraph_cache_{k}"] - before[k] for k in before}


def test_checkpointed_attention_is_cached(tmp_path, monkeypatch, torch_config):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    torch_config(torch._inductor.config, fx_graph_cache=True)
    with undoing(compile_blocks.restore, torch._dynamo.reset):
        if compile_blocks.graphsafe_rng_blocks_cache():
            assert cache_outcomes(tmp_path, monkeypatch)["bypass"] > 0, "this torch was expected to bypass"
            assert compile_blocks.prefer_cacheable_rng(cuda_graphs=False)
        first = cache_outcomes(tmp_path, monkeypatch)
        second = cache_outcomes(tmp_path, monkeypatch)
    assert first["bypass"] == 0 and second["bypass"] == 0, (first, second)
    assert second["hit"] >= 2 and second["miss"] == 0, second  # forward and backward from the cache
