"""scripts/bench_fa4_tiles.py: its candidate configurations and the patch it times them under (the timing itself
needs flash-attn-4 on an sm90 GPU)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from tests.conftest import load_script


@pytest.fixture(scope="module")
def tiles_script():
    return load_script("bench_fa4_tiles")


@dataclasses.dataclass
class Config:  # flash-attn-4's BwdConfig's fields that the candidates change
    m_block_size: int = 80
    n_block_size: int = 128
    num_stages_Q: int = 2
    num_stages_dO: int = 2
    SdP_swapAB: bool = True
    dQ_swapAB: bool = True
    AtomLayoutMSdP: int = 1
    AtomLayoutNdKV: int = 2
    AtomLayoutMdQ: int = 1


def test_the_default_comes_first_and_every_candidate_differs_from_the_others(tiles_script):
    out = tiles_script.configs(Config())
    assert out[0] == ("default", Config())
    assert len({dataclasses.astuple(c) for _, c in out}) == len(out) == len(tiles_script.CANDIDATES)
    assert ("m_block_size=64, dQ_swapAB=False", Config(m_block_size=64, dQ_swapAB=False)) in out
    same = tiles_script.configs(Config(m_block_size=64, dQ_swapAB=False))  # a candidate equal to the default
    assert len(same) == len(out) - 1


def test_the_patch_gives_the_config_and_puts_flash_attn_4s_choice_back(tiles_script):
    def choose(*_a, **_k):
        return "flash-attn-4's"

    bwd = SimpleNamespace(compile_cache={"old": 1})
    interface = SimpleNamespace(_tile_size_bwd_sm90=choose, _flash_attn_bwd=bwd)
    with tiles_script.tiles(interface, "ours"):
        assert interface._tile_size_bwd_sm90(128, 128, False, False) == "ours" and bwd.compile_cache == {}
        bwd.compile_cache["new"] = 2
    assert interface._tile_size_bwd_sm90 is choose and bwd.compile_cache == {}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU machine's answer")
def test_without_an_sm90_gpu_it_says_so(tiles_script, capsys):
    assert tiles_script.main([]) == 2
    assert "needs an sm90 GPU" in capsys.readouterr().err
