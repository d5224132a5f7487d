"""On the GPU: a small random Chroma (sd-scripts' `library/chroma_models`, head_dim 128 as the real one) with the
kernels that reach Chroma's blocks through chroma_blocks (the attention backend, single_qkv, compile_blocks; fp8_matmul)
give sd-scripts' own model's output and weight gradients under bf16 autocast, with one sample and two whose captions
differ in length, and, compiled, each block kind compiles at most twice over several text lengths (no graph break)."""

from __future__ import annotations

import copy
import dataclasses
import importlib

import pytest
import torch

from tests.integration.tiny_run import CHECKOUT, WHY

pytestmark = [pytest.mark.gpu, pytest.mark.sd_scripts,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]  # fmt: skip

SHAPES = dict(hidden_size=512, num_heads=4, depth=2, depth_single_blocks=2, context_in_dim=64, approximator_depth=1,
              approximator_hidden_size=128)  # fmt: skip


@pytest.fixture(scope="module")
def chroma():
    if CHECKOUT is None:
        pytest.skip(f"needs an sd-scripts checkout: {WHY}")
    from flux_trainer.sdscripts.checkout import import_sd_scripts

    import_sd_scripts(CHECKOUT.path)
    mod = importlib.import_module("library.chroma_models")
    torch.manual_seed(0)
    model = mod.Chroma(dataclasses.replace(mod.chroma_params, **SHAPES)).to("cuda", torch.bfloat16).train()
    model.requires_grad_(False)
    for b in (*model.double_blocks, *model.single_blocks):  # a LoRA-like trainable part: the blocks' output layers
        for name, p in b.named_parameters():
            p.requires_grad_(name.endswith(("proj.weight", "linear2.weight", "mlp.2.weight")))
    return mod, model


def _step(model, lens, n_txt=40, seed=0):
    gen = torch.Generator().manual_seed(seed)
    b = len(lens)
    img = torch.randn(b, 256, 64, generator=gen).cuda()
    txt = torch.randn(b, n_txt, 64, generator=gen).cuda()
    ids = torch.zeros(b, 256, 3)
    ids[..., 1], ids[..., 2] = torch.arange(256).float() // 16, torch.arange(256).float() % 16
    mask = torch.tensor([[1] * n + [0] * (n_txt - n) for n in lens]).cuda()
    t, g = torch.rand(b, generator=gen).cuda(), torch.zeros(b).cuda()
    model.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        with torch.no_grad():
            mods = model.get_mod_vectors(timesteps=t, guidance=g, batch_size=b)
        out = model(img, ids.cuda(), txt, torch.zeros(b, n_txt, 3).cuda(), t, None, guidance=g,
                    txt_attention_mask=mask, mod_vectors=mods)  # fmt: skip
    out.float().square().mean().backward()
    grads = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.detach().float(), grads


def _err(got, want) -> float:
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-12)).item()


@pytest.mark.parametrize("names", [["chroma_blocks", "attention", "single_qkv", "compile_blocks"],
                                   ["chroma_blocks", "fp8_matmul"]], ids=["compiled", "fp8"])  # fmt: skip
def test_chroma_with_kernels_gives_sd_scripts_numbers(chroma, names):
    from flux_kernels.patches import patch
    from flux_kernels.runtime.registry import select

    _, plain = chroma
    model = copy.deepcopy(plain)
    installed = patch.apply_kernels(model, select(names, "cuda"))
    assert installed == names
    tol = 1e-1 if "fp8_matmul" in names else 3e-2
    for lens in ([17], [9, 30], [40, 3]):
        want, dwant = _step(plain, lens)
        got, dgot = _step(model, lens)
        assert _err(got, want) <= tol, lens
        assert dgot.keys() == dwant.keys() and dgot
        for name, w in dwant.items():
            assert _err(dgot[name], w) <= tol, (lens, name)
    patch.remove_kernels(model)


def test_compiled_chroma_blocks_do_not_recompile_per_block(chroma):
    """Two text lengths at one batch size: each block kind compiles at most twice (static, then the length dynamic),
    whatever the number of blocks."""
    from torch._dynamo.utils import counters

    from flux_kernels.patches import patch
    from flux_kernels.runtime.registry import select

    _, plain = chroma
    model = copy.deepcopy(plain)
    patch.apply_kernels(model, select(["chroma_blocks", "compile_blocks"], "cuda"))
    torch._dynamo.reset()
    before = counters["stats"]["unique_graphs"]
    for lens in ([17], [25], [31], [12]):
        _step(model, lens)
    assert counters["stats"]["unique_graphs"] - before <= 4
    patch.remove_kernels(model)
