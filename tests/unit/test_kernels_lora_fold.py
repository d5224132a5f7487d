"""flux_kernels.patches.lora_fold: a LoRA factor folded into the frozen GEMM (B beside W on widening layers, A below W
on narrowing ones), against sd-scripts' form (the plain composition, and sd-scripts' own LoRAModule where a checkout is
importable): forward and every gradient on fresh random inputs, installed into a model (only widening and narrowing
layers), the factors synced after an optimizer step, under autocast and torch.compile, uninstall."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from flux_kernels.ops.reference import max_rel_err
from flux_kernels.patches import lora_fold, lora_norms, patch
from flux_kernels.runtime import applies, registry
from flux_kernels.runtime.errors import KernelError
from tests.conftest import undoing


def _inputs(dtype, m=37, k=24, n=160, r=4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(3, m, k, generator=gen).to(dtype).requires_grad_()
    w = (torch.randn(n, k, generator=gen) * k**-0.5).to(dtype)
    bias = (torch.randn(n, generator=gen) * 0.1).to(dtype)
    a = (torch.randn(r, k, generator=gen) * k**-0.5).to(dtype).requires_grad_()
    b = (torch.randn(n, r, generator=gen) * 0.3).to(dtype).requires_grad_()
    return x, w, bias, a, b


def _outs_and_grads(fn, x, w, bias, a, b, s):
    for t in (x, a, b):
        t.grad = None
    y = fn(x, w, bias, a, b, s)
    y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(7)).to(y.dtype))
    return [y.detach()] + [t.grad.clone() for t in (x, a, b)]


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.float64, 1e-12), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize(("fast", "k", "n"), [(lora_fold.fast_linear, 24, 160), (lora_fold.fast_down_linear, 160, 24)])
def test_folded_matches_sd_scripts_form_forward_and_backward(dtype, tol, bias, fast, k, n):
    x, w, b0, a, b = _inputs(dtype, k=k, n=n)
    b0 = b0 if bias else None
    want = _outs_and_grads(lora_fold.reference_linear, x, w, b0, a, b, 0.75)
    got = _outs_and_grads(fast, x, w, b0, a, b, 0.75)
    for g, r in zip(got, want, strict=True):
        assert g.shape == r.shape and max_rel_err(g, r) <= tol


def test_the_input_gradient_is_added_in_place_into_the_gemms_output():
    """dx = dx₀ + s·(dY @ B) @ A is written into the first K columns of dY @ [W, B] (no copy of dx₀ first): dx comes
    back as that view, with the values of the out-of-place sum, and dh is s·(dY @ B)."""
    gen = torch.Generator().manual_seed(11)
    dy, w, b, a = (torch.randn(*s, generator=gen) for s in ((37, 160), (160, 24), (160, 4), (4, 24)))
    wb = torch.cat([w, b], dim=1)
    dx, dh = lora_fold.input_grad(dy, wb, a, 0.75)
    assert dx.shape == (37, 24) and dx.stride() == (28, 1)  # a view of the [37, 28] product
    torch.testing.assert_close(dh, 0.75 * (dy @ b))
    torch.testing.assert_close(dx, dy @ w + (0.75 * (dy @ b)) @ a, rtol=1e-5, atol=1e-5)


def test_compiled_backward_takes_the_input_gradient_op_and_no_addmm(monkeypatch, torch_config):
    """Traced, the backward calls the custom op (inductor would otherwise turn the in-place add on a view back into
    an addmm that copies its input, and a scatter), with the gradients of compiled and eager code equal."""
    from torch._inductor.utils import run_and_get_code

    torch_config(torch._inductor.config, fx_graph_cache=False)
    x, w, bias, a, b = _inputs(torch.float32)
    want = _outs_and_grads(lora_fold.fast_linear, x, w, bias, a, b, 0.75)
    torch._dynamo.reset()
    with undoing(torch._dynamo.reset):
        compiled = torch.compile(lora_fold.fast_linear)
        got, codes = run_and_get_code(_outs_and_grads, compiled, x, w, bias, a, b, 0.75)
    _assert_close(got, want, 1e-5)
    backward = next(c for c in codes if "lora_fold_input_grad" in c)
    assert "addmm" not in backward, backward


def _no_lora_in_dx_up(backward):
    def wrong(ctx, dy):
        dx, *rest = backward(ctx, dy)
        return (dy @ ctx.saved_tensors[1][:, : ctx.k], *rest)  # drops dh @ A from the input gradient

    return wrong


def _no_lora_in_dx_down(backward):
    def wrong(ctx, dy):
        dx, *rest = backward(ctx, dy)
        _, _, wa, b = ctx.saved_tensors
        return (dy @ wa[: b.shape[0]], *rest)  # drops s·dY @ B @ A from the input gradient

    return wrong


@pytest.mark.parametrize(("fn", "wrong"), [(lora_fold.FoldedLoRA, _no_lora_in_dx_up),
                                           (lora_fold.FoldedDown, _no_lora_in_dx_down)])  # fmt: skip
def test_the_probe_passes_and_a_wrong_backward_fails_it(monkeypatch, fn, wrong):
    assert registry.probe(registry.REGISTRY["lora_fold"], "cpu").ok
    monkeypatch.setattr(fn, "backward", staticmethod(wrong(fn.backward)))
    result = registry.probe(registry.REGISTRY["lora_fold"], "cpu")
    assert not result.ok and "gradient" in result.reason


class Lora(nn.Module):
    """sd-scripts' LoRAModule as flux_kernels sees it (lora_down/up, scale, multiplier, org_forward, dropouts None),
    with its forward: org + up(down(x)) * multiplier * scale."""

    def __init__(self, linear: nn.Linear, r: int = 4, alpha: float = 2.0, up_std: float = 0.2):
        super().__init__()
        device = linear.weight.device  # fp32 factors beside the layer, as sd-scripts keeps them
        self.lora_down = nn.Linear(linear.in_features, r, bias=False, device=device)
        self.lora_up = nn.Linear(r, linear.out_features, bias=False, device=device)
        nn.init.normal_(self.lora_up.weight, std=up_std)
        self.scale, self.multiplier = alpha / r, 1.0
        self.dropout = self.rank_dropout = self.module_dropout = None
        self.org_forward = linear.forward
        linear.forward = self.forward

    def forward(self, x):
        return self.org_forward(x) + self.lora_up(self.lora_down(x)) * self.multiplier * self.scale

    def update_grad_norms(self):
        pass


def _model(seed=0, make=Lora):
    """A widening layer (16 -> 112, B folded), a narrowing one (112 -> 16, A folded), like linear1 / linear2, and one
    neither (16 -> 24, not folded)."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 112), nn.GELU(), nn.Linear(112, 16), nn.Linear(16, 24)).requires_grad_(False)
    loras = [make(model[0]), make(model[2]), make(model[3])]
    return model, loras


def _train_step(model, loras, x):
    for lo in loras:
        lo.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_()
    y = model(x)
    y.square().mean().backward()
    return [y.detach(), x.grad] + [p.grad for lo in loras for p in (lo.lora_down.weight, lo.lora_up.weight)]


def _pair(make=Lora):
    plain, plain_loras = _model(make=make)
    model, loras = copy.deepcopy((plain, plain_loras))
    return (plain, plain_loras), (model, loras)


def _assert_close(got, want, tol):
    for g, w in zip(got, want, strict=True):
        assert max_rel_err(g, w) <= tol


def test_installed_on_widening_and_narrowing_layers_and_trains_like_sd_scripts_form():
    (plain, plain_loras), (model, loras) = _pair()
    assert lora_fold.install(model) == 2
    assert lora_fold.sides(model) == {"up": 1, "down": 1}
    for i in (0, 2):
        assert model[i].forward.__self__ is loras[i // 2] and "forward" in model[i].__dict__
    assert model[3].forward.__self__ is loras[2]  # 16 -> 24 keeps the LoRA's own forward
    assert lora_norms.lora_modules(model) == loras  # still found by the other LoRA kernels
    x = torch.randn(5, 7, 16, generator=torch.Generator().manual_seed(3))
    opt_a = torch.optim.SGD([p for lo in plain_loras for p in lo.parameters()], lr=0.5)
    opt_b = torch.optim.SGD([p for lo in loras for p in lo.parameters()], lr=0.5)
    for _ in range(3):  # the optimizer changes B between steps: the buffer must follow
        _assert_close(_train_step(model, loras, x), _train_step(plain, plain_loras, x), 1e-5)
        opt_a.step()
        opt_b.step()
    wb, wa = getattr(model[0], lora_fold.BUFFER), getattr(model[2], lora_fold.BUFFER)
    # [W; A] with zero rows up to DOWN_ROWS: its GEMM's output is a width inductor leaves unpadded (dense, so
    # activation_offload takes it where a checkpointed block keeps it)
    assert wb.shape == (112, 16 + 4) and wa.shape == (lora_fold.DOWN_ROWS, 112) and lora_fold.DOWN_ROWS >= 16 + 4
    assert torch.count_nonzero(wa[16 + 4 :]) == 0
    for lin, buf in ((model[0], wb), (model[2], wa)):  # one copy of W
        assert lin.weight.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()
    b_slot, a_slot = wb[:, 16:], wa[16:20]
    assert not torch.equal(b_slot, loras[0].lora_up.weight.detach())  # B moved on since the last forward
    assert not torch.equal(a_slot, loras[1].lora_down.weight.detach())  # and A
    model(x)
    assert torch.equal(b_slot, loras[0].lora_up.weight.detach())  # the next forward brings them in
    assert torch.equal(a_slot, loras[1].lora_down.weight.detach())
    with torch.no_grad():  # factors changed outside an optimizer step (a loaded LoRA, max-norm scaling): synced too
        for lo in (loras, plain_loras):
            lo[0].lora_up.weight.mul_(2)
            lo[1].lora_down.weight.mul_(-1)
    _assert_close(_train_step(model, loras, x), _train_step(plain, plain_loras, x), 1e-5)


def test_compact_lays_every_frozen_weight_out_anew_and_trains_the_same(monkeypatch):
    """`compact` (the first re-homing on a CUDA device) re-homes the folded weights and copies every other frozen
    weight into new storage under the same Parameter object; trainable LoRA factors stay where they are."""
    monkeypatch.setattr(lora_fold, "COMPACT_MIN", 0)  # the test's weights are all small
    monkeypatch.setattr(lora_fold, "COMPACT_CHUNK", 1)  # a release after every weight (a no-op on CPU)
    (plain, plain_loras), (model, loras) = _pair()
    lora_fold.install(model)
    folds = model.__dict__[lora_fold.ATTR][1]
    frozen = {name: (p, p.data_ptr(), p.detach().clone()) for name, p in model.named_parameters()}
    lora_ptrs = [p.data_ptr() for lo in loras for p in lo.parameters()]
    assert lora_fold.compact(model, folds) == 4  # the folded layers' biases, model[3]'s weight and bias
    for name, (param, ptr, values) in frozen.items():
        now = dict(model.named_parameters())[name]
        assert torch.equal(now, values) and now.data_ptr() != ptr, name
        assert now is param or name in ("0.weight", "2.weight"), name  # the folded weights: views of their buffers
    for lin in (model[0], model[2]):
        assert lin.weight.untyped_storage().data_ptr() == getattr(lin, lora_fold.BUFFER).untyped_storage().data_ptr()
    assert [p.data_ptr() for lo in loras for p in lo.parameters()] == lora_ptrs
    x = torch.randn(5, 7, 16, generator=torch.Generator().manual_seed(3))
    _assert_close(_train_step(model, loras, x), _train_step(plain, plain_loras, x), 1e-5)


def test_compact_lets_each_old_weight_go_at_its_turn(monkeypatch):
    """A re-homed weight's old Parameter is not kept alive while the later ones are laid out (it was: the whole
    model's folded weights twice at the first step, +10.9 GiB on the H200)."""
    import weakref

    monkeypatch.setattr(lora_fold, "COMPACT_MIN", 0)
    (_, _), (model, _) = _pair()
    lora_fold.install(model)
    folds = model.__dict__[lora_fold.ATTR][1]
    old = [weakref.ref(f.linear.weight) for f in folds]
    alive_at_turn = []
    rehome = lora_fold._Fold.rehome

    def watched(self):
        alive_at_turn.append([r() is not None for r in old])
        rehome(self)

    monkeypatch.setattr(lora_fold._Fold, "rehome", watched)
    lora_fold.compact(model, folds)
    # (in address order) at the second's turn the first's old weight is gone
    assert alive_at_turn[0] == [True, True] and sorted(alive_at_turn[1]) == [False, True]
    assert [r() for r in old] == [None, None]


def test_a_cpu_model_is_re_homed_without_moving_the_other_weights():
    (_, _), (model, _) = _pair()
    lora_fold.install(model)
    ptr = model[3].weight.data_ptr()
    model(torch.randn(2, 16))
    assert model[3].weight.data_ptr() == ptr and hasattr(model[0], lora_fold.BUFFER)


def test_under_cpu_autocast_as_sd_scripts_trains():
    (plain, plain_loras), (model, loras) = _pair()
    lora_fold.install(model)
    x = torch.randn(4, 9, 16, generator=torch.Generator().manual_seed(4))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, want = _train_step(model, loras, x), _train_step(plain, plain_loras, x)
    assert got[0].dtype == want[0].dtype
    _assert_close(got, want, 3e-2)


def test_compiled_model_matches_eager():
    (plain, plain_loras), (model, loras) = _pair()
    lora_fold.install(model)
    compiled = torch.compile(model)
    x = torch.randn(3, 5, 16, generator=torch.Generator().manual_seed(5))
    _assert_close(_train_step(compiled, loras, x), _train_step(plain, plain_loras, x), 1e-5)


def test_what_is_not_folded():
    model, loras = _model()
    loras[0].dropout = 0.1
    assert [lin for lin, _ in lora_fold.candidates(model)] == [model[2]]  # the widening layer has dropout
    loras[1].rank_dropout = 0.1
    assert lora_fold.candidates(model) == []  # the narrowing one too, and 16 -> 24 is neither
    model, loras = _model()
    for i in (0, 2):
        model[i].weight.data = model[i].weight.data.to(torch.float8_e4m3fn)
    assert lora_fold.candidates(model) == []  # fp8 weights belong to fp8_matmul
    assert not applies.has_wide_lora(model)[0]
    with pytest.raises(KernelError, match="lora_fold"):
        patch.install_lora_fold(model)
    model, loras = _model()
    assert applies.has_wide_lora(model) == (True, "2 LoRA Linear layers with out >= 4x in or in >= 4x out")
    # FLUX: linear1 (7x) and the double blocks' mlp.0 (4x) widen, linear2 and mlp.2 narrow; q/k/v (3x) is neither
    shapes = ((3072, 21504), (3072, 12288), (15360, 3072), (3072, 9216))
    sides = [lora_fold.side(nn.Linear(k, n, device="meta")) for k, n in shapes]
    assert sides == ["up", "up", "down", None]
    model.gradient_checkpointing = True  # sd-scripts' FLUX model says so after enable_gradient_checkpointing()
    ok, why = applies.has_wide_lora(model)
    assert not ok and "checkpointing" in why  # auto leaves it out there; named, it still installs:
    assert patch.install_lora_fold(model).startswith("lora_fold: 2 LoRA Linear layers (1 with B, 1 with A")
    model, loras = _model()
    model.blocks_to_swap = 4  # sd-scripts' enable_block_swap
    assert "block swap" in applies.has_wide_lora(model)[1]
    with pytest.raises(KernelError, match="block swap"):
        patch.install_lora_fold(model)
    block = nn.Module()  # FLUX's modulation layers are as wide (3072 -> 18432) but see one row per image
    block.img_mod, block.modulation = nn.Module(), nn.Module()
    block.img_mod.lin, block.modulation.lin, block.linear1 = nn.Linear(16, 112), nn.Linear(16, 112), nn.Linear(16, 112)
    block.requires_grad_(False)
    for lin in (block.img_mod.lin, block.modulation.lin, block.linear1):
        Lora(lin)
    assert [lin for lin, _ in lora_fold.candidates(block)] == [block.linear1]


def test_uninstall_gives_the_loras_forward_back():
    (plain, plain_loras), (model, loras) = _pair()
    lora_fold.install(model)
    x = torch.randn(2, 3, 16)
    _train_step(model, loras, x)
    assert patch.remove_kernels(model) == ["lora_fold"]
    assert model[0].forward.__func__ is type(loras[0]).forward and lora_fold.ATTR not in model.__dict__
    _assert_close(_train_step(model, loras, x), _train_step(plain, plain_loras, x), 1e-5)


def test_sd_scripts_lora_module_folded_trains_the_same(lora_flux):
    def make(linear):
        lora = lora_flux.LoRAModule(f"lora_unet_{id(linear)}", linear, multiplier=0.8, lora_dim=4, alpha=2)
        lora.apply_to()
        nn.init.normal_(lora.lora_up.weight, std=0.2)
        return lora

    (plain, plain_loras), (model, loras) = _pair(make)
    assert lora_fold.install(model) == 2
    x = torch.randn(2, 6, 16, generator=torch.Generator().manual_seed(6))
    _assert_close(_train_step(model, loras, x), _train_step(plain, plain_loras, x), 1e-5)
