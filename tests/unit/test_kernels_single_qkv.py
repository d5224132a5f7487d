"""single_qkv: the single block's q/k/v + GELU with a written-out backward, against sd-scripts' ops."""

from __future__ import annotations

import pytest
import torch

from flux_kernels import patch, reference, registry, single_qkv
from flux_kernels.single_qkv import reference_single_qkv

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def inputs(dtype, B=2, H=3, D=128, L=9, mlp=40, seed=0, scale_grad=False):
    gen = torch.Generator().manual_seed(seed)
    lin1 = (torch.randn(B, L, 3 * H * D + mlp, generator=gen) * 2 + 0.3).to(dtype).requires_grad_()
    scales = [(torch.rand(D, generator=gen) + 0.5).to(dtype).requires_grad_(scale_grad) for _ in range(2)]
    return lin1, *scales, reference.make_pe(B, L, D, generator=gen), H, 3 * H * D


def outs_and_grads(fn, args, seed=1):
    outs = fn(*args)
    gen = torch.Generator().manual_seed(seed)
    ups = [torch.randn(o.shape, generator=gen).to(o.dtype) for o in outs]
    wrt = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    return [o.detach() for o in outs], torch.autograd.grad(outs, wrt, ups)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [dict(), dict(B=1, H=2, D=64, L=5, mlp=8)], ids=["flux_head", "odd"])
def test_forward_is_sd_scripts_op_for_op_and_the_backward_agrees(dtype, shape):
    args = inputs(dtype, **shape)
    (want, dwant), (got, dgot) = outs_and_grads(reference_single_qkv, args), outs_and_grads(single_qkv.single_qkv, args)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    (g,), (w,) = dgot, dwant
    assert g.shape == w.shape and g.dtype == w.dtype
    # every part of linear1's gradient: q, k (the written-out RMSNorm/RoPE backward), v, and the MLP input
    width = args[-1]
    head = width // 3
    for part in (slice(0, head), slice(head, 2 * head), slice(2 * head, width), slice(width, None)):
        assert reference.max_rel_err(g[..., part], w[..., part]) <= TOL[dtype], part


def test_norm_scales_that_train_take_the_reference_with_their_gradients():
    args = inputs(torch.float32, scale_grad=True)
    (_, dwant), (_, dgot) = outs_and_grads(reference_single_qkv, args), outs_and_grads(single_qkv.single_qkv, args)
    assert len(dgot) == 3 and all(torch.equal(g, w) for g, w in zip(dgot, dwant, strict=True))


def test_the_probe_accepts_it_and_rejects_a_wrong_backward(monkeypatch):
    spec = registry.REGISTRY["single_qkv"]
    assert registry.probe(spec, "cpu").ok

    def no_mean_term(d_out, x, rrms, scale):  # RMSNorm's gradient without the normalisation's own part
        return (rrms * d_out.float() * scale.float()).to(x.dtype)

    monkeypatch.setattr(single_qkv, "_rms_norm_backward", no_mean_term)
    result = registry.probe(spec, "cpu")
    assert not result.ok and "gradient 0" in result.reason


def _single_block_model(fm, dtype, act=None):
    from tests.conftest import flux_block_pair

    model = flux_block_pair(fm, hidden=256, heads=2, std=0.05).to(dtype).requires_grad_(False)  # frozen, as in LoRA
    if act is not None:
        model.single_blocks[0].mlp_act = act
    return model


def _run_single(model, dtype):
    block = model.single_blocks[0]
    args = patch._verify_inputs(block, "single", "cpu", dtype, True)
    wrt = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    return patch._outs_and_grads(block.forward, None, args, wrt)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_patched_single_block_matches_sd_scripts(fm, dtype):
    model = _single_block_model(fm, dtype)
    want = _run_single(model, dtype)
    assert patch.install_block_op(model, op="single_qkv") == "single_qkv: 1 double + 1 single blocks"
    try:
        calls = []
        original = single_qkv._SingleQKV.apply
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(single_qkv._SingleQKV, "apply", lambda *a: calls.append(1) or original(*a))
            got = _run_single(model, dtype)
        assert calls == [1]  # the block went through it
        assert torch.equal(got[0], want[0])  # the output: same ops, same order
        assert all(reference.max_rel_err(g, w) <= TOL[dtype] for g, w in zip(got[1:], want[1:], strict=True))
        assert patch.verify_blocks(model) == []
    finally:
        patch.remove_kernels(model)


def test_a_block_with_another_activation_keeps_its_own_ops(fm):
    model = _single_block_model(fm, torch.float32, act=torch.nn.GELU())  # exact GELU: not what single_qkv computes
    want = _run_single(model, torch.float32)
    patch.install_block_op(model, op="single_qkv")
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(single_qkv._SingleQKV, "apply", lambda *a: pytest.fail("used with an exact GELU"))
            got = _run_single(model, torch.float32)
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    finally:
        patch.remove_kernels(model)


def test_it_is_not_one_of_the_fused_triton_ops_for_compile_blocks(fm):
    from flux_kernels import compile_blocks

    model = _single_block_model(fm, torch.float32)
    patch.install_block_op(model, op="single_qkv")
    try:
        assert compile_blocks._fused_ops(model.single_blocks) == []  # no TRACED note, no RNG variant forced
    finally:
        patch.remove_kernels(model)
