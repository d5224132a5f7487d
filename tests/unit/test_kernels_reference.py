"""flux_kernels.ops.reference equals sd-scripts' own math, and a patched block with every switch off is sd-scripts'
block bit for bit (CPU, no Triton needed). Skips with the reason when no sd-scripts checkout is found."""

from __future__ import annotations

import pytest
import torch

from flux_kernels.ops import reference
from flux_kernels.patches import patch, verify
from flux_kernels.patches.blocks import find_blocks
from tests.conftest import undoing

HIDDEN, HEADS = 256, 2  # head_dim 128, as FLUX


@pytest.fixture(scope="module")
def fm():
    from flux_trainer.sdscripts.checkout import import_sd_scripts, locate

    try:
        return import_sd_scripts(locate().path).flux_models
    except Exception as e:  # noqa: BLE001 - no checkout / not importable here: say which
        pytest.skip(f"sd-scripts not importable: {e}")


def _rand(*shape, dtype=torch.float32, seed=0):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) + 0.25).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_and_qknorm_match(fm, dtype):
    q, k, v = (_rand(2, 3, 7, 128, dtype=dtype, seed=s) for s in range(3))
    norm = fm.QKNorm(128)
    with torch.no_grad():
        norm.query_norm.scale.copy_(_rand(128, seed=4))
        norm.key_norm.scale.copy_(_rand(128, seed=5))
    assert torch.equal(reference.rms_norm(q, norm.query_norm.scale), norm.query_norm(q))
    pe = reference.make_pe(2, 7, 128)
    want = fm.apply_rope(*norm(q, k, v), pe)
    got = reference.qk_norm_rope(q, k, norm.query_norm.scale, norm.key_norm.scale, pe)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


def test_rope_apply_rope_attention_match(fm):
    pos = torch.rand(2, 9) * 50
    assert torch.equal(reference.rope(pos, 128, 10_000), fm.rope(pos, 128, 10_000))
    q, k, v = (_rand(2, 3, 9, 128, dtype=torch.bfloat16, seed=s) for s in range(3))
    pe = reference.make_pe(2, 9, 128)
    assert all(torch.equal(g, w) for g, w in zip(reference.apply_rope(q, k, pe), fm.apply_rope(q, k, pe), strict=True))
    mask = torch.tensor([[1, 1, 0, 1, 1, 1, 1, 1, 1], [1] * 9], dtype=torch.bool)[:, None, None, :].expand(2, 3, 9, 9)
    assert torch.equal(reference.attention(q, k, v, pe, mask), fm.attention(q, k, v, pe, mask))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_modulate_and_gated_residual_match_block_expressions(dtype):
    x, y = _rand(2, 7, 96, dtype=dtype, seed=0), _rand(2, 7, 96, dtype=dtype, seed=1)
    shift, scale, gate = _rand(2, 1, 288, dtype=dtype, seed=2).chunk(3, dim=-1)
    ln = torch.nn.LayerNorm(96, elementwise_affine=False, eps=1e-6)
    assert torch.equal(reference.modulate(x, shift, scale), (1 + scale) * ln(x) + shift)
    assert torch.equal(reference.gated_residual(x, gate, y), x + gate * y)
    res, out = reference.gated_modulate(x, gate, y, shift, scale)  # the double block's residual + norm2 input
    assert torch.equal(res, x + gate * y) and torch.equal(out, (1 + scale) * ln(x + gate * y) + shift)


def _blocks(fm, dtype):
    torch.manual_seed(0)
    model = torch.nn.Module()
    model.double_blocks = torch.nn.ModuleList([fm.DoubleStreamBlock(HIDDEN, HEADS, 4.0, qkv_bias=True)])
    model.single_blocks = torch.nn.ModuleList([fm.SingleStreamBlock(HIDDEN, HEADS, 4.0)])
    for name, p in model.named_parameters():
        p.data = (1 + 0.1 * torch.randn_like(p)) if name.endswith("scale") else 0.05 * torch.randn_like(p)
    return model.to(dtype)


def _run_blocks(model, dtype, with_mask):
    outs = []
    for kind, block in (("double", model.double_blocks[0]), ("single", model.single_blocks[0])):
        args = verify._verify_inputs(block, kind, "cpu", dtype, with_mask)
        wrt = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
        outs += verify._outs_and_grads(block.forward, None, args, wrt)
    return outs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_patched_blocks_with_switches_off_are_sd_scripts_bit_for_bit(fm, dtype):
    model = _blocks(fm, dtype)
    for with_mask in (False, True):
        want = _run_blocks(model, dtype, with_mask)
        ops = patch._ops_of(model)
        assert not (ops.qk_norm_rope or ops.modulate or ops.gated_residual or ops.attention)
        assert "_forward" in model.single_blocks[0].__dict__
        got = _run_blocks(model, dtype, with_mask)
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
        assert patch.remove_kernels(model) == ["patch"]
        assert "_forward" not in model.double_blocks[0].__dict__


def test_every_block_attention_gets_a_contiguous_gradient(fm):
    """PyTorch's cuDNN attention keeps the gradient layout of its first backward at a shape and gives wrong gradients to
    a later call with another layout (flux_kernels.patches.attention.backends.heads_to_tokens); the probe uses a
    contiguous one, so the patched blocks hand every attention backward a contiguous gradient, values unchanged."""
    seen = []

    class Spy(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):
            seen.append(grad.is_contiguous())
            return grad

    def backend(q, k, v, mask):
        return Spy.apply(torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask))

    model = _blocks(fm, torch.float32)
    want = _run_blocks(model, torch.float32, True)
    patch._ops_of(model).attention = backend
    with undoing(lambda: patch.remove_kernels(model)):
        got = _run_blocks(model, torch.float32, True)
    assert seen == [True, True]  # the double block's and the single block's attention
    assert all(torch.allclose(g, w, rtol=1e-5, atol=1e-6) for g, w in zip(got, want, strict=True))


def test_blocks_found_by_attributes_and_gradient_checkpointing_still_wraps(fm, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # CPU without the interpreter: the reference path
    model = _blocks(fm, torch.float32)
    double, single = find_blocks(model)
    assert (len(double), len(single)) == (1, 1)
    assert find_blocks(torch.nn.Sequential(torch.nn.Linear(4, 4))) == ([], [])
    with pytest.raises(ValueError, match="no FLUX double/single-stream blocks"):
        patch.install_block_op(torch.nn.Linear(4, 4), op="modulate")
    patch.install_block_op(model, op="modulate")
    block = model.single_blocks[0]
    block.train()
    block.enable_gradient_checkpointing()
    args = verify._verify_inputs(block, "single", "cpu", torch.float32, False)
    out = block(*args)
    assert out.grad_fn is not None
    patch.remove_kernels(model)
    block.disable_gradient_checkpointing()
    assert torch.equal(out, block(*args))


def _lora_like(linear: torch.nn.Linear, rank: int = 4) -> None:
    """What sd-scripts' LoRAModule.apply_to does: fp32 adapters, the Linear's forward replaced."""
    down = torch.nn.Linear(linear.in_features, rank, bias=False)
    up = torch.nn.Linear(rank, linear.out_features, bias=False)
    org_forward = linear.forward
    linear.forward = lambda x: org_forward(x) + up(down(x))
    linear._adapters = torch.nn.ModuleList([down, up])


def test_verify_holds_fp8_blocks_in_bf16_and_gives_them_back_bit_for_bit(fm, monkeypatch):
    """fp8 base weights are verified held in bf16 (the same math: autocast upcasts them at every matmul, slowly on a
    CPU), then are the same fp8 tensors again; a wrong kernel is still caught."""
    model = _blocks(fm, torch.float8_e4m3fn)
    _lora_like(model.double_blocks[0].img_attn.qkv)
    fp8 = {n: (t, t.data.clone()) for n, t in model.named_parameters() if t.dtype == torch.float8_e4m3fn}
    assert len(fp8) > 10  # every base weight (the adapters are fp32)
    seen = []
    run = verify._verify_block
    monkeypatch.setattr(verify, "_verify_block", lambda b, *a: seen.append(next(b.parameters()).dtype) or run(b, *a))
    patch.install_block_op(model, op="gated_residual")
    assert verify.verify_blocks(model) == [] and seen == [torch.bfloat16, torch.bfloat16]
    for name, p in model.named_parameters():
        if name in fp8:  # the same tensors, fp8 again, the same bits
            assert p is fp8[name][0] and torch.equal(p.view(torch.uint8), fp8[name][1].view(torch.uint8)), name
    model.single_blocks[0]._flux_kernels.gated = lambda x, gate, y: x + gate * y * 1.1
    with pytest.raises(ValueError, match="double-stream block differs from sd-scripts'"):
        verify.verify_blocks(model)
    assert all(model.get_parameter(n).dtype == torch.float8_e4m3fn for n in fp8)  # given back on the error too


def test_verify_runs_bf16_blocks_with_fp32_lora_under_autocast(fm):
    model = _blocks(fm, torch.bfloat16)
    _lora_like(model.double_blocks[0].img_attn.qkv)
    _lora_like(model.single_blocks[0].linear1)
    patch.install_block_op(model, op="gated_residual")
    assert verify.verify_blocks(model) == []  # sd-scripts' forward ran (under autocast) and matched
    model.single_blocks[0]._flux_kernels.gated = lambda x, gate, y: x + gate * y * 1.1  # shared by all blocks
    with pytest.raises(ValueError, match="double-stream block differs from sd-scripts'"):
        verify.verify_blocks(model)


def test_rel_l2_err_is_over_the_whole_tensor_where_max_rel_err_is_one_element():
    from flux_kernels.ops.reference import max_rel_err, rel_l2_err

    want = torch.ones(100, 100)
    assert rel_l2_err(want * 1.01, want) == pytest.approx(0.01, rel=1e-5)  # 1.01 in float32
    got = want.clone()
    got[0, 0] = 2.0  # one element off by 100%
    assert rel_l2_err(got, want) == pytest.approx(0.01, rel=1e-9) and max_rel_err(got, want) == pytest.approx(1.0)
