"""flux_prologue: FLUX's per-step embeddings (timestep frequencies, RoPE table, image position ids) without host
syncs, bit for bit what sd-scripts computes."""

from __future__ import annotations

import dataclasses
import importlib

import pytest
import torch

from flux_kernels.patches import patch, prologue
from flux_kernels.runtime import registry
from tests.conftest import tiny_flux, tiny_flux_forward

FLUX_AXES, FLUX_THETA = [16, 56, 56], 10000  # FLUX.1's EmbedND


def positions(batch: int, tokens: int, seed: int = 0) -> torch.Tensor:
    """Random fractional positions on 3 axes (never all zero), as float32 like sd-scripts' ids."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, tokens, 3, generator=g) * 40


@pytest.mark.parametrize("autocast", [False, True])
def test_rope_table_is_sd_scripts_embednd_bit_for_bit(fm, autocast):
    ids = positions(2, 37)
    embed = fm.EmbedND(sum(FLUX_AXES), FLUX_THETA, FLUX_AXES)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        want = embed(ids)
        got, plain = (
            prologue.rope_table(ids, FLUX_AXES, FLUX_THETA),
            prologue.reference_rope_table(ids, FLUX_AXES, FLUX_THETA),
        )
    assert got.shape == want.shape == (2, 1, 37, 64, 2, 2) and got.dtype == want.dtype == torch.float32
    assert got.stride() == want.stride()  # the compiled blocks guard on it: no recompile
    assert torch.equal(got, want) and torch.equal(plain, want)


def test_rope_table_gradient_matches_sd_scripts(fm):
    embed = fm.EmbedND(sum(FLUX_AXES), FLUX_THETA, FLUX_AXES)
    upstream = torch.randn(2, 1, 11, 64, 2, 2, generator=torch.Generator().manual_seed(3))
    grads = []
    for fn in (embed, lambda ids: prologue.rope_table(ids, FLUX_AXES, FLUX_THETA)):
        ids = positions(2, 11).requires_grad_()
        (fn(ids) * upstream).sum().backward()
        grads.append(ids.grad)
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-6, atol=1e-6)
    assert grads[0].abs().min() > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [256, 7])
def test_timestep_embedding_is_sd_scripts_bit_for_bit_and_builds_its_table_once(fm, monkeypatch, dtype, dim):
    built = []
    host_freqs = prologue._host_freqs
    monkeypatch.setattr(prologue, "_FREQS", {})
    monkeypatch.setattr(prologue, "_host_freqs", lambda *a: built.append(a) or host_freqs(*a))
    for seed in (0, 1):
        t = torch.rand(3, generator=torch.Generator().manual_seed(seed)).to(dtype)
        want = fm.timestep_embedding(t, dim)
        for got in (prologue.timestep_embedding(t, dim), prologue.reference_timestep_embedding(t, dim)):
            assert got.dtype == want.dtype == dtype and torch.equal(got, want)
    assert built.count((dim // 2, 10000)) == 3  # the kept table once; the reference builds it every call (twice)


def test_kept_on_builds_once_per_shape_and_hands_out_copies():
    calls = []

    def build(*key):
        calls.append(key)
        return torch.arange(float(key[0] * key[1]))

    ids = prologue.kept_on("cpu", build)
    a, b, c = ids(2, 3), ids(2, 3), ids(4, 1)
    assert calls == [(2, 3), (4, 1)]
    assert torch.equal(a, b) and a.data_ptr() != b.data_ptr()
    a.requires_grad_(True).mul(2).sum().backward()  # what sd-scripts does to img_ids under checkpointing
    assert not ids(2, 3).requires_grad and torch.equal(c, torch.arange(4.0))


def test_kept_position_ids_equal_sd_scripts_prepare_img_ids(fm):
    flux_utils = importlib.import_module("library.flux_utils")
    ids = prologue.kept_on("cpu", flux_utils.prepare_img_ids)
    for shape in ((1, 4, 6), (2, 3, 5), (1, 4, 6)):
        assert torch.equal(ids(*shape), flux_utils.prepare_img_ids(*shape))


def test_installed_in_a_tiny_flux_the_forward_is_the_same_and_uninstall_restores_it(fm):
    model = tiny_flux(fm)
    want = tiny_flux_forward(model, seed=4)
    original = fm.timestep_embedding
    line = prologue.install(model)
    assert line == "flux_prologue: the RoPE table in one cos/sin pass, timestep frequencies kept on the device"
    assert fm.timestep_embedding is prologue.timestep_embedding
    assert torch.equal(tiny_flux_forward(model, seed=4), want)
    assert "flux_prologue" in patch.remove_kernels(model)
    assert fm.timestep_embedding is original and "forward" not in model.pe_embedder.__dict__
    assert torch.equal(tiny_flux_forward(model, seed=4), want)
    assert not prologue.uninstall(model)


def test_install_refuses_a_model_without_a_rope_embedder():
    with pytest.raises(ValueError, match="no pe_embedder"):
        prologue.install(torch.nn.Linear(2, 2))


def test_the_probe_passes_and_rejects_a_table_on_the_wrong_axes():
    spec = registry.REGISTRY["flux_prologue"]
    assert registry.probe(spec).ok

    def swapped(t, ids, axes_dim=(4, 6, 6), theta=10000):
        return prologue.fast_prologue(t, ids.flip(-1), axes_dim, theta)

    result = registry.probe(dataclasses.replace(spec, fast=swapped))
    assert not result.ok and "output 1" in result.reason


def test_position_ids_hook_only_with_the_kernel(tmp_path):
    from flux_trainer.sdscripts.hooks import RunHooks
    from flux_trainer.sdscripts.runner import RunnerSpec

    hooks = RunHooks(RunnerSpec("", "", ""), tmp_path)

    def build(b, h, w):
        return torch.full((b, h * w, 3), 1.0)

    assert hooks.position_ids(build, "cpu") is build
    hooks.kernels_installed = ["flux_prologue"]
    kept = hooks.position_ids(build, "cpu")
    assert kept is not build and hooks.position_ids(build, "cpu") is kept
    assert torch.equal(kept(1, 2, 2), build(1, 2, 2))
