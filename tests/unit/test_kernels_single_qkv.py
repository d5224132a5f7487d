"""single_qkv and double_qkv: the blocks' q/k/v (+ the single block's GELU) with a written-out backward, against
sd-scripts' ops.

Both backwards are tested: the torch one (what runs where Triton does not) and the Triton kernels (on CPU through
Triton's interpreter, switched on only inside the `backward` fixture)."""

from __future__ import annotations

import functools
import importlib.util
import re

import pytest
import torch

from flux_kernels.ops import fast, reference
from flux_kernels.patches import patch, single_qkv, verify
from flux_kernels.patches.single_qkv import reference_double_qkv, reference_single_qkv
from flux_kernels.runtime import registry
from tests.conftest import undoing

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


@pytest.fixture(params=["torch", "triton"])
def backward(request, monkeypatch):
    """Which backward single_qkv takes; the test fails if it took the other one."""
    calls = []
    original = single_qkv._triton_backward
    monkeypatch.setattr(single_qkv, "_triton_backward", lambda *a: calls.append(1) or original(*a))
    if request.param == "torch":
        monkeypatch.setattr(single_qkv, "triton_backward_problem", lambda *a: "the torch backward, asked for")
    else:
        if importlib.util.find_spec("triton") is None:
            pytest.skip("triton is not installed: only the torch backward can run")
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    yield request.param
    assert bool(calls) == (request.param == "triton"), f"the {request.param} backward was not the one used"


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


@pytest.mark.parametrize("gelu_in_kernel", [False, True], ids=["gelu_torch", "gelu_kernel"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [dict(), dict(B=1, H=2, D=64, L=5, mlp=8)], ids=["flux_head", "odd"])
def test_forward_is_sd_scripts_op_for_op_and_the_backward_agrees(backward, dtype, shape, gelu_in_kernel):
    args = inputs(dtype, **shape)
    fast_fn = functools.partial(single_qkv.single_qkv, gelu_in_kernel=gelu_in_kernel)
    (want, dwant), (got, dgot) = outs_and_grads(reference_single_qkv, args), outs_and_grads(fast_fn, args)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    (g,), (w,) = dgot, dwant
    assert g.shape == w.shape and g.dtype == w.dtype
    # every part of linear1's gradient: q, k (the written-out RMSNorm/RoPE backward), v, and the MLP input
    width = args[-1]
    head = width // 3
    for part in (slice(0, head), slice(head, 2 * head), slice(2 * head, width), slice(width, None)):
        assert reference.max_rel_err(g[..., part], w[..., part]) <= TOL[dtype], part


def double_inputs(dtype, B=2, H=3, D=128, lt=4, li=9, seed=0, scale_grad=False):
    gen = torch.Generator().manual_seed(seed)
    streams = []
    for L in (lt, li):
        qkv = (torch.randn(B, L, 3 * H * D, generator=gen) * 2 + 0.3).to(dtype).requires_grad_()
        scales = [(torch.rand(D, generator=gen) + 0.5).to(dtype).requires_grad_(scale_grad) for _ in range(2)]
        streams += [qkv, *scales]
    return *streams, reference.make_pe(B, lt + li, D, generator=gen), H


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [dict(), dict(B=1, H=2, D=64, lt=6, li=3)], ids=["flux_head", "odd"])
def test_double_forward_is_sd_scripts_op_for_op_and_the_backward_agrees(backward, dtype, shape):
    args = double_inputs(dtype, **shape)
    (want, dwant), (got, dgot) = outs_and_grads(reference_double_qkv, args), outs_and_grads(single_qkv.double_qkv, args)
    assert len(got) == 3 and all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    assert len(dgot) == 2  # txt's and img's qkv output; each part of each: q, k (RMSNorm/RoPE backward), v
    width = args[0].shape[-1] // 3
    for g, w in zip(dgot, dwant, strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype
        for part in (slice(0, width), slice(width, 2 * width), slice(2 * width, None)):
            assert reference.max_rel_err(g[..., part], w[..., part]) <= TOL[dtype], part


@pytest.mark.parametrize("op", ["single", "double"])
def test_norm_scales_that_train_take_the_reference_with_their_gradients(op):
    if op == "single":
        fn, ref, args = single_qkv.single_qkv, reference_single_qkv, inputs(torch.float32, scale_grad=True)
    else:
        fn, ref, args = single_qkv.double_qkv, reference_double_qkv, double_inputs(torch.float32, scale_grad=True)
    (_, dwant), (_, dgot) = outs_and_grads(ref, args), outs_and_grads(fn, args)
    assert len(dgot) == (3 if op == "single" else 6) and all(
        torch.equal(g, w) for g, w in zip(dgot, dwant, strict=True)
    )


@pytest.mark.parametrize("op", ["single_qkv", "double_qkv"])
def test_the_probe_accepts_it_and_rejects_a_wrong_backward(backward, monkeypatch, op):
    spec = registry.REGISTRY[op]
    assert registry.probe(spec, "cpu").ok

    if backward == "torch":

        def no_mean_term(d_out, x, rrms, scale):  # RMSNorm's gradient without the normalisation's own part
            return (rrms * d_out.float() * scale.float()).to(x.dtype)

        monkeypatch.setattr(single_qkv, "_rms_norm_backward", no_mean_term)
    else:
        launchers, _ = fast._ops_lib()
        original = launchers.single_qkv_bwd

        def scales_swapped(dq, dk, dv, lin1, rq, rk, q_scale, k_scale, pe, out, d_act=None):
            return original(dq, dk, dv, lin1, rq, rk, k_scale, q_scale, pe, out, d_act)

        monkeypatch.setattr(launchers, "single_qkv_bwd", scales_swapped)
    result = registry.probe(spec, "cpu")
    assert not result.ok and "gradient 0" in result.reason


def test_the_triton_backward_reads_the_strides_it_gets(monkeypatch):
    """Traced code may hand the launcher other layouts than eager code (the custom op's layout is flexible):
    q, k, v's gradients laid out [B, L, H, D], as the attention backward gives them, and lin1 a slice of a wider
    buffer. The launcher writes q, k, v's columns; the MLP's are the caller's."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    lin1, q_scale, k_scale, pe, heads, width = inputs(torch.float32, B=2, H=2, D=64, L=6, mlp=24)
    lin1 = torch.cat((lin1.detach(), torch.randn(*lin1.shape[:2], 5)), -1)[..., : lin1.shape[-1]]
    B, L, _ = lin1.shape
    gen = torch.Generator().manual_seed(3)
    grads = [torch.randn(B, L, heads, width // 3 // heads, generator=gen).permute(0, 2, 1, 3) for _ in range(3)]
    q, k, _ = reference.heads(lin1[..., :width], heads)
    rq, rk = (torch.rsqrt(t.float().pow(2).mean(-1, keepdim=True) + single_qkv.EPS) for t in (q, k))
    launchers, _ = fast._ops_lib()
    got = torch.full_like(lin1, float("nan"))
    launchers.single_qkv_bwd(*grads, lin1, rq, rk, q_scale, k_scale, pe, got)
    with torch.enable_grad():
        x = lin1.clone().requires_grad_()
        outs = reference_single_qkv(x, q_scale, k_scale, pe, heads, width)
        want = torch.autograd.grad(outs[:3], x, grads)[0]
    assert got.shape == want.shape
    assert reference.max_rel_err(got[..., :width], want[..., :width]) <= TOL[torch.float32]


def test_a_wrong_gelu_gradient_in_the_kernel_fails_the_probe(monkeypatch):
    """The probe runs single_qkv with GELU's gradient in the kernel: a kernel that drops GELU's tanh term is caught."""
    from tests.conftest import probe_with_broken_launcher

    def half_derivative(d_act, x, out):  # 0.5 * (1 + tanh(.)) only: the x * sech² part forgotten
        inner = 0.7978845608028654 * (x.float() + 0.044715 * x.float() ** 3)
        out.copy_(d_act.float() * 0.5 * (1 + torch.tanh(inner)))

    result = probe_with_broken_launcher(monkeypatch, "single_qkv", "_gelu_bwd", lambda original: half_derivative)
    assert not result.ok and "gradient 0" in result.reason


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernels_gelu_gradient_reads_a_column_slice(monkeypatch, dtype):
    """GELU's incoming gradient arrives as a column slice of linear2's input gradient ([attention, MLP]) and linear1's
    MLP columns as a slice of its output: the launcher writes aten's gelu_backward (tanh) into out's MLP columns,
    and q, k, v's columns from their gradients, leaving nothing unwritten."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    lin1, q_scale, k_scale, pe, heads, width = inputs(dtype, B=2, H=2, D=64, L=6, mlp=1100)  # two column tiles
    lin1 = lin1.detach()
    B, L, W = lin1.shape
    gen = torch.Generator().manual_seed(5)
    grads = [torch.randn(B, heads, L, width // 3 // heads, generator=gen).to(dtype) for _ in range(3)]
    d_lin2_in = torch.randn(B, L, 96 + W - width, generator=gen).to(dtype)  # [attention's 96 columns, MLP's]
    d_act = d_lin2_in[..., 96:]
    q, k, _ = reference.heads(lin1[..., :width], heads)
    rq, rk = (torch.rsqrt(t.float().pow(2).mean(-1, keepdim=True) + single_qkv.EPS) for t in (q, k))
    launchers, _ = fast._ops_lib()
    got = torch.full_like(lin1, float("nan"))
    launchers.single_qkv_bwd(*grads, lin1, rq, rk, q_scale, k_scale, pe, got, d_act)
    want = torch.ops.aten.gelu_backward(d_act.float(), lin1[..., width:].float(), approximate="tanh")
    assert not got.isnan().any()
    assert reference.max_rel_err(got[..., width:], want) <= {torch.float32: 1e-6, torch.bfloat16: 4e-3}[dtype]
    with pytest.raises(ValueError, match="d_act must be shaped"):
        launchers.single_qkv_bwd(*grads, lin1, rq, rk, q_scale, k_scale, pe, got, d_act[..., 1:])


def test_traced_code_calls_the_custom_op_on_the_gradients_as_they_come(monkeypatch):
    """Dynamo shows traced tensors to Python as plain Tensors: fast._kernel must still give it the custom op, or
    dynamo traces into the launcher and bakes the strides it saw into the graph. And the backward must not ask a
    tensor for its strides, or dynamo rewrites it to copy every gradient contiguous first: q's gradient here comes
    laid out [B, L, H, D] (through a permute), as the attention backward gives it in the blocks."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    from torch._dynamo.backends.common import aot_autograd

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    backward_graphs = []
    backend = aot_autograd(fw_compiler=lambda gm, _: gm, bw_compiler=lambda gm, _: backward_graphs.append(gm) or gm)
    args = inputs(torch.float32, B=1, L=5)

    def permuted_q(*a):
        q, k, v, act = single_qkv.single_qkv(*a)
        return q.permute(0, 2, 1, 3) * 1.5, k, v, act

    def permuted_q_reference(*a):
        q, k, v, act = reference_single_qkv(*a)
        return q.permute(0, 2, 1, 3) * 1.5, k, v, act

    fast._ops_lib()  # registered before tracing, as the probe does in training (registering traced breaks the graph)
    torch._dynamo.reset()
    with undoing(torch._dynamo.reset):
        (_, want), (_, got) = (
            outs_and_grads(permuted_q_reference, args),
            outs_and_grads(torch.compile(permuted_q, backend=backend), args),
        )
    code = "\n".join(gm.code for gm in backward_graphs)
    assert "flux_kernels.single_qkv_bwd" in code and "triton_kernel_wrapper" not in code, code
    assert "aten.clone" not in code, code
    # functionalization bans a mutation through as_strided on a view (pytorch issue 104505): an H100 compile
    # once failed on it here, so GELU's columns are written through a plain slice
    assert "as_strided" not in code, code
    assert reference.max_rel_err(got[0], want[0]) <= TOL[torch.float32]


def _compiled_backward(monkeypatch, mlp_out, fast_fn=single_qkv.single_qkv) -> str:
    """A single block's q/k/v + GELU (`fast_fn`) with `mlp_out(act)` after it, compiled with inductor (Triton through
    the interpreter): its gradient checked against the reference's; returns the backward's generated code."""
    from torch._inductor.utils import run_and_get_code

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    lin1, q_scale, k_scale, pe, heads, width = inputs(torch.float32, B=1, L=5)

    def block(fn, x):
        q, k, v, act = fn(x, q_scale, k_scale, pe, heads, width)
        return q, k, v, mlp_out(act)

    fast._ops_lib()  # registered before tracing, as the probe does in training (registering traced breaks the graph)
    torch._dynamo.reset()
    with undoing(torch._dynamo.reset), torch._inductor.config.patch(fx_graph_cache=False):
        compiled = torch.compile(functools.partial(block, fast_fn))
        (_, got), codes = run_and_get_code(outs_and_grads, compiled, (lin1,))
    _, want = outs_and_grads(functools.partial(block, reference_single_qkv), (lin1,))
    assert reference.max_rel_err(got[0], want[0]) <= TOL[torch.float32]
    return next(c for c in codes if "single_qkv_bwd.default(" in c)


def test_inductor_writes_gelus_gradient_into_the_kernels_buffer(monkeypatch):
    """The Triton kernel writes q, k, v's columns of linear1's gradient into a buffer; GELU's columns go into the
    same buffer, computed by inductor's own kernel (fused with whatever makes GELU's incoming gradient: here a
    sum, as the LoRA's in training) before the kernel runs. Assigned after the kernel, inductor would instead
    build a new buffer and copy the kernel's columns over (its functional slice_scatter): the buffer handed to
    the kernel must be the one the compiled backward returns."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    w = torch.randn(7, 40, generator=torch.Generator().manual_seed(4))
    backward = _compiled_backward(monkeypatch, lambda act: act @ w.t() + act @ (0.5 * w).t())  # a sum of two
    buffer = re.search(r"single_qkv_bwd\.default\(.*, (\w+)\)", backward).group(1)
    returned = re.search(r"\n\s*return \((.*)\)", backward).group(1)
    assert re.search(rf"\b{buffer}\b", returned), backward


def test_with_gelu_in_the_kernel_inductor_writes_no_gelu_pass(monkeypatch):
    """GELU's incoming gradient out of one GEMM (linear2 mirror-folded): with gelu_in_kernel the compiled backward
    hands it to the custom op as it comes, and inductor emits no GELU pass of its own (which wrote the buffer's
    full width, q/k/v's columns too, before the kernel wrote those again)."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    w = torch.randn(7, 40, generator=torch.Generator().manual_seed(4))
    fast_fn = functools.partial(single_qkv.single_qkv, gelu_in_kernel=True)
    backward = _compiled_backward(monkeypatch, lambda act: act @ w.t(), fast_fn)
    call = re.search(r"single_qkv_bwd\.default\((.*)\)", backward).group(1)
    depth, args = 0, 1  # the call's top-level arguments
    for ch in call:
        depth += (ch in "([") - (ch in ")]")
        args += ch == "," and depth == 0
    assert args == 11, call  # d_act passed (as a view of the GEMM's output: no copy)
    assert "gelu" not in backward.lower(), backward


def _single_block_model(fm, dtype, act=None):
    from tests.conftest import flux_block_pair

    model = flux_block_pair(fm, hidden=256, heads=2, std=0.05).to(dtype).requires_grad_(False)  # frozen, as in LoRA
    if act is not None:
        model.single_blocks[0].mlp_act = act
    return model


def _run(model, dtype, kind="single"):
    block = (model.single_blocks if kind == "single" else model.double_blocks)[0]
    args = verify._verify_inputs(block, kind, "cpu", dtype, True)
    wrt = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    return verify._outs_and_grads(block.forward, None, args, wrt)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["single", "double"])
def test_patched_block_matches_sd_scripts(fm, backward, dtype, kind):
    model = _single_block_model(fm, dtype)
    want = _run(model, dtype, kind)
    op = f"{kind}_qkv"
    assert patch.install_block_op(model, op=op) == f"{op}: 1 double + 1 single blocks"
    with undoing(lambda: patch.remove_kernels(model)):
        calls = []
        original = single_qkv._QKV.apply
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(single_qkv._QKV, "apply", lambda *a: calls.append(1) or original(*a))
            got = _run(model, dtype, kind)
            assert calls == [1]  # the block went through it
            assert _run(model, dtype, "double" if kind == "single" else "single") and calls == [1]  # only this kind
        n_outs = 1 if kind == "single" else 2
        assert all(torch.equal(g, w) for g, w in zip(got[:n_outs], want[:n_outs], strict=True))  # same ops, order
        assert all(reference.max_rel_err(g, w) <= TOL[dtype] for g, w in zip(got, want, strict=True))
        assert verify.verify_blocks(model) == []


@pytest.mark.parametrize("checkpointed", [False, True])
@pytest.mark.parametrize("kind", ["single", "double"])
def test_checkpointed_blocks_keep_the_torch_backward(fm, monkeypatch, checkpointed, kind):
    """The Triton backward measured slower in checkpointed blocks (the vram24 tier): there a single block takes
    single_qkv's torch backward and a double block sd-scripts' own ops, with the same gradients."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed: the torch backward is the only one, so there is no choice to check")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    triton_calls, qkv_calls = [], []
    triton_backward, apply = single_qkv._triton_backward, single_qkv._QKV.apply
    monkeypatch.setattr(single_qkv, "_triton_backward", lambda *a: triton_calls.append(1) or triton_backward(*a))
    monkeypatch.setattr(single_qkv._QKV, "apply", lambda *a: qkv_calls.append(1) or apply(*a))
    model = _single_block_model(fm, torch.float32)
    block = (model.single_blocks if kind == "single" else model.double_blocks)[0].train()
    block.gradient_checkpointing = checkpointed
    want = _run(model, torch.float32, kind)
    patch.install_block_op(model, op=f"{kind}_qkv")
    with undoing(lambda: patch.remove_kernels(model)):
        got = _run(model, torch.float32, kind)
    assert bool(triton_calls) != checkpointed
    assert bool(qkv_calls) == (kind == "single" or not checkpointed)
    assert all(reference.max_rel_err(g, w) <= TOL[torch.float32] for g, w in zip(got, want, strict=True))


def test_a_block_whose_linear2_is_mirror_folded_takes_gelus_gradient_in_the_kernel(fm, lora_flux, backward):
    """With lora_fold's mirror fold on linear2 (sd-scripts' LoRA, A below W), GELU's incoming gradient is one GEMM's
    output: the single block asks single_qkv for GELU's gradient in the Triton kernel; without the fold it does
    not. Either way the block's outputs and gradients (input and LoRA factors) are sd-scripts' own."""
    from flux_kernels.patches import lora_fold

    model = _single_block_model(fm, torch.float32)
    block = model.single_blocks[0].train()
    loras = []
    for name in ("linear1", "linear2"):
        lora = lora_flux.LoRAModule(f"lora_unet_single_{name}", getattr(block, name), lora_dim=4, alpha=2)
        lora.apply_to()
        torch.nn.init.normal_(lora.lora_up.weight, std=0.2, generator=torch.Generator().manual_seed(len(loras)))
        loras.append(lora)
    factors = [p for lo in loras for p in (lo.lora_down.weight, lo.lora_up.weight)]
    args = verify._verify_inputs(block, "single", "cpu", torch.float32, True)
    wrt = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad] + factors

    def run():  # through the module's __call__: lora_fold's pre-hook moves the weights into their buffers
        return verify._outs_and_grads(block, None, args, wrt)

    want = run()
    flags = []
    apply = single_qkv._QKV.apply
    patch.install_block_op(model, op="single_qkv")
    with undoing(lambda: patch.remove_kernels(model), lambda: lora_fold.uninstall(block)):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(single_qkv._QKV, "apply", lambda *a: flags.append(a[4]) or apply(*a))
            unfolded = run()
            assert lora_fold.install(block) == 2 and lora_fold.folded_down(block.linear2)
            assert not lora_fold.folded_down(block.linear1)
            folded = run()
    assert flags == [False, True]
    assert not lora_fold.folded_down(block.linear2)
    for got in (unfolded, folded):
        assert all(reference.max_rel_err(g, w) <= 1e-5 for g, w in zip(got, want, strict=True))


def test_double_blocks_hand_attention_token_major_q_k_v(fm, monkeypatch, tmp_path):
    """Without double_qkv, the double block concatenates its streams' q, k, v token-major ([B, L, H, D] in memory,
    as the single blocks' are), so attention's output comes out token-major and its tokens form needs no copy: the
    same values as sd-scripts' torch.cat(dim=2), outputs and input gradients as sd-scripts' block."""
    monkeypatch.setenv("FLUX_KERNELS_CACHE", str(tmp_path / "attention.json"))
    model = _single_block_model(fm, torch.float32)
    want = _run(model, torch.float32, "double")
    seen = []
    attend = patch.BlockOps.attend
    monkeypatch.setattr(
        patch.BlockOps, "attend", lambda self, q, k, v, m: seen.append((q, k, v)) or attend(self, q, k, v, m)
    )
    patch.install_block_op(model, op="attention")
    with undoing(lambda: patch.remove_kernels(model)):
        got = _run(model, torch.float32, "double")
    (q, k, v), *_ = seen
    B, H, L, D = q.shape
    for t in (q, k, v):
        assert t.stride(1) == D and t.stride(2) == H * D, t.stride()
    assert all(reference.max_rel_err(g, w) <= TOL[torch.float32] for g, w in zip(got, want, strict=True))
    parts = [torch.randn(2, 3, n, 4) for n in (2, 5)]
    assert torch.equal(patch.cat_tokens(parts), torch.cat(parts, dim=2))


def test_a_block_with_another_activation_keeps_its_own_ops(fm):
    model = _single_block_model(fm, torch.float32, act=torch.nn.GELU())  # exact GELU: not what single_qkv computes
    want = _run(model, torch.float32)
    patch.install_block_op(model, op="single_qkv")
    with undoing(lambda: patch.remove_kernels(model)):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(single_qkv._QKV, "apply", lambda *a: pytest.fail("used with an exact GELU"))
            got = _run(model, torch.float32)
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


def test_it_is_not_one_of_the_fused_triton_ops_for_compile_blocks(fm):
    from flux_kernels.patches import compile_blocks

    model = _single_block_model(fm, torch.float32)
    patch.install_block_op(model, op="single_qkv")
    with undoing(lambda: patch.remove_kernels(model)):
        assert compile_blocks._fused_ops(model.single_blocks) == []  # no TRACED note, no RNG variant forced
