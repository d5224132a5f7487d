"""flux_kernels.compile_cache: graph-safe RNG functionalisation is turned off only where it is what keeps
checkpointed compiled graphs out of the FX graph cache and no CUDA graphs need it, and is put back on removal."""

from __future__ import annotations

import pytest
from torch import nn
from torch._functorch import config as functorch_config
from torch._prims import rng_prims

from flux_kernels import compile_cache, patch


@pytest.fixture
def graphsafe_uncacheable(monkeypatch):
    """This torch as 2.11 is: the graph-safe RNG op not cacheable, the host-state ones cacheable."""
    monkeypatch.setattr(rng_prims.graphsafe_run_with_rng_state, "cacheable", lambda: False)
    monkeypatch.setattr(rng_prims.run_and_save_rng_state, "cacheable", lambda: True)
    monkeypatch.setattr(rng_prims.run_with_rng_state, "cacheable", lambda: True)
    monkeypatch.setattr(functorch_config, "graphsafe_rng_functionalization", True)
    yield
    compile_cache.restore()


def test_turned_off_only_where_it_blocks_the_cache_and_no_cuda_graphs(graphsafe_uncacheable, monkeypatch):
    assert compile_cache.graphsafe_rng_blocks_cache()
    assert compile_cache.prefer_cacheable_rng(cuda_graphs=True) is None  # CUDA graphs need the graph-safe op
    assert functorch_config.graphsafe_rng_functionalization is True
    assert "cacheable" in compile_cache.prefer_cacheable_rng(cuda_graphs=False)
    assert functorch_config.graphsafe_rng_functionalization is False
    assert compile_cache.restore() and functorch_config.graphsafe_rng_functionalization is True
    assert not compile_cache.restore()  # nothing left to undo

    monkeypatch.setattr(rng_prims.graphsafe_run_with_rng_state, "cacheable", lambda: True)  # a torch that caches it
    assert not compile_cache.graphsafe_rng_blocks_cache()
    assert compile_cache.prefer_cacheable_rng(cuda_graphs=False) is None
    assert functorch_config.graphsafe_rng_functionalization is True


def test_this_torch_as_installed_decides_by_its_own_flags():
    """No stand-ins: the decision reads the installed torch's operators (2.13 caches the graph-safe op)."""
    graphsafe, plain = rng_prims.graphsafe_run_with_rng_state, rng_prims.run_and_save_rng_state
    assert compile_cache.graphsafe_rng_blocks_cache() == (not graphsafe.cacheable() and plain.cacheable())


class Block(nn.Module):
    """The attributes find_blocks recognises a single-stream block by; never called here."""

    def __init__(self):
        super().__init__()
        self.linear1, self.linear2, self.pre_norm = (
            nn.Linear(4, 4),
            nn.Linear(4, 4),
            nn.LayerNorm(4, elementwise_affine=False),
        )
        self.modulation, self.norm = nn.Linear(4, 4), nn.LayerNorm(4)
        self.mlp_act, self.hidden_size, self.mlp_hidden_dim, self.num_heads = nn.GELU(), 4, 4, 1

    def _forward(self, x, vec, pe, txt_attention_mask=None):
        return x


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.single_blocks = nn.ModuleList([Block(), Block()])


def test_install_compile_says_so_and_remove_kernels_restores(graphsafe_uncacheable):
    model = Model()
    if not patch.find_blocks(model)[1]:
        pytest.fail("the stand-in block is not recognised as a single-stream block")
    line = patch.install_compile(model, mode="reduce-overhead")  # CUDA graphs: left as it is
    assert "RNG" not in line and functorch_config.graphsafe_rng_functionalization is True
    patch.remove_kernels(model)
    line = patch.install_compile(model)
    assert "RNG state saved on the host" in line and functorch_config.graphsafe_rng_functionalization is False
    assert "compile_rng" in patch.remove_kernels(model)
    assert functorch_config.graphsafe_rng_functionalization is True
