"""fp8 frozen matmuls (flux_kernels.patches.fp8) on CPU: torch._scaled_mm runs here too, so the real kernel path is
compared with the upcast reference forward and backward, installed into sd-scripts' blocks under its LoRA, and
selected by `auto` only on an fp8 base. Speed is the GPU's business (tests/gpu, scripts/bench_kernels.py)."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from flux_kernels.ops.reference import saved_bytes
from flux_kernels.patches import fp8, patch, verify
from flux_kernels.runtime import applies, registry
from flux_kernels.runtime.errors import KernelError
from flux_kernels.runtime.registry import FP8_TOLERANCE, REGISTRY, KernelSpec, Selection, probe
from tests.conftest import cpu_row_scales, flux_block_pair, undoing

HIDDEN, HEADS = 256, 2

pytestmark = pytest.mark.skipif(
    not cpu_row_scales(), reason="this torch's CPU _scaled_mm takes no per-row scales, which these CPU tests need"
)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def _weights(kind: str, n: int, k: int, gen) -> tuple[torch.Tensor, torch.Tensor | None]:
    w = torch.randn(n, k, generator=gen) * 0.05
    return (w.to(fp8.E4M3), None) if kind == "fp8_base" else fp8.quantize_weight(w)


@pytest.mark.parametrize("kind", ["fp8_base", "quantized"])
@pytest.mark.parametrize(("m", "k", "n"), [(37, 64, 96), (512, 3072, 3072), (77, 256, 1040)])
def test_fp8_linear_matches_the_upcast_reference_forward_and_backward(kind, m, k, n):
    gen = torch.Generator().manual_seed(m + k + n)
    w8, scale = _weights(kind, n, k, gen)
    x = (torch.randn(2, m, k, generator=gen) + 0.1).bfloat16().requires_grad_()
    bias = (torch.randn(n, generator=gen) * 0.1).bfloat16()
    dy = torch.randn(2, m, n, generator=gen).bfloat16()
    results = []
    for fn in (fp8.reference_linear, fp8.fp8_linear):
        y = fn(x, w8, scale, bias)
        (dx,) = torch.autograd.grad(y, x, dy)
        results.append((y, dx))
    (y_ref, dx_ref), (y, dx) = results
    assert (y.shape, y.dtype, dx.dtype) == (y_ref.shape, torch.bfloat16, torch.bfloat16)
    assert _rel(y, y_ref) <= FP8_TOLERANCE
    assert _rel(dx, dx_ref) <= FP8_TOLERANCE
    # fp8 really happened: the activations were rounded to 3 mantissa bits, so it is not bit-equal either
    assert not torch.equal(y, y_ref)


def test_fp8_linear_follows_autocast_like_f_linear():
    gen = torch.Generator().manual_seed(1)
    w8, scale = _weights("quantized", 32, 48, gen)
    x = torch.randn(5, 48, generator=gen)  # fp32 activations (LayerNorm output under autocast)
    assert fp8.fp8_linear(x, w8, scale).dtype == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, y_ref = fp8.fp8_linear(x, w8, scale), fp8.reference_linear(x, w8, scale)
    assert y.dtype == y_ref.dtype == torch.bfloat16
    assert _rel(y, y_ref) <= FP8_TOLERANCE


def test_traced_by_torch_compile_the_quantisation_is_left_for_inductor_to_fuse():
    """Under torch.compile the activations are quantised by plain ops in the graph (fused by inductor with their
    producer) and fp8_mm_quantized multiplies; the result is the eager path's, bit for bit, forward and backward
    (AOT autograd, as inductor sees it, without needing a compiler here)."""
    gen = torch.Generator().manual_seed(3)
    w8, scale = _weights("quantized", 96, 64, gen)
    bias = (torch.randn(96, generator=gen) * 0.1).bfloat16()
    x = (torch.randn(2, 37, 64, generator=gen) + 0.1).bfloat16().requires_grad_()
    dy = torch.randn(2, 37, 96, generator=gen).bfloat16()

    def f(x):
        return torch.nn.functional.gelu(fp8.fp8_linear(torch.nn.functional.gelu(x), w8, scale, bias))

    graphs = []

    def capture(gm, _inputs):
        graphs.append(str(gm.graph))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(f, backend=capture, fullgraph=True)(x)
    assert "fp8_mm_quantized" in graphs[0] and "amax" in graphs[0] and "fp8_mm.default" not in graphs[0]
    results = []
    for fn in (f, torch.compile(f, backend="aot_eager", fullgraph=True)):
        y = fn(x)
        results.append((y, *torch.autograd.grad(y, x, dy)))
    (y_eager, dx_eager), (y, dx) = results
    assert torch.equal(y, y_eager) and torch.equal(dx, dx_eager)
    torch._dynamo.reset()


def test_quantising_in_the_graph_keeps_nothing_more_for_backward(monkeypatch):
    """The quantised activations (x8, its scales) feed only the forward matmul: AOT autograd must not keep them for
    backward. Bytes kept per forward, compiled, with the quantisation in the graph and inside the op: equal."""
    gen = torch.Generator().manual_seed(4)
    w8, scale = _weights("quantized", 96, 64, gen)
    x = (torch.randn(2, 37, 64, generator=gen) + 0.1).bfloat16().requires_grad_()

    def f(x):
        return fp8.fp8_linear(torch.nn.functional.gelu(x), w8, scale)

    def kept(in_graph: bool) -> int:
        monkeypatch.setattr(fp8, "QUANTIZE_IN_GRAPH", in_graph)
        torch._dynamo.reset()
        return saved_bytes(torch.compile(f, backend="aot_eager", fullgraph=True), (x,), also_skip=(w8, scale))

    with undoing(torch._dynamo.reset):
        in_op, in_graph = kept(False), kept(True)
    assert in_graph == in_op < x.numel()  # the row scales of the weight at most: no activation-sized tensor


def test_the_environment_chooses_how_tensors_are_quantised():
    assert fp8.quantize_mode_from({}) == "wide" and fp8.quantize_in_graph_from({}) is True
    assert fp8.quantize_in_graph_from({"FLUX_KERNELS_FP8_QUANTIZE": " Op"}) is False
    assert fp8.quantize_in_graph_from({"FLUX_KERNELS_FP8_QUANTIZE": "graph"}) is True
    assert fp8.quantize_mode_from({"FLUX_KERNELS_FP8_QUANTIZE": "Kernel "}) == "kernel"
    with pytest.raises(ValueError, match="FLUX_KERNELS_FP8_QUANTIZE='fused': expected one of graph, op, kernel, wide"):
        fp8.quantize_mode_from({"FLUX_KERNELS_FP8_QUANTIZE": "fused"})


@pytest.mark.parametrize("mode", ["kernel", "wide"])
def test_compiled_graphs_quantise_through_the_kernel_where_the_mode_says(monkeypatch, mode):
    """Two fp8 Linears, 64 -> 96 -> 48, compiled. FLUX_KERNELS_FP8_QUANTIZE=kernel: the forward and backward graphs
    AOT autograd hands inductor quantise every tensor through flux_kernels::quantize_rows, leaving no amax for
    inductor to fuse. wide (here with rows wider than 80 counted wide): only the 96-wide rows, the hidden
    activation forward and its gradient backward, while the 64-wide input and the 48-wide output gradient stay plain
    ops in the graph. The results are the eager path's, bit for bit."""
    from torch._dynamo.backends.common import aot_autograd

    gen = torch.Generator().manual_seed(5)
    (w1, s1), (w2, s2) = _weights("quantized", 96, 64, gen), _weights("quantized", 48, 96, gen)
    x = (torch.randn(2, 37, 64, generator=gen) + 0.1).bfloat16().requires_grad_()
    dy = torch.randn(2, 37, 48, generator=gen).bfloat16()

    def f(x):
        return fp8.fp8_linear(torch.nn.functional.gelu(fp8.fp8_linear(x, w1, s1)), w2, s2)

    graphs = []

    def capture(gm, _inputs):
        graphs.append(str(gm.graph))
        return gm.forward

    monkeypatch.setattr(fp8, "QUANTIZE", mode)
    monkeypatch.setattr(fp8, "QUANTIZE_IN_GRAPH", mode == "wide")
    monkeypatch.setattr(fp8, "WIDE_ROWS", 80)
    torch._dynamo.reset()
    results = []
    for fn in (f, torch.compile(f, backend=aot_autograd(fw_compiler=capture, bw_compiler=capture), fullgraph=True)):
        y = fn(x)
        results.append((y, *torch.autograd.grad(y, x, dy)))
    torch._dynamo.reset()
    (y_eager, dx_eager), (y, dx) = results
    assert torch.equal(y, y_eager) and torch.equal(dx, dx_eager)
    assert len(graphs) == 2  # forward, backward
    for g in graphs:
        ops = g.count("target=torch.ops.flux_kernels.quantize_rows.default]")
        assert (ops, "amax" in g) == ((2, False) if mode == "kernel" else (1, True)), g


def test_quantize_rows_keeps_each_rows_range_and_a_zero_row():
    x = torch.tensor([[1.0, -2.0, 0.5], [0.0, 0.0, 0.0], [1e-3, 3e-3, -4e-3]])
    x8, s = fp8.quantize_rows(x)
    assert x8.dtype == fp8.E4M3 and s.shape == (3, 1)
    back = x8.float() * s
    assert torch.isfinite(back).all()
    assert back.abs().amax(dim=1).tolist() == pytest.approx([2.0, 0.0, 4e-3], rel=1e-6)  # amax is exact
    assert _rel(back[2], x[2]) < 0.07


def test_the_probe_passes_fp8_and_rejects_a_kernel_that_forgets_the_weight_scale():
    spec = REGISTRY["fp8_matmul"]
    result = probe(spec, "cpu")
    assert result.ok, result.reason
    assert 0 < result.max_err <= FP8_TOLERANCE

    def no_scale(x, w8, scale, bias=None):
        return fp8.fp8_linear(x, w8, None, bias)

    broken = KernelSpec("fp8_broken", "test", spec.applies, spec.install, spec.reference, no_scale, spec.example,
                        dtypes=spec.dtypes, tolerance=spec.tolerance)  # fmt: skip
    verdict = probe(broken, "cpu")
    assert not verdict.ok and "probe failed vs reference" in verdict.reason


def test_where_fp8_applies():
    ada = {"type": "cuda", "name": "NVIDIA GeForce RTX 4090", "capability": [8, 9]}
    ampere = {"type": "cuda", "name": "NVIDIA A100", "capability": [8, 0]}
    blackwell = {"type": "cuda", "name": "NVIDIA GeForce RTX 5090", "capability": [12, 0]}
    assert applies.fp8_applies(ada)[0] and applies.fp8_applies(blackwell)[0]
    ok, why = applies.fp8_applies(ampere)
    assert not ok and "sm_89" in why
    assert not applies.fp8_applies("cpu")[0]


# ---- installed into sd-scripts' blocks, under sd-scripts' own LoRA ----------------------------------------------


def _blocks_with_lora(fm, lora_flux, weight_dtype):
    model = flux_block_pair(fm, HIDDEN, HEADS, std=0.05)
    torch.manual_seed(1)
    loras = []
    for name, lin in [*model.double_blocks[0].named_modules(), *model.single_blocks[0].named_modules()]:
        if isinstance(lin, torch.nn.Linear):
            lora = lora_flux.LoRAModule(f"lora_{name}", lin, multiplier=1.0, lora_dim=4, alpha=4)
            lora.apply_to()
            torch.nn.init.normal_(lora.lora_up.weight, std=0.05)  # not zero, so the adapters matter in the check
            loras.append(lora)
    model.requires_grad_(False)
    model.to(weight_dtype)
    return model, torch.nn.ModuleList(loras)


def _run_blocks(model, loras, seed=0):
    block = model.double_blocks[0]
    args = verify._verify_inputs(block, "double", "cpu", torch.bfloat16, with_mask=False)
    single_args = verify._verify_inputs(model.single_blocks[0], "single", "cpu", torch.bfloat16, with_mask=False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        img, txt = block(*args[:4])
        out = model.single_blocks[0](torch.cat([txt, img], dim=1), *single_args[1:4])
        gen = torch.Generator().manual_seed(seed)
        loss = (out.float() * torch.randn(out.shape, generator=gen)).sum()
    grads = torch.autograd.grad(loss, [p for p in loras.parameters()])
    return out.detach(), grads


@pytest.mark.parametrize("weights", ["fp8_base", "bf16_quantized"])
def test_installed_in_sd_scripts_blocks_under_lora_matches_and_uninstalls(fm, lora_flux, weights):
    model, loras = _blocks_with_lora(fm, lora_flux, fp8.E4M3 if weights == "fp8_base" else torch.bfloat16)
    if weights == "bf16_quantized":  # the reference for a quantised base is the dequantised base
        w_ref = {n: p.detach().clone() for n, p in model.named_parameters()}
    want, dwant = _run_blocks(model, loras)
    line = patch.install_fp8(model, quantize=weights == "bf16_quantized")
    assert "fp8_matmul: 10 Linear layers of 1 double + 1 single blocks" in line
    # the routing went through LoRA's org_forward: the adapters still run (their gradients are not zero)
    assert all(isinstance(lora.org_forward, fp8.Fp8Forward) for lora in loras if "mod" not in lora.lora_name)
    got, dgot = _run_blocks(model, loras)
    if weights == "bf16_quantized":
        assert model.double_blocks[0].img_attn.qkv.weight.dtype == fp8.E4M3
        assert model.double_blocks[0].img_mod.lin.weight.dtype == torch.bfloat16  # modulation stays as it was
        deq = {n: p for n, p in model.named_parameters()}
        assert _rel(deq["single_blocks.0.linear1.weight"].float(), w_ref["single_blocks.0.linear1.weight"]) > 0
    assert _rel(got, want) <= 2 * FP8_TOLERANCE  # two blocks of fp8 roundings
    for g, w in zip(dgot, dwant, strict=True):
        assert g.abs().sum() > 0
        assert _rel(g, w) <= 2 * FP8_TOLERANCE
    assert patch.remove_kernels(model) == ["fp8"]
    again, _ = _run_blocks(model, loras)
    if weights == "fp8_base":
        assert torch.equal(again, want)  # back to sd-scripts' upcast path, bit for bit


def test_quantised_weights_scales_move_with_the_model(fm, lora_flux):
    """sd-scripts installs the kernels into a model on the CPU and moves it to the GPU afterwards: the row scales
    must go with it (a scale left on the CPU meant a host copy and a sync per fp8 matmul, and no CUDA graphs)."""
    model, loras = _blocks_with_lora(fm, lora_flux, torch.bfloat16)
    keys = set(model.state_dict())
    patch.install_fp8(model, quantize=True)
    linears = [lin for _, lin in fp8.block_linears([*model.double_blocks, *model.single_blocks])]
    assert len(linears) == 10
    assert all(lin._buffers[fp8.SCALE].dtype == torch.float32 for lin in linears)
    assert set(model.state_dict()) == keys  # not written into a saved model
    lin = model.single_blocks[0].linear2
    x = torch.randn(3, lin.in_features)
    before = fp8.Fp8Forward(lin)(x)
    lin._buffers[fp8.SCALE].mul_(2)  # the forward reads the module's scales: doubled scales, doubled product
    assert _rel(fp8.Fp8Forward(lin)(x) - lin.bias, 2 * (before - lin.bias)) <= FP8_TOLERANCE
    model.to("meta")  # stands in for the move to the GPU: every tensor of the module goes, the scales too
    assert all(lin._buffers[fp8.SCALE].device.type == "meta" for lin in linears)


def test_made_on_the_device_stays_there_unless_the_model_swaps_blocks(fm, lora_flux, monkeypatch):
    """Quantised weights, their scales and kept transposes stay where they were made when the model moves there next
    (copying them back to the host took 12 s of a FLUX start); with block swap they go back (sd-scripts keeps some
    blocks on the host). "meta" stands in for the GPU here; tests/gpu moves a model for real."""
    model, _ = _blocks_with_lora(fm, lora_flux, torch.bfloat16)
    patch.install_fp8(model, quantize=True, device=torch.device("meta"), keep_transposed=True)
    linears = [lin for _, lin in fp8.block_linears([*model.double_blocks, *model.single_blocks])]
    assert len(linears) == 10
    assert all(t.device.type == "meta" for lin in linears for t in (lin.weight, *lin._buffers.values()))
    assert all(lin.weight.dtype == fp8.E4M3 and set(lin._buffers) == {fp8.SCALE, fp8.TRANSPOSED} for lin in linears)
    seen = []
    monkeypatch.setattr(fp8, "install", lambda blocks, **kw: seen.append(kw["stay"]) or (1, 0, ""))
    model, _ = _blocks_with_lora(fm, lora_flux, torch.bfloat16)
    patch.install_fp8(model, quantize=True)
    model.blocks_to_swap = 2
    patch.install_fp8(model, quantize=True)
    model.blocks_to_swap = None  # sd-scripts' value when it does not swap
    patch.install_fp8(model, quantize=True)
    assert seen == [True, False, True]


def test_a_kept_transpose_gives_the_same_bits_and_is_what_the_input_gradient_reads():
    gen = torch.Generator().manual_seed(7)
    w8, scale = _weights("quantized", 96, 64, gen)
    x = (torch.randn(37, 64, generator=gen) + 0.1).bfloat16().requires_grad_()
    dy = torch.randn(37, 96, generator=gen).bfloat16()
    w8_t = fp8.transpose(w8)
    assert w8_t.shape == (64, 96) and w8_t.is_contiguous()
    runs = []
    for kept in (None, w8_t, torch.zeros_like(w8_t)):  # the last: a kept transpose of zeros
        y = fp8.fp8_linear(x, w8, scale, None, kept)
        runs.append((y, *torch.autograd.grad(y, x, dy)))
    (y, dx), (y_kept, dx_kept), (y_zero, dx_zero) = runs
    assert torch.equal(y_kept, y) and torch.equal(dx_kept, dx)  # the same bytes, so the same result
    assert torch.equal(y_zero, y)  # the forward never reads it
    assert dx.abs().sum() > 0 and dx_zero.abs().sum() == 0  # the input gradient does, instead of transposing w8


def test_installed_with_kept_transposes_matches_and_uninstall_frees_them(fm, lora_flux):
    model, loras = _blocks_with_lora(fm, lora_flux, torch.bfloat16)
    keys = set(model.state_dict())
    patch.install_fp8(model, quantize=True)
    want, dwant = _run_blocks(model, loras)
    patch.remove_kernels(model)
    line = patch.install_fp8(model, keep_transposed=True)  # the weights are fp8 now: used as stored
    assert "transposes kept for the input gradient" in line
    linears = [lin for _, lin in fp8.block_linears([*model.double_blocks, *model.single_blocks])]
    assert all(torch.equal(lin._buffers[fp8.TRANSPOSED], lin.weight.t()) for lin in linears)
    assert set(model.state_dict()) == keys  # not written into a saved model
    got, dgot = _run_blocks(model, loras)
    assert torch.equal(got, want)
    assert all(torch.equal(g, w) for g, w in zip(dgot, dwant, strict=True))
    assert patch.remove_kernels(model) == ["fp8"]
    assert not any(fp8.TRANSPOSED in lin._buffers for lin in linears)


def test_auto_takes_fp8_only_on_an_fp8_base_and_a_named_request_quantises(fm, lora_flux, caplog):
    spec = REGISTRY["fp8_matmul"]
    auto = Selection(("fp8_matmul",), specs=(spec,), explicit=False)
    named = Selection(("fp8_matmul",), specs=(spec,), explicit=True)
    model, _ = _blocks_with_lora(fm, lora_flux, torch.bfloat16)
    with caplog.at_level(logging.INFO, logger="flux_kernels.patches.patch"):
        assert patch.apply_kernels(model, auto) == []
    assert "kernel fp8_matmul skipped: the base weights are not fp8" in caplog.text
    assert model.single_blocks[0].linear1.weight.dtype == torch.bfloat16
    before = sum(p.numel() * p.element_size() for p in model.parameters())
    tokenwise = sum(lin.weight.numel() for _, lin in fp8.block_linears([*model.double_blocks, *model.single_blocks]))
    assert patch.apply_kernels(model, named) == ["fp8_matmul"]
    after = sum(p.numel() * p.element_size() for p in model.parameters())
    assert after == before - tokenwise  # 1 byte instead of 2 per token-wise weight: the bf16 copies were released
    fp8_model, _ = _blocks_with_lora(fm, lora_flux, fp8.E4M3)
    assert patch.apply_kernels(fp8_model, auto) == ["fp8_matmul"]


def test_kernels_fp8_without_checkpointing_skips_the_lora_fold(fm, lora_flux, caplog):
    """kernels=fp8 (auto, fp8_matmul named) on a bf16 base without checkpointing: lora_fold, from auto, is judged
    after fp8_matmul has taken its layers, so it is skipped with a log line. It was judged before, then failed to
    install: `kernels=fp8` at memory=vram80 exited 2 (H200, 2026-11-22)."""
    specs = tuple(REGISTRY[n] for n in ("fp8_matmul", "lora_fold"))
    selection = Selection(("fp8_matmul", "lora_fold"), specs=specs, explicit=False, named=("fp8_matmul",))
    model, _ = _blocks_with_lora(fm, lora_flux, torch.bfloat16)
    assert applies.has_wide_lora(model)[0]  # on the bf16 model the fold applies
    with caplog.at_level(logging.INFO, logger="flux_kernels.patches.patch"):
        assert patch.apply_kernels(model, selection) == ["fp8_matmul"]
    assert "kernel lora_fold skipped: no plain LoRA" in caplog.text
    model, _ = _blocks_with_lora(fm, lora_flux, torch.bfloat16)
    both = dataclasses.replace(selection, named=("fp8_matmul", "lora_fold"))
    with pytest.raises(KernelError, match="lora_fold"):  # named, the fold is insisted on: an error
        patch.apply_kernels(model, both)


def test_nothing_eligible_is_an_error_naming_why(fm, lora_flux):
    with pytest.raises(ValueError, match="no FLUX double/single-stream blocks"):
        patch.install_fp8(torch.nn.Linear(4, 4))
    model, _ = _blocks_with_lora(fm, lora_flux, torch.bfloat16)
    with pytest.raises(KernelError, match="none of the 10 block Linear layers qualify"):
        patch.install_fp8(model, quantize=False)


@pytest.mark.parametrize(
    ("overrides", "want"),
    [
        (["memory=vram80"], True),  # no checkpointing: memory is not traded for speed
        (["memory=vram48"], False),
        (["memory=vram24"], False),
        (["memory=vram16"], False),  # block swap moves the weights
        (["memory=vram48", "kernels.fp8_keep_transposed=true"], True),
        (["memory=vram80", "kernels.fp8_keep_transposed=false"], False),
    ],
)
def test_where_the_transposes_are_kept_and_the_runner_passes_it_on(compose, monkeypatch, overrides, want):
    from flux_trainer.plan import fp8_keep_transposed_decision
    from flux_trainer.sdscripts import hooks

    decision = fp8_keep_transposed_decision(compose("+dataset=mychar", *overrides))
    assert decision is want
    seen = {}
    monkeypatch.setattr(registry, "select", lambda *a, **k: registry.Selection(("fp8_matmul",)))
    monkeypatch.setattr(patch, "apply_kernels", lambda unet, selection, options, seconds: seen.update(options) or ["x"])
    hooks.install_kernels(None, {"set": "fp8", "fp8_keep_transposed": decision}, "cuda")
    assert seen["fp8_matmul"] == {"keep_transposed": want}


def test_a_bad_keep_transposed_value_is_an_error(compose):
    from flux_trainer.config import ConfigError
    from flux_trainer.plan import fp8_keep_transposed_decision

    with pytest.raises(ConfigError, match="kernels.fp8_keep_transposed=sometimes: choose auto, true or false"):
        fp8_keep_transposed_decision(compose("+dataset=mychar", "kernels.fp8_keep_transposed=sometimes"))
