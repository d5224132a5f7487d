"""chroma_blocks (flux_kernels.patches.chroma) against sd-scripts' own Chroma blocks (`library/chroma_models`, the
tiny preset's widths, on the CPU): outputs at every position, padded text included, and gradients of the inputs and of
every weight, with one sample and with two whose captions differ in length; the whole model's output and weight
gradients; one compiled graph per block without a graph break; and the checks that catch a forward that differs."""

from __future__ import annotations

import dataclasses
import importlib
import logging

import pytest
import torch

from flux_trainer.config.random_specs import PRESETS
from flux_trainer.sdscripts.checkout import import_sd_scripts
from tests.integration.tiny_run import CHECKOUT, WHY

pytestmark = pytest.mark.sd_scripts

TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2}  # max |ours - sd-scripts'| / max |sd-scripts'|


@pytest.fixture(scope="module")
def chroma():
    if CHECKOUT is None:
        pytest.skip(f"needs an sd-scripts checkout: {WHY}")
    import_sd_scripts(CHECKOUT.path)
    return importlib.import_module("library.chroma_models")


def _model(mod, seed=0):
    torch.manual_seed(seed)
    return mod.Chroma(dataclasses.replace(mod.chroma_params, **PRESETS["chroma_tiny"]["flux"])).train()


def _err(got, want) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-12)).item()


def _block_args(mod, block, kind, lens, n_img, seed, dtype=torch.float32):
    """A block's arguments as Chroma's forward makes them: text trimmed to the longest caption, image tokens first."""
    gen = torch.Generator().manual_seed(seed)
    hidden, b, n_txt = block.hidden_size, len(lens), max(lens)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(dtype).requires_grad_()

    def m():
        return mod.ModulationOut(*(rnd(b, 1, hidden, scale=0.3) for _ in range(3)))

    from flux_kernels.ops.reference import make_pe

    pe = make_pe(b, n_img + n_txt, hidden // block.num_heads, generator=gen)
    lens = torch.tensor(lens)
    if kind == "double":
        mods = [[m(), m()], [m(), m()]]
        leaves = [t for pair in mods for o in pair for t in (o.shift, o.scale, o.gate)]
        return (rnd(b, n_img, hidden), rnd(b, n_txt, hidden), pe, mods, lens), leaves
    mods = m()
    return (rnd(b, n_img + n_txt, hidden), pe, mods, lens), [mods.shift, mods.scale, mods.gate]


def _run(fn, args, leaves, params, seed=3):
    """Outputs, and gradients of the tensor arguments, the modulations and the block's weights, for a fixed random
    upstream gradient."""
    out = fn(*args)
    outs = list(out) if isinstance(out, tuple) else [out]
    gen = torch.Generator().manual_seed(seed)
    gouts = [torch.randn(o.shape, generator=gen).to(o.dtype) for o in outs]
    wrt = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad] + leaves + params
    return [o.detach() for o in outs], torch.autograd.grad(outs, wrt, gouts)


def _compare(mod, kind, lens, dtype, seed):
    from flux_kernels.patches import chroma as ck

    model = _model(mod, seed)
    block = model.double_blocks[0] if kind == "double" else model.single_blocks[0]
    block.to(dtype)
    args, leaves = _block_args(mod, block, kind, lens, n_img=6, seed=seed, dtype=dtype)
    params = list(block.parameters())
    want, dwant = _run(lambda *a: type(block)._forward(block, *a), args, leaves, params)
    ck.install(model)
    got, dgot = _run(block._forward, args, leaves, params)
    return want, got, dwant, dgot


@pytest.mark.parametrize("kind", ["double", "single"])
@pytest.mark.parametrize("lens", [[5], [5, 2], [3, 5, 1]], ids=["one", "two-padded", "three-padded"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_our_block_forward_is_sd_scripts(chroma, kind, lens, dtype):
    """Every output position (padded text included: sd-scripts' zeros through proj and the MLP) and every gradient;
    fresh random inputs for each case."""
    seed = hash((kind, tuple(lens), str(dtype))) % 1000
    want, got, dwant, dgot = _compare(chroma, kind, lens, dtype, seed)
    for g, w in zip(got + list(dgot), want + list(dwant), strict=True):
        assert g.shape == w.shape
        assert _err(g, w) <= TOL[dtype]


def test_the_whole_model_gives_sd_scripts_loss_and_weight_gradients(chroma):
    """Chroma's forward as sd-scripts' trainer calls it, two samples whose captions differ in length: the output and
    every weight's gradient, with chroma_blocks and without."""
    from flux_kernels.patches import chroma as ck
    from flux_kernels.patches import patch

    model = _model(chroma, seed=7)
    gen = torch.Generator().manual_seed(11)
    img, txt = torch.randn(2, 16, 64, generator=gen), torch.randn(2, 8, 64, generator=gen)
    img_ids = torch.zeros(2, 16, 3)
    img_ids[..., 1], img_ids[..., 2] = torch.arange(16).float() // 4, torch.arange(16).float() % 4
    mask = torch.tensor([[1] * 3 + [0] * 5, [1] * 6 + [0] * 2])  # lengths 4 and 7 with sd-scripts' attn_padding
    t, g = torch.tensor([0.3, 0.7]), torch.zeros(2)

    def loss_and_grads():
        model.zero_grad()
        with torch.no_grad():
            mods = model.get_mod_vectors(timesteps=t, guidance=g, batch_size=2)
        out = model(img, img_ids, txt, torch.zeros(2, 8, 3), t, None, guidance=g, txt_attention_mask=mask,
                    mod_vectors=mods)  # fmt: skip
        out.square().mean().backward()
        return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    want, dwant = loss_and_grads()
    ck.install(model)
    got, dgot = loss_and_grads()
    patch.remove_kernels(model)
    assert _err(got, want) <= 1e-5
    assert dgot.keys() == dwant.keys() and any("double_blocks" in n for n in dgot)
    for name, w in dwant.items():
        assert _err(dgot[name], w) <= 1e-4, name


def test_verify_blocks_passes_ours_and_catches_one_that_differs(chroma, monkeypatch):
    """The check apply_kernels runs: ours passes; a forward that leaves the padding in attention fails it, and so
    does one that does not zero the padded positions' attention output (what sd-scripts writes there)."""
    from flux_kernels.patches import chroma as ck
    from flux_kernels.patches import patch
    from flux_kernels.patches.verify import verify_blocks

    model = _model(chroma, seed=3)
    ck.install(model)
    assert verify_blocks(model) == []
    monkeypatch.setattr(ck, "kept_text", lambda lens, n_img, n_txt: None)  # attends to the padding
    with pytest.raises(ValueError, match="double-stream block differs"):
        verify_blocks(model)
    monkeypatch.undo()

    def unzeroed(q, k, v, keep, ops=None):
        mask = None if keep is None else keep[:, None, None, :].expand(-1, q.shape[1], q.shape[2], -1)
        return (ops or patch.BlockOps()).attend(q, k, v, mask)

    monkeypatch.setattr(ck, "masked_attention", unzeroed)
    with pytest.raises(ValueError, match="block differs"):
        verify_blocks(model)
    patch.remove_kernels(model)


def test_the_probe_checks_masked_attention_against_the_trimmed_reference():
    from flux_kernels.runtime import registry

    spec = registry.REGISTRY["chroma_blocks"]
    result = registry.probe(spec, "cpu")
    assert result.ok and result.max_err is not None and result.max_err <= registry.TOLERANCE[torch.bfloat16], result
    wrong = dataclasses.replace(spec, fast=lambda q, k, v, keep: spec.fast(q, k, v, None))
    assert not registry.probe(wrong, "cpu").ok


def test_auto_installs_chroma_blocks_and_what_works_in_them(chroma, caplog):
    """apply_kernels as `auto` on Chroma: chroma_blocks first, then the kernels that work in its blocks (here those
    that run on a CPU: single_qkv, compile_blocks), verified; the others one line each."""
    from flux_kernels.patches import patch
    from flux_kernels.runtime.registry import unchecked

    model = _model(chroma, seed=5)
    names = ["chroma_blocks", "single_qkv", "double_qkv", "lora_fold", "flux_prologue", "selective_checkpoint",
             "compile_blocks"]  # fmt: skip
    sel = unchecked(names)
    auto = type(sel)(sel.installed, {}, None, sel.specs, explicit=False)
    with caplog.at_level(logging.INFO):
        installed = patch.apply_kernels(model, auto)
    assert installed[:2] == ["chroma_blocks", "single_qkv"] and "compile_blocks" in installed
    assert "double_qkv" not in installed and "selective_checkpoint" not in installed
    lines = [r.getMessage() for r in caplog.records]
    assert sum("kernel double_qkv skipped: not made for Chroma's blocks" in m for m in lines) == 1
    assert model.double_blocks[0]._compiled_call_impl is not None
    assert "compile" in patch.remove_kernels(model) and "_forward" not in model.double_blocks[0].__dict__


def test_a_compiled_chroma_block_is_one_graph_and_matches(chroma):
    """Our forward under torch.compile(fullgraph=True) (inductor on the CPU): no graph break (sd-scripts' `.item()`
    and per-sample slicing would break it), two samples with padding, outputs and input gradients as sd-scripts'."""
    from flux_kernels.patches import chroma as ck

    model = _model(chroma, seed=9)
    ck.install(model)
    for kind, block in (("double", model.double_blocks[0]), ("single", model.single_blocks[0])):
        args, leaves = _block_args(chroma, block, kind, [5, 2], n_img=6, seed=13)
        want, dwant = _run(lambda *a, b=block: type(b)._forward(b, *a), args, leaves, [])
        compiled = torch.compile(block._forward, fullgraph=True)
        got, dgot = _run(compiled, args, leaves, [])
        for g, w in zip(got + list(dgot), want + list(dwant), strict=True):
            assert _err(g, w) <= 1e-4, kind


def test_attention_is_probed_at_the_shape_chromas_blocks_run(chroma):
    """The attention probe's shape for Chroma: image + the text as its forward trims it (longest caption + its
    attn_padding), and a mask only with several samples (one sample has no padding: no mask is passed)."""
    from flux_kernels.patches.patch import attention_shape

    model = _model(chroma)
    img, txt, ids = torch.zeros(2, 16, 64), torch.zeros(2, 8, 64), torch.zeros(2, 16, 3)
    mask = torch.tensor([[1] * 3 + [0] * 5, [1] * 5 + [0] * 3])
    kwargs = dict(img=img, img_ids=ids, txt=txt, txt_ids=torch.zeros(2, 8, 3), timesteps=torch.zeros(2), y=None,
                  txt_attention_mask=mask)  # fmt: skip
    heads, head_dim = model.num_heads, model.hidden_size // model.num_heads
    assert attention_shape(model, (), kwargs)[0] == (2, heads, 16 + 6, head_dim)
    assert attention_shape(model, (), kwargs)[3] is True
    one = {**kwargs, "img": img[:1], "txt": txt[:1], "txt_attention_mask": mask[:1]}
    shape, _, _, with_mask = attention_shape(model, (), one)
    assert shape == (1, heads, 16 + 4, head_dim) and with_mask is False


def test_a_named_kernel_that_chromas_blocks_do_not_take_is_an_error(chroma):
    from flux_kernels.patches import patch
    from flux_kernels.runtime.errors import KernelError
    from flux_kernels.runtime.registry import unchecked

    model = _model(chroma, seed=2)
    with pytest.raises(KernelError, match="double_qkv: not made for Chroma's blocks"):
        patch.apply_kernels(model, unchecked(["chroma_blocks", "double_qkv"]))
    patch.remove_kernels(model)
    with pytest.raises(KernelError, match="compile_blocks: no FLUX.1 double/single blocks"):
        patch.apply_kernels(model, unchecked(["compile_blocks"]))


def test_compiled_chroma_blocks_make_one_graph_per_kind_and_length_kind(chroma):
    """compile_blocks on Chroma (dynamo only, `backend="eager"`): the first double block's text (a slice of txt_in's
    output) is laid out as the later blocks' is, so two double and two single blocks make one graph per block kind at
    the first text length and one more, the length dynamic, at the next ones: 4 graphs, none per block."""
    from torch._dynamo.utils import counters

    from flux_kernels.patches import chroma as ck
    from flux_kernels.patches import compile_blocks, patch

    torch.manual_seed(0)
    shapes = {**PRESETS["chroma_tiny"]["flux"], "depth": 2, "depth_single_blocks": 2}
    model = chroma.Chroma(dataclasses.replace(chroma.chroma_params, **shapes)).train()
    ck.install(model)
    compile_blocks.install(model, backend="eager")
    torch._dynamo.reset()
    before = counters["stats"]["unique_graphs"]
    gen = torch.Generator().manual_seed(0)
    for n in (5, 7, 9):
        img, txt = torch.randn(1, 16, 64, generator=gen), torch.randn(1, 12, 64, generator=gen)
        mask = torch.tensor([[1] * n + [0] * (12 - n)])
        t, g = torch.rand(1, generator=gen), torch.zeros(1)
        with torch.no_grad():
            mods = model.get_mod_vectors(timesteps=t, guidance=g, batch_size=1)
        out = model(img, torch.zeros(1, 16, 3), txt, torch.zeros(1, 12, 3), t, None, guidance=g,
                    txt_attention_mask=mask, mod_vectors=mods)  # fmt: skip
        out.sum().backward()
    assert counters["stats"]["unique_graphs"] - before == 4
    patch.remove_kernels(model)
    torch._dynamo.reset()
