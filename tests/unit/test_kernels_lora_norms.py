"""lora_grad_norms: the Gram-matrix row norms against the plain product, and against sd-scripts' own
LoRAModule.update_grad_norms on a real LoRA module (skipped with the reason when no sd-scripts checkout)."""

from __future__ import annotations

import importlib.util
import types

import pytest
import torch
from torch import nn

from flux_kernels.ops import fast
from flux_kernels.patches import lora_norms, patch
from flux_kernels.runtime.errors import KernelError
from flux_kernels.runtime.registry import REGISTRY, unchecked


@pytest.fixture(params=["torch", "triton"])
def path(request, monkeypatch):
    """Which side computes the out-sized part: the torch float64 ops, or the Triton kernel (on CPU through Triton's
    interpreter); the test fails if the other one ran."""
    calls = []
    if request.param == "triton":
        if importlib.util.find_spec("triton") is None:
            pytest.skip("triton is not installed: only the torch path can run")
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        launchers, _ = fast._ops_lib()
        original = launchers.gram_row_norms
        monkeypatch.setattr(launchers, "gram_row_norms", lambda *a: calls.append(1) or original(*a))
    yield request.param
    assert bool(calls) == (request.param == "triton"), f"the {request.param} path was not the one used"


SHAPES = [(40, 72, 4, 0.5), (3072, 3072, 16, 1.0), (7, 5, 3, -2.0), (70, 30, 20, 1.0), (33, 20, 40, 0.3)]


@pytest.mark.parametrize("out, inp, r, scale", SHAPES)
def test_gram_norms_equal_the_product(path, out, inp, r, scale):
    gen = torch.Generator().manual_seed(out)
    up, d_up = torch.randn(out, r, generator=gen), torch.randn(out, r, generator=gen) * 1e-3
    down, d_down = torch.randn(r, inp, generator=gen) * 0.1, torch.randn(r, inp, generator=gen) * 1e-2
    got = lora_norms.row_norms(up, down, d_up, d_down, scale)
    want = lora_norms.reference_row_norms(up, down, d_up, d_down, scale)
    assert got.shape == (out, 1) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0)


def test_bf16_factors_are_multiplied_in_fp32(path):
    gen = torch.Generator().manual_seed(1)
    t = [torch.randn(s, generator=gen).bfloat16() for s in ((24, 4), (4, 40), (24, 4), (4, 40))]
    torch.testing.assert_close(lora_norms.row_norms(*t, 0.25), lora_norms.reference_row_norms(*t, 0.25), rtol=1e-5,
                               atol=0)  # fmt: skip


def _model_with_lora(lora_flux, seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(48, 80), nn.GELU(), nn.Linear(80, 32)).requires_grad_(False)
    loras = [lora_flux.LoRAModule(f"lora_unet_{i}", model[i], lora_dim=4, alpha=2) for i in (0, 2)]
    for lo in loras:
        lo.apply_to()
        nn.init.normal_(lo.lora_up.weight, std=0.1)  # sd-scripts starts lora_up at zero: give it a value
    model(torch.randn(6, 48)).square().mean().backward()
    return model, loras


def test_same_norms_as_sd_scripts_update_grad_norms(lora_flux):
    model, loras = _model_with_lora(lora_flux)
    for lo in loras:
        lo.update_grad_norms()  # sd-scripts' own (under CPU autocast: bf16)
    theirs = [lo.grad_norms.float().clone() for lo in loras]
    assert lora_norms.install(model) == (2, 0)
    assert [id(m) for m in lora_norms.lora_modules(model)] == [id(lo) for lo in loras]
    for lo in loras:
        del lo.grad_norms
        lo.update_grad_norms()
    for lo, want in zip(loras, theirs, strict=True):
        assert lo.grad_norms.shape == want.shape == (lo.lora_up.weight.shape[0], 1)
        torch.testing.assert_close(lo.grad_norms, want, rtol=2e-2, atol=1e-6)  # theirs rounded to bf16
        exact = lora_norms.reference_row_norms(lo.lora_up.weight, lo.lora_down.weight, lo.lora_up.weight.grad,
                                               lo.lora_down.weight.grad, lo.scale)  # fmt: skip
        torch.testing.assert_close(lo.grad_norms, exact, rtol=1e-5, atol=0)
    loras[0].eval()
    del loras[0].grad_norms
    loras[0].update_grad_norms()  # not training: nothing computed, as in sd-scripts
    assert not hasattr(loras[0], "grad_norms")


def test_uninstall_gives_sd_scripts_method_back(lora_flux):
    model, loras = _model_with_lora(lora_flux)
    lora_norms.install(model)
    assert "update_grad_norms" in loras[0].__dict__
    assert patch.remove_kernels(model) == ["lora_norms"]
    assert "update_grad_norms" not in loras[0].__dict__
    assert loras[0].update_grad_norms.__func__ is type(loras[0]).update_grad_norms


def test_auto_skips_a_model_without_lora_and_naming_it_is_an_error(lora_flux):
    bare = nn.Sequential(nn.Linear(4, 4))
    sel = unchecked(["lora_grad_norms"])
    with pytest.raises(KernelError, match="no LoRA module"):
        patch.apply_kernels(bare, sel)
    auto = type(sel)(sel.installed, {}, None, sel.specs, explicit=False)
    assert patch.apply_kernels(bare, auto) == []
    assert REGISTRY["lora_grad_norms"].auto_if(_model_with_lora(lora_flux)[0]) == (True, "2 LoRA modules")


def test_conv_lora_is_left_alone():
    class ConvLora(nn.Module):
        def __init__(self, conv):
            super().__init__()
            self.lora_up, self.lora_down = nn.Conv2d(2, 3, 1), nn.Conv2d(3, 2, 1)
            self.scale = 1.0
            conv.forward = self.forward

        def update_grad_norms(self):
            pass

    model = nn.Sequential(nn.Conv2d(3, 3, 1))
    lora = ConvLora(model[0])
    assert lora_norms.install(model) == (0, 1) and "update_grad_norms" not in lora.__dict__


def test_float64_holds_where_the_two_products_nearly_cancel(path):
    """up @ d_down + d_up @ down ~ 1e-3 of either product: float32 (or TF32, which the launcher allows on GPUs and
    which failed the probe on an H200 at 1e-4) loses digits here; the float64 math of both versions does not."""
    gen = torch.Generator().manual_seed(3)
    up, down, noise = (
        torch.randn(64, 8, generator=gen),
        torch.randn(8, 96, generator=gen),
        torch.randn(8, 96, generator=gen),
    )
    d_up, d_down = -up, down + 1e-3 * noise  # up @ d_down + d_up @ down = 1e-3 * up @ noise
    up64, down64, d_up64, d_down64 = (t.double() for t in (up, down, d_up, d_down))
    exact = torch.norm(up64 @ d_down64 + d_up64 @ down64, dim=1, keepdim=True).float()
    torch.testing.assert_close(lora_norms.row_norms(up, down, d_up, d_down, 1.0), exact, rtol=1e-6, atol=0)
    torch.testing.assert_close(lora_norms.reference_row_norms(up, down, d_up, d_down, 1.0), exact, rtol=1e-6, atol=0)


def test_modules_batched_by_shape_each_get_their_own_rows(path):
    """k modules of one shape in one call: each module's rows, in order (the kernel indexes the stacked factors)."""
    gen = torch.Generator().manual_seed(9)
    mods = [[torch.randn(*s, generator=gen) for s in ((50, 6), (6, 30), (50, 6), (6, 30))] for _ in range(3)]
    got = lora_norms.batched_row_norms(*zip(*mods, strict=True), 0.7)
    assert got.shape == (3, 50, 1) and got.dtype == torch.float32
    for i, m in enumerate(mods):
        torch.testing.assert_close(got[i], lora_norms.reference_row_norms(*m, 0.7), rtol=1e-6, atol=0)


def test_a_kernel_that_cannot_compile_here_leaves_the_norms_to_the_torch_ops(monkeypatch, caplog):
    """Triton 3.7 cannot compile the kernel's float64 dots for sm_100 at rank 16: where the kernel fails, the norms
    come from the torch ops, said once in the log, and the kernel is not tried again in the process; asked for
    explicitly (`triton=True`), the failure is raised."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(lora_norms, "_KERNEL_FAILED", False)
    launchers, _ = fast._ops_lib()
    calls = []

    def broken(*args):
        calls.append(1)
        raise RuntimeError("PassManager::run failed")

    monkeypatch.setattr(launchers, "gram_row_norms", broken)
    gen = torch.Generator().manual_seed(2)
    mods = [[torch.randn(*s, generator=gen) for s in ((20, 4), (4, 12), (20, 4), (4, 12))] for _ in range(2)]
    with caplog.at_level("WARNING", logger="flux_kernels.patches.lora_norms"):
        first = lora_norms.batched_row_norms(*zip(*mods, strict=True), 0.5)
        second = lora_norms.batched_row_norms(*zip(*mods, strict=True), 0.5)
    assert calls == [1] and torch.equal(first, second)
    assert [r.message for r in caplog.records if "failed" in r.message] == [
        "lora_grad_norms: the Triton kernel failed on cpu (RuntimeError: PassManager::run failed); the float64 torch "
        "ops compute the norms instead"
    ]
    for i, m in enumerate(mods):
        torch.testing.assert_close(first[i], lora_norms.reference_row_norms(*m, 0.5), rtol=1e-6, atol=0)
    with pytest.raises(RuntimeError, match="PassManager"):
        lora_norms.batched_row_norms(*zip(*mods, strict=True), 0.5, triton=True)


def test_the_probe_rejects_a_wrong_kernel(monkeypatch):
    """The registry probe runs the Triton path where Triton runs: a kernel that drops the scale is rejected."""
    from tests.conftest import probe_with_broken_launcher

    def scale_one(original):
        return lambda ups, d_ups, gram, scale: original(ups, d_ups, gram, 1.0)

    result = probe_with_broken_launcher(monkeypatch, "lora_grad_norms", "gram_row_norms", scale_one)
    assert not result.ok, result


class FakeLora(nn.Module):
    """What lora_norms recognises of sd-scripts' LoRAModule (no checkout needed): the factors, the scale, the
    replaced forward and an `update_grad_norms` of its own."""

    def __init__(self, linear: nn.Linear, r: int, scale: float):
        super().__init__()
        self.lora_down = nn.Linear(linear.in_features, r, bias=False)
        self.lora_up = nn.Linear(r, linear.out_features, bias=False)
        nn.init.normal_(self.lora_up.weight, std=0.1)
        self.scale, self.org_forward = scale, linear.forward
        linear.forward = self.forward

    def forward(self, x):
        return self.org_forward(x) + self.lora_up(self.lora_down(x)) * self.scale

    def update_grad_norms(self):
        raise AssertionError("the installed version must be called")


def _fake_model(seed=0):
    """Four LoRA layers in three groups: two share a shape and scale, one has that shape with another scale."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(24, 24), nn.Linear(24, 24), nn.Linear(24, 24), nn.Linear(24, 40)).requires_grad_(
        False
    )
    loras = [FakeLora(model[i], 4, s) for i, s in enumerate((0.5, 0.5, 2.0, 0.5))]
    return model, loras


def _backward(model, seed=1):
    model(torch.randn(5, 24, generator=torch.Generator().manual_seed(seed))).square().mean().backward()


def _exact(lo):
    w = (lo.lora_up.weight, lo.lora_down.weight, lo.lora_up.weight.grad, lo.lora_down.weight.grad)
    return lora_norms.reference_row_norms(*w, lo.scale)


def _count_bmm(fn) -> int:
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += func is torch.ops.aten.bmm.default
            return func(*args, **(kwargs or {}))

    with Count():
        fn()
    return Count.n


def test_all_modules_computed_together_per_shape_without_autograd_history():
    model, loras = _fake_model()
    assert lora_norms.install(model) == (4, 0)
    _backward(model)
    bmm = _count_bmm(lambda: [lo.update_grad_norms() for lo in loras])  # as sd-scripts' network does
    assert bmm == 2 * 3  # two bmm per (shape, scale) group, not per module
    for lo in loras:
        assert lo.grad_norms.grad_fn is None and not lo.grad_norms.requires_grad  # sd-scripts runs it under no_grad
        torch.testing.assert_close(lo.grad_norms, _exact(lo), rtol=1e-5, atol=0)


def test_new_or_changed_gradients_are_never_served_stale():
    model, loras = _fake_model()
    lora_norms.install(model)
    _backward(model)
    first = [lo.update_grad_norms() or lo.grad_norms.clone() for lo in loras]
    assert _count_bmm(loras[2].update_grad_norms) == 0  # same gradients: the row computed with the others
    loras[1].lora_up.weight.grad.mul_(3)  # changed in place (accumulation, clipping)
    loras[1].lora_down.weight.grad.mul_(3)
    loras[1].update_grad_norms()
    torch.testing.assert_close(loras[1].grad_norms, 3 * first[1], rtol=1e-5, atol=0)
    for lo in loras:
        lo.lora_up.weight.grad = lo.lora_down.weight.grad = None  # zero_grad(set_to_none=True), next step
    _backward(model, seed=2)
    for lo, old in zip(loras, first, strict=True):
        lo.update_grad_norms()
        torch.testing.assert_close(lo.grad_norms, _exact(lo), rtol=1e-5, atol=0)
        assert not torch.allclose(lo.grad_norms, old)


def test_modules_not_training_or_without_gradients_are_left_alone():
    model, loras = _fake_model()
    lora_norms.install(model)
    loras[0].eval()
    _backward(model)
    loras[3].lora_up.weight.grad = None
    for lo in loras:
        lo.update_grad_norms()
    assert not hasattr(loras[0], "grad_norms") and not hasattr(loras[3], "grad_norms")
    for lo in loras[1:3]:
        torch.testing.assert_close(lo.grad_norms, _exact(lo), rtol=1e-5, atol=0)


class Network(nn.Module):
    """A LoRA network object as sd-scripts' LoRANetwork has it: module lists and a per-step `grad_norms()` (here
    LoRANetwork's own method where the checkout is importable, else the same contract written out)."""

    def __init__(self, loras, method=None):
        super().__init__()
        self.text_encoder_loras, self.unet_loras = [], list(loras)
        if method is not None:
            self.grad_norms = types.MethodType(method, self)

    def grad_norms(self):
        norms = [
            m.grad_norms.mean(dim=0) for m in self.text_encoder_loras + self.unet_loras if hasattr(m, "grad_norms")
        ]
        return torch.stack(norms) if norms else None


def _count_ops(fn) -> int:
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += not func.is_view
            return func(*args, **(kwargs or {}))

    with Count():
        fn()
    return Count.n


def _network_case(method):
    model, loras = _fake_model()
    order = [loras[3], loras[0], loras[2], loras[1]]  # the network's order is not the shape groups' order
    network = Network(order, method)
    assert lora_norms.install(model) == (4, 0)
    _backward(model)
    for lo in order:
        lo.update_grad_norms()  # sd-scripts' network.update_norms()
    want = network.grad_norms()
    want_ops = _count_ops(network.grad_norms)
    assert lora_norms.install_network(network) and not lora_norms.install_network(network)
    got = network.grad_norms()
    assert got.shape == want.shape == (4, 1)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    assert _count_ops(network.grad_norms) <= 3 < want_ops  # a cat and a gather, not a mean per module
    return model, order, network


@pytest.mark.parametrize("reference", ["contract", "sd-scripts"])
def test_the_networks_grad_norms_come_from_the_batched_norms(reference, request):
    method = None
    if reference == "sd-scripts":
        method = request.getfixturevalue("lora_flux").LoRANetwork.grad_norms
    model, order, network = _network_case(method)
    for lo in order:
        lo.lora_up.weight.grad = lo.lora_down.weight.grad = None
    _backward(model, seed=2)
    for lo in order:
        lo.update_grad_norms()
    fresh = torch.stack([lo.grad_norms.mean(dim=0) for lo in order])
    torch.testing.assert_close(network.grad_norms(), fresh, rtol=1e-6, atol=0)  # the next step's, not the first's
    order[2].grad_norms = order[2].grad_norms * 2  # set by something else: served by the original method
    torch.testing.assert_close(network.grad_norms()[2], order[2].grad_norms.mean(dim=0), rtol=1e-6, atol=0)
    assert lora_norms.uninstall_network(network) and not lora_norms.uninstall_network(network)
    if method is None:
        assert "grad_norms" not in network.__dict__  # the class's method again
    else:
        assert network.grad_norms.__func__ is method


def test_a_network_without_patched_modules_is_left_alone():
    _model, loras = _fake_model()
    network = Network(loras)
    assert not lora_norms.install_network(network)  # lora_norms.install never ran on these modules
    assert "grad_norms" not in network.__dict__


@pytest.mark.parametrize("ggpo", [False, True])
def test_the_networks_weight_norm_loops_run_over_the_modules_with_ggpo(fm, lora_flux, ggpo):
    """sd-scripts' own LoRANetwork on a tiny FLUX: update_norms / weight_norms / combined_weight_norms give what its
    loops over every module give (GGPO: every module's norms; without: None), through loops over GGPO's modules."""
    from tests.conftest import tiny_flux

    model = tiny_flux(fm, depth=1, depth_single_blocks=1).requires_grad_(False)
    options = {"ggpo_beta": "0.01", "ggpo_sigma": "0.03"} if ggpo else {}
    network = lora_flux.create_network(1.0, 4, 4, None, [None, None], model, **options)
    network.apply_to([], model, apply_text_encoder=False, apply_unet=True)
    gen = torch.Generator().manual_seed(0)
    for p in network.parameters():
        p.data = 0.05 * torch.randn(p.shape, generator=gen)

    def norms():
        network.update_norms()
        return network.weight_norms(), network.combined_weight_norms()

    want = norms()
    assert lora_norms.install_norm_loops(network) == (len(network.unet_loras) if ggpo else 0)
    assert lora_norms.install_norm_loops(network) is None
    got = norms()
    for p in network.parameters():
        p.data.mul_(1.5)  # the next step's weights: the installed loops compute them afresh
    got_next = norms()
    assert lora_norms.uninstall_norm_loops(network) and not lora_norms.uninstall_norm_loops(network)
    assert not any(name in network.__dict__ for name in lora_norms.NORM_LOOPS)  # the class's methods again
    want_next = norms()
    rows = (len(network.unet_loras), 1)
    for g, w in zip(got + got_next, want + want_next, strict=True):
        assert (g.shape == rows and torch.equal(g, w)) if ggpo else (g is None and w is None)
    if ggpo:
        assert not torch.equal(got[0], got_next[0])
