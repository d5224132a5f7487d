"""flux_kernels on a real GPU: every kernel forward+backward against its reference at FLUX.1 shapes (1 x 24 heads
x (512 + 4096) tokens x 128, hidden 3072) and at odd shapes, in bf16; the registry's probes; the attention
choice at the real shape; sd-scripts blocks patched, verified and compiled, with gradient checkpointing, and what
they keep for backward against sd-scripts' own compiled blocks. Skipped without CUDA."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from flux_kernels.ops import fast, reference
from flux_kernels.ops.reference import saved_bytes
from flux_kernels.patches import fp8, patch
from flux_kernels.patches.attention.backends import without_cudnn
from flux_kernels.patches.attention.probe import chosen, probe_attention
from flux_kernels.runtime.examples import gated_example, gated_modulate_example, modulate_example, qk_example
from flux_kernels.runtime.registry import FP8_TOLERANCE, REGISTRY, TOLERANCE, probe, select, unchecked
from tests.conftest import flux_block_pair, undoing

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (flux_kernels' GPU tier)"),
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed"),
]

BF16 = torch.bfloat16
# (B, H, txt, img, hidden): FLUX.1 at 1024x1024, then odd ones (one text token, prime lengths, batch 3)
QK_SHAPES = [(1, 24, 512, 4096), (2, 24, 1, 77), (3, 5, 13, 331)]
ROW_SHAPES = [(1, 4608, 3072), (2, 4097, 3072), (3, 333, 3072), (2, 77, 1000)]


@pytest.fixture(autouse=True)
def _private_attention_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FLUX_KERNELS_CACHE", str(tmp_path / "attention_probe.json"))


def leaves(args):
    from torch.utils._pytree import tree_flatten

    return [t for t in tree_flatten(args)[0] if isinstance(t, torch.Tensor) and t.requires_grad]


def outs_and_grads(fn, args, seed=1):
    outs = fn(*args)
    outs = list(outs) if isinstance(outs, tuple) else [outs]
    gen = torch.Generator().manual_seed(seed)
    gouts = [torch.randn(o.shape, generator=gen).to(o.device, o.dtype) for o in outs]
    return [o.detach() for o in outs] + list(torch.autograd.grad(outs, leaves(args), gouts))


def upcast(args):
    """The same inputs in fp32 (views rebuilt from fp32 leaves, so gradients flow to them)."""
    from torch.utils._pytree import tree_map

    return tree_map(lambda t: t.detach().float().requires_grad_(t.requires_grad) if torch.is_tensor(t) else t, args)


def rel(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def check(fast_fn, ref_fn, args):
    """Outputs and gradients no further from the fp32 truth than twice the bf16 reference's own distance, the
    criterion FlashAttention's tests use (at 4608 x 3072 a bf16 reference is itself legitimately off)."""
    got, want = outs_and_grads(fast_fn, args), outs_and_grads(ref_fn, args)
    truth = outs_and_grads(ref_fn, upcast(args))
    for i, (g, w, t) in enumerate(zip(got, want, truth, strict=True)):
        assert g.shape == w.shape and g.dtype == w.dtype, i
        assert rel(g, t) <= 2 * rel(w, t) + 1e-3, (i, rel(g, t), rel(w, t))


@pytest.mark.parametrize("shape", QK_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_qk_norm_rope(dev, shape):
    B, H, lt, li = shape
    segs, pe = qk_example(dev, BF16, B, H, 128, lt, li)
    check(lambda s, p: fast.qk_norm_rope_cat(s, p, fallback=False), reference.qk_norm_rope_cat, (segs, pe))
    got = fast.qk_norm_rope_cat(segs, pe, fallback=False)
    want = reference.qk_norm_rope_cat(segs, pe)
    for g, w in zip(got, want, strict=True):  # rounds where sd-scripts rounds: equal but for rare 1-ulp ties
        assert (g != w).float().mean() < 1e-3 and rel(g, w) <= TOLERANCE[BF16]


@pytest.mark.parametrize("shape", ROW_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_modulate(dev, shape):
    check(lambda *a: fast.modulate(*a, fallback=False), reference.modulate, modulate_example(dev, BF16, *shape))


@pytest.mark.parametrize("shape", ROW_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_gated_residual(dev, shape):
    fn = fast.gated_residual
    check(lambda *a: fn(*a, fallback=False), reference.gated_residual, gated_example(dev, BF16, *shape))


@pytest.mark.parametrize("shape", ROW_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_gated_modulate(dev, shape):
    fn = fast.gated_modulate
    check(lambda *a: fn(*a, fallback=False), reference.gated_modulate, gated_modulate_example(dev, BF16, *shape))


def test_every_registry_probe_passes_and_auto_installs_the_auto_set(dev):
    for spec in REGISTRY.values():
        result = probe(spec, dev)
        assert result.ok, (spec.name, result.reason)
    for target in ("model", "optimizer"):  # the optimizer's kernels are selected once sd-scripts has built it
        mine = [n for n, s in REGISTRY.items() if s.target == target]
        assert mine, target
        assert select("auto", dev, target=target).installed == tuple(n for n in mine if REGISTRY[n].in_auto)
        assert select(list(REGISTRY), dev, target=target).installed == tuple(mine)


@pytest.mark.parametrize("with_mask", [False, True])
def test_attention_choice_at_flux_shape(dev, tmp_path, with_mask):
    results = probe_attention((1, 24, 4608, 128), BF16, dev, with_mask, cache_path=tmp_path / "a.json")
    by_name = {r.name: r for r in results}
    assert chosen(results) not in (None, "sage")
    assert by_name["sdpa"].ok
    assert by_name["sdpa_math"].error.startswith("not tried at 4608 tokens")  # ~4 GiB at the run's first forward
    if with_mask:
        assert not by_name["sdpa_flash"].ok  # flash has no arbitrary mask: rejected with the reason
    assert probe_attention((1, 24, 4608, 128), BF16, dev, with_mask, cache_path=tmp_path / "a.json") == results


def flux_blocks(fm, dev):
    return flux_block_pair(fm, 3072, 24, 0.02).to(dev, BF16).requires_grad_(False)


def block_inputs(dev, kind, lt=512, li=4096, mask=False):
    gen = torch.Generator().manual_seed(0)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen).to(dev, BF16).requires_grad_()

    pe = reference.make_pe(1, lt + li, 128, device=dev, generator=gen)  # the same pe on every call
    m = None
    if mask:
        m = torch.ones(1, lt, device=dev, dtype=torch.long)
        m[:, lt // 2 :] = 0
    if kind == "double":
        return rnd(1, li, 3072), rnd(1, lt, 3072), rnd(1, 3072), pe, m
    return rnd(1, lt + li, 3072), rnd(1, 3072), pe, m


def peak_bytes(block, args) -> int:
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    outs_and_grads(block, args)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


@pytest.mark.parametrize("mask", [False, True])
def test_full_size_blocks_patched_match_sd_scripts(dev, fm, mask):
    """Every kernel, compile_blocks included, installed as training installs them (verified on tiny inputs)."""
    model = flux_blocks(fm, dev)
    blocks = {"double": model.double_blocks[0], "single": model.single_blocks[0]}
    with without_cudnn():
        want = {k: outs_and_grads(b, block_inputs(dev, k, mask=mask)) for k, b in blocks.items()}
    # not fp8_matmul (it would quantise this bf16 model: its own tests below), nor lora_fold and lora_grad_norms (no
    # LoRA here: their own tests), flux_prologue (the model's embedders, which two bare blocks do not have: its own
    # tests in test_prologue_gpu.py) or the optimizer's kernels
    skip = ("fp8_matmul", "lora_fold", "lora_grad_norms", "flux_prologue")
    names = [n for n, s in REGISTRY.items() if s.target == "model" and n not in skip]
    assert patch.apply_kernels(model, select(names, dev)) == names  # verify_blocks ran inside
    with undoing(lambda: patch.remove_kernels(model), torch._dynamo.reset):
        for kind, block in blocks.items():
            got = outs_and_grads(block, block_inputs(dev, kind, mask=mask))
            for i, (g, w) in enumerate(zip(got, want[kind], strict=True)):
                assert rel(g, w) <= 5e-2, (kind, i, rel(g, w))


def test_full_size_compiled_blocks_keep_no_more_than_sd_scripts_compiled(dev, fm, capsys):
    """The OOM of the kernels=auto training run: compiled patched blocks used the attention backend chosen at
    verify_blocks' tiny shape (math there) and kept [1, 24, 4608, 4608] fp32 weights per block. Now: what they keep
    for backward is sd-scripts' compiled blocks' or less, and one block's peak at most 128 MiB above (transients of
    a backward, which occur once per step, not once per block)."""
    model = flux_blocks(fm, dev)
    blocks = {"double": model.double_blocks[0], "single": model.single_blocks[0]}
    for b in blocks.values():
        b.compile()
    with without_cudnn():
        want = {k: (saved_bytes(b, block_inputs(dev, k)), peak_bytes(b, block_inputs(dev, k))) for k, b in
                blocks.items()}  # fmt: skip
    patch.remove_kernels(model)
    torch._dynamo.reset()
    names = ["attention", "qk_norm_rope", "modulate", "gated_residual", "gated_modulate", "compile_blocks"]
    patch.apply_kernels(model, select(names, dev))
    with undoing(lambda: patch.remove_kernels(model), torch._dynamo.reset):
        for kind, block in blocks.items():
            saved, peak = saved_bytes(block, block_inputs(dev, kind)), peak_bytes(block, block_inputs(dev, kind))
            mib = [f"{v / 2**20:.0f}" for v in (*want[kind], saved, peak)]
            with capsys.disabled():
                print(f"\n  {kind} block compiled, MiB kept for backward (peak): sd-scripts {mib[0]} ({mib[1]}), "
                      f"with the kernels {mib[2]} ({mib[3]})")  # fmt: skip
            assert saved <= 1.01 * want[kind][0], (kind, saved, want[kind][0])  # summed over the 57 blocks
            assert peak <= want[kind][1] + 128 * 2**20, (kind, peak, want[kind][1])  # one block's transients


def test_full_size_blocks_with_gradient_checkpointing(dev, fm):
    """sd-scripts' checkpoint(self._forward, ...) around the patched forward: the first call probes attention
    inside the checkpointed forward (CheckpointError before the probe ran in a thread of its own)."""
    model = flux_blocks(fm, dev)
    blocks = {"double": model.double_blocks[0].train(), "single": model.single_blocks[0].train()}
    for b in blocks.values():
        b.enable_gradient_checkpointing()
    with without_cudnn():
        want = {k: outs_and_grads(b, block_inputs(dev, k, mask=True)) for k, b in blocks.items()}
    names = ["attention", "qk_norm_rope", "modulate", "gated_residual", "gated_modulate"]
    patch.apply_kernels(model, select(names, dev))
    with undoing(lambda: patch.remove_kernels(model)):
        for kind, block in blocks.items():
            got = outs_and_grads(block, block_inputs(dev, kind, mask=True))
            for i, (g, w) in enumerate(zip(got, want[kind], strict=True)):
                assert rel(g, w) <= 5e-2, (kind, i, rel(g, w))


def test_compiled_patched_block_without_graph_breaks(dev, fm):
    model = flux_blocks(fm, dev)
    patch.apply_kernels(model, unchecked(["qk_norm_rope", "modulate", "gated_residual", "gated_modulate", "attention"]))
    with undoing(lambda: patch.remove_kernels(model), torch._dynamo.reset):
        for kind, block in (("single", model.single_blocks[0]), ("double", model.double_blocks[0])):
            block.train()
            block.enable_gradient_checkpointing()
            args = block_inputs(dev, kind, lt=64, li=256)
            eager = outs_and_grads(block, args)
            explained = torch._dynamo.explain(block.forward)(*args)
            assert explained.graph_break_count == 0, (kind, explained.break_reasons)
            # after earlier tests compiled this block at other shapes, torch traces it with dynamic shapes: with the
            # fused ops inside the graph, its gradients were wrong there (flux_kernels.ops.fast.TRACED)
            block.compile()
            compiled = outs_and_grads(block, args)
            errors = [rel(c, e) for c, e in zip(compiled, eager, strict=True)]
            assert max(errors) <= 2e-2, (kind, errors)


# ---- fp8 frozen matmuls -------------------------------------------------------------------------------------------
# (M tokens, K in, N out): the FLUX.1 linears at 1024^2 (img qkv, txt proj, single linear1 / linear2, img MLP up /
# down), then odd ones
FP8_SHAPES = [(4096, 3072, 9216), (512, 3072, 3072), (4608, 3072, 21504), (4608, 15360, 3072), (4096, 3072, 12288),
              (4096, 12288, 3072), (77, 256, 1040)]  # fmt: skip


@pytest.mark.parametrize("kind", ["fp8_base", "quantized"])
@pytest.mark.parametrize("shape", FP8_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_fp8_linear_against_the_upcast_reference(dev, shape, kind):
    m, k, n = shape
    gen = torch.Generator().manual_seed(m + n)
    w = torch.randn(n, k, generator=gen) * 0.02
    w8, scale = (w.to(fp8.E4M3), None) if kind == "fp8_base" else fp8.quantize_weight(w)
    w8, scale = w8.to(dev), None if scale is None else scale.to(dev)
    x = (torch.randn(1, m, k, generator=gen) + 0.05).to(dev, BF16).requires_grad_()
    bias = (torch.randn(n, generator=gen) * 0.01).to(dev, BF16)
    got = outs_and_grads(lambda x: fp8.fp8_linear(x, w8, scale, bias), (x,))
    want = outs_and_grads(lambda x: fp8.reference_linear(x, w8, scale, bias), (x,))
    for i, (g, r) in enumerate(zip(got, want, strict=True)):
        assert g.dtype == r.dtype == BF16 and g.shape == r.shape, i
        assert rel(g, r) <= FP8_TOLERANCE, (i, rel(g, r))
        assert ((g.float() - r.float()).norm() / r.float().norm()).item() <= 0.04, i  # typical, not only the max


def test_fp8_base_blocks_compiled_with_checkpointing_match_the_upcast_path(dev, fm):
    """sd-scripts' fp8_base (the blocks cast to e4m3, run under autocast): routed through fp8, compiled with no
    graph breaks, with gradient checkpointing; against sd-scripts' own upcast computation."""
    model = flux_blocks(fm, dev).to(fp8.E4M3)
    blocks = {"double": model.double_blocks[0].train(), "single": model.single_blocks[0].train()}
    amp = torch.autocast("cuda", dtype=BF16)
    with amp:
        want = {k: outs_and_grads(b, block_inputs(dev, k)) for k, b in blocks.items()}
    assert patch.apply_kernels(model, unchecked(["fp8_matmul"])) == ["fp8_matmul"]
    with undoing(lambda: patch.remove_kernels(model), torch._dynamo.reset):
        for kind, block in blocks.items():
            block.enable_gradient_checkpointing()
            args = block_inputs(dev, kind)
            with amp:
                eager = outs_and_grads(block, args)
                explained = torch._dynamo.explain(block.forward)(*args)
                assert explained.graph_break_count == 0, (kind, explained.break_reasons)
                block.compile()
                compiled = outs_and_grads(block, args)
            for i, (e, c, w) in enumerate(zip(eager, compiled, want[kind], strict=True)):
                assert rel(e, w) <= 2 * FP8_TOLERANCE, (kind, i, rel(e, w))
                assert rel(c, e) <= FP8_TOLERANCE, (kind, i, rel(c, e))


def test_fp8_quantised_on_the_cpu_then_moved_runs_without_host_syncs(dev, fm):
    """sd-scripts installs the kernels before it moves the model to the GPU: a quantised weight's row scales must
    move with it (the first kernels=fp8 runs copied them from pageable host memory, a sync per fp8 matmul)."""
    model = flux_block_pair(fm, 512, 4, 0.02).to(BF16).requires_grad_(False)
    patch.install_fp8(model, quantize=True)
    model.to(dev)
    block = model.double_blocks[0]
    gen = torch.Generator().manual_seed(0)
    img, txt, vec = (
        torch.randn(*s, generator=gen).to(dev, BF16).requires_grad_() for s in ((1, 64, 512), (1, 16, 512), (1, 512))
    )
    pe = reference.make_pe(1, 80, 128, device=dev, generator=gen)
    with torch.autocast("cuda", dtype=BF16):
        outs_and_grads(block, (img, txt, vec, pe))  # the first call builds fp8_mm's compiled quantisation
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        with undoing(lambda: torch.cuda.set_sync_debug_mode("default")):
            out = block(img, txt, vec, pe)
            torch.autograd.grad(sum(o.float().square().sum() for o in out), [img, txt])
    assert all(t.is_cuda for _, lin in fp8.block_linears([block]) for t in lin._buffers.values())


@pytest.mark.parametrize("swap", [False, True])
def test_fp8_quantised_on_the_gpu_stays_there_unless_blocks_swap(dev, fm, swap):
    """A model on the host, quantised on the GPU (what sd-scripts' order gives): without block swap the fp8
    weights, scales and transposes stay on the GPU, with it they go back to the host; the same bytes either way."""
    model = flux_block_pair(fm, 512, 4, 0.02).to(BF16).requires_grad_(False)
    want = [fp8.quantize_weight(lin.weight.to(dev)) for _, lin in fp8.block_linears([*model.double_blocks])]
    model.blocks_to_swap = 1 if swap else None
    patch.install_fp8(model, quantize=True, device=dev, keep_transposed=True)
    linears = [lin for _, lin in fp8.block_linears([*model.double_blocks])]
    where = {t.device.type for lin in linears for t in (lin.weight, *lin._buffers.values())}
    assert where == ({"cpu"} if swap else {"cuda"})
    for lin, (w8, scale) in zip(linears, want, strict=True):
        assert torch.equal(lin.weight.to(dev).view(torch.uint8), w8.view(torch.uint8))
        assert torch.equal(lin._buffers[fp8.SCALE].to(dev), scale)
        assert torch.equal(
            lin._buffers[fp8.TRANSPOSED].to(dev).view(torch.uint8), w8.t().contiguous().view(torch.uint8)
        )


def test_fp8_compiled_blocks_keep_no_more_than_the_compiled_upcast_path(dev, fm, capsys):
    """The first fp8 training run peaked at 27 GiB instead of 14.8: inductor had moved the weight transpose of the
    input-gradient matmul into the forward graph and kept a transposed fp8 copy of every weight until backward."""
    model = flux_blocks(fm, dev).to(fp8.E4M3)
    blocks = {"double": model.double_blocks[0], "single": model.single_blocks[0]}
    amp = torch.autocast("cuda", dtype=BF16)
    for b in blocks.values():
        b.compile()
    with amp:
        want = {k: saved_bytes(b, block_inputs(dev, k)) for k, b in blocks.items()}
    patch.remove_kernels(model)
    torch._dynamo.reset()
    assert patch.apply_kernels(model, unchecked(["fp8_matmul", "compile_blocks"])) == ["fp8_matmul", "compile_blocks"]
    with undoing(lambda: patch.remove_kernels(model), torch._dynamo.reset):
        for kind, block in blocks.items():
            with amp:
                saved = saved_bytes(block, block_inputs(dev, kind))
            with capsys.disabled():
                print(f"\n  {kind} block compiled, fp8 base, MiB kept for backward: upcast {want[kind] / 2**20:.0f}, "
                      f"fp8_matmul {saved / 2**20:.0f}")  # fmt: skip
            assert saved <= 1.01 * want[kind], (kind, saved, want[kind])


def test_l2_persisting_window_is_set_inside_and_removed_after(dev):
    from flux_kernels.memory import l2

    info = l2.l2_info(dev)
    assert info.l2_bytes > 0 and 0 <= info.max_persisting_bytes <= info.l2_bytes and info.max_window_bytes > 0
    if info.max_persisting_bytes == 0:
        pytest.skip(f"{torch.cuda.get_device_name(dev)} allows no L2 persistence")
    x = torch.randn(4 << 20, device=dev)  # 16 MiB
    stream = torch.cuda.current_stream(dev)
    with l2.persisting_window(x, 0.5) as covered:
        w = l2.stream_window(stream)
        assert covered == l2.window_bytes(x.numel() * 4, info) > 0
        assert (w.base_ptr, w.num_bytes, w.hitProp) == (x.data_ptr(), covered, l2.ACCESS_PERSISTING)
        assert w.hitRatio == pytest.approx(0.5)
    assert l2.stream_window(stream).num_bytes == 0


def assert_matches_at_shapes(block, dev, kind, shapes, eager):
    """`block` at each (lt, li) of `shapes`, outputs and input gradients, against `eager` (the same, before)."""
    for (lt, li), want in zip(shapes, eager, strict=True):
        got = outs_and_grads(block, block_inputs(dev, kind, lt=lt, li=li))
        errors = [rel(g, w) for g, w in zip(got, want, strict=True)]
        assert max(errors) <= 2e-2, ((lt, li), errors)


def test_compile_blocks_with_the_fused_ops_at_two_shapes_match_eager(dev, fm):
    """compile_blocks with the fused ops patched in: a double block that meets a second shape (another bucket)
    matches the eager patched block (fused kernels) at both shapes, outputs and input gradients. With the fused ops
    inside the compiled graphs the second shape's gradients were 26-44% off on the H200
    (flux_kernels.ops.fast.TRACED)."""
    from flux_kernels.patches import compile_blocks

    model = flux_blocks(fm, dev)
    patch.apply_kernels(model, unchecked(["qk_norm_rope", "modulate", "gated_residual", "gated_modulate", "attention"]))
    block = model.double_blocks[0].train()
    block.enable_gradient_checkpointing()
    shapes = [(512, 1024), (64, 256)]
    eager = [outs_and_grads(block, block_inputs(dev, "double", lt=lt, li=li)) for lt, li in shapes]
    torch._dynamo.reset()
    with undoing(lambda: compile_blocks.remove(model), lambda: patch.remove_kernels(model), torch._dynamo.reset):
        assert "inductor's code inside the compiled blocks" in compile_blocks.install(model)
        assert_matches_at_shapes(block, dev, "double", shapes, eager)


@pytest.mark.parametrize("kind", ["single", "double"])
def test_block_with_its_qkv_op_compiles_without_graph_breaks(dev, fm, kind):
    """Dynamo traces single_qkv's / double_qkv's autograd function, forward and backward (the Triton backward as
    its custom op), into the block's graph; a break would run it eagerly between two graphs. Traced code asks
    first whether triton is installed (device.triton_available, looked up once per process)."""
    from flux_kernels.runtime import device

    device._triton_found = None
    model = flux_blocks(fm, dev)
    patch.apply_kernels(model, unchecked(["attention", f"{kind}_qkv"]))
    with undoing(lambda: patch.remove_kernels(model), torch._dynamo.reset):
        block = (model.single_blocks if kind == "single" else model.double_blocks)[0].train()
        explained = torch._dynamo.explain(block.forward)(*block_inputs(dev, kind, lt=64, li=256))
        assert explained.graph_break_count == 0, explained.break_reasons


@pytest.mark.parametrize("L", [4608, 333])
def test_single_qkv_bwd_writes_gelus_gradient_from_a_column_slice(dev, L):
    """GELU's gradient in the single block's Triton backward (linear2 mirror-folded): FLUX's 12288 MLP columns (and
    an odd token count), the incoming gradient a column slice of linear2's [L, 15360] input gradient, against
    aten's gelu_backward (tanh) on the same bf16 inputs: as close to the fp64 truth (max and mean error within 1%),
    rounded differently only where the two fp32 results straddle a bf16 rounding boundary (~1% of elements, 1 ulp;
    the same on the CPU interpreter against aten's CPU kernel)."""
    from flux_kernels.ops import _launch
    from flux_kernels.patches import single_qkv

    H, D, M = 24, 128, 12288
    width = 3 * H * D
    gen = torch.Generator(device=dev).manual_seed(0)
    lin1 = (torch.randn(1, L, width + M, device=dev, generator=gen) * 2).to(BF16)
    d_lin2_in = torch.randn(1, L, H * D + M, device=dev, generator=gen).to(BF16)
    d_act = d_lin2_in[..., H * D :]
    grads = [torch.randn(1, L, H, D, device=dev, generator=gen).to(BF16).transpose(1, 2) for _ in range(3)]
    q, k, _ = reference.heads(lin1[..., :width], H)
    rq, rk = (torch.rsqrt(t.float().pow(2).mean(-1, keepdim=True) + single_qkv.EPS) for t in (q, k))
    scales = [torch.rand(D, device=dev, generator=gen).to(BF16) + 0.5 for _ in range(2)]
    pe = reference.make_pe(1, L, D, device=dev)
    out = torch.full_like(lin1, float("nan"))
    _launch.single_qkv_bwd(*grads, lin1, rq, rk, *scales, pe, out, d_act)
    assert not out.isnan().any()
    got, x = out[..., width:], lin1[..., width:]
    want = torch.ops.aten.gelu_backward(d_act, x, approximate="tanh")
    truth = torch.ops.aten.gelu_backward(d_act.double(), x.double(), approximate="tanh")
    e_got, e_want = (got.double() - truth).abs(), (want.double() - truth).abs()
    assert e_got.max() <= 1.01 * e_want.max() and e_got.mean() <= 1.01 * e_want.mean(), (e_got.mean(), e_want.mean())
    differ = (got != want).float().mean().item()
    assert differ < 0.03 and rel(got, want) <= 1e-2, (differ, rel(got, want))


@pytest.mark.parametrize(
    ("kind", "checkpointed", "gelu_in_kernel"),
    [("single", False, False), ("single", False, True), ("single", True, False), ("double", False, False)],
)
def test_compiled_blocks_with_their_qkv_op_at_two_shapes_match_eager(dev, fm, checkpointed, kind, gelu_in_kernel):
    """single_qkv's / double_qkv's written-out backward inside compiled blocks, as training runs them (CUDA graphs
    aside): at two shapes (the second traced with dynamic shapes), checkpointed or not (checkpointed double blocks
    keep sd-scripts' ops), with the checkpointed blocks' RNG state on the host where this torch caches that
    (compile_blocks' choice), against the eager patched block. `gelu_in_kernel`: the single block takes GELU's
    gradient in the Triton kernel, as where lora_fold mirror-folds linear2 (here linear2 is only marked so)."""
    from flux_kernels.patches import compile_blocks, lora_fold, single_qkv

    model = flux_blocks(fm, dev)
    patch.apply_kernels(model, unchecked(["attention", f"{kind}_qkv"]))
    block = (model.single_blocks if kind == "single" else model.double_blocks)[0].train()
    if checkpointed:
        block.enable_gradient_checkpointing()
    if gelu_in_kernel:
        block.linear2.__dict__[lora_fold.DOWN] = True
    shapes = [(512, 1024), (64, 256)]
    calls = []
    original = single_qkv._QKV.apply
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(single_qkv._QKV, "apply", lambda *a: calls.append(a[4]) or original(*a))
        eager = [outs_and_grads(block, block_inputs(dev, kind, lt=lt, li=li)) for lt, li in shapes]
    assert calls, f"the eager block did not go through {kind}_qkv"
    assert set(calls) == {gelu_in_kernel}
    torch._dynamo.reset()
    with undoing(lambda: compile_blocks.remove(model), lambda: patch.remove_kernels(model), torch._dynamo.reset):
        assert "inductor's code inside" not in compile_blocks.install(model)
        assert_matches_at_shapes(block, dev, kind, shapes, eager)


def with_lora(lora_flux, model, dev):
    """sd-scripts' LoRA (r16) on every Linear of the blocks but the modulation layers, as training has it."""
    gen = torch.Generator().manual_seed(3)
    for name, m in list(model.named_modules()):
        if isinstance(m, torch.nn.Linear) and "mod" not in name:
            lora = lora_flux.LoRAModule("lora_" + name.replace(".", "_"), m, lora_dim=16, alpha=16).to(dev, BF16)
            lora.apply_to()
            lora.lora_up.weight.data = 0.02 * torch.randn(lora.lora_up.weight.shape, generator=gen).to(dev, BF16)
    return model


@pytest.mark.parametrize("kernels", [["single_qkv"], ["lora_fold"]])
def test_plainly_checkpointed_compiled_blocks_keep_no_more_with_autograd_functions(dev, fm, lora_flux, kernels):
    """torch 2.11 tags a plainly checkpointed region's ops for recomputation through FX metadata, which misses the
    ops inside autograd.Functions: the partitioner saved what single_qkv and lora_fold compute (a training step's
    peak went from 27.5 to 39.2 GiB with lora_fold at vram48, every block checkpointed). compile_blocks routes the
    blocks' checkpoint calls through a recompute-everything context (flux_kernels.memory.selective_checkpoint): with it
    they keep what sd-scripts' compiled checkpointed blocks keep, the block inputs, and have the same gradients."""
    from flux_kernels.patches import lora_fold

    def build():
        model = with_lora(lora_flux, flux_blocks(fm, dev), dev)
        for b in (model.double_blocks[0], model.single_blocks[0]):
            b.train().enable_gradient_checkpointing()
        return model, {"double": model.double_blocks[0], "single": model.single_blocks[0]}

    torch._dynamo.reset()
    _, blocks = build()
    for b in blocks.values():
        b.compile()
    with without_cudnn():
        want = {k: (saved_bytes(b, block_inputs(dev, k)), outs_and_grads(b, block_inputs(dev, k))) for k, b in
                blocks.items()}  # fmt: skip
    torch._dynamo.reset()
    model, blocks = build()
    patch.apply_kernels(model, unchecked(["attention", *kernels, "compile_blocks"]), verify=False)
    if "lora_fold" in kernels:
        lora_fold.sync(model.__dict__[lora_fold.ATTR][1])  # the model's first forward does it in training
    with undoing(lambda: patch.remove_kernels(model), torch._dynamo.reset):
        with without_cudnn():
            for kind, block in blocks.items():
                saved = saved_bytes(block, block_inputs(dev, kind))
                assert saved <= want[kind][0] + 2**20, (kind, saved, want[kind][0])
                got = outs_and_grads(block, block_inputs(dev, kind))
                for i, (g, w) in enumerate(zip(got, want[kind][1], strict=True)):
                    assert rel(g, w) <= 5e-2, (kind, i, rel(g, w))


@pytest.mark.parametrize(("out", "inp", "k"), [(21504, 3072, 38), (3072, 15360, 38), (333, 77, 3)])
def test_lora_norms_kernel_matches_the_float64_ops(dev, out, inp, k):
    """The LoRA gradient row norms' Triton kernel (float64 dots) against the torch float64 ops, k modules of one
    shape at FLUX's widest, with one module whose two products nearly cancel (where float32 would lose digits)."""
    from flux_kernels.patches import lora_norms

    gen = torch.Generator(device=dev).manual_seed(out)
    mods = []
    for i in range(k):
        up, d_up = (torch.randn(out, 16, device=dev, generator=gen) * s for s in (0.01, 1e-4))
        down, d_down = (torch.randn(16, inp, device=dev, generator=gen) * s for s in (0.05, 1e-4))
        if i == 1:
            d_up, d_down = -up, down + 1e-3 * d_down  # the row of G is ~1e-3 of either product
        mods.append((up, down, d_up, d_down))
    got = lora_norms.batched_row_norms(*zip(*mods, strict=True), 0.5, triton=True)
    want = lora_norms.batched_row_norms(*zip(*mods, strict=True), 0.5, triton=False)
    assert got.shape == want.shape == (k, out, 1)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
