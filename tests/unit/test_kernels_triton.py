"""The Triton kernels against the references, forward and backward, on odd small shapes with FLUX's head_dim.

On a CPU machine they run through Triton's interpreter (TRITON_INTERPRET=1, set only for this module), on a
CUDA machine on the GPU. Skipped with the reason when triton is not installed."""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest
import torch

from flux_kernels.ops import fast, reference
from flux_kernels.patches import patch, verify
from flux_kernels.runtime.errors import KernelError
from flux_kernels.runtime.examples import gated_example, gated_modulate_example, modulate_example, qk_example
from flux_kernels.runtime.registry import TOLERANCE, unchecked
from tests.conftest import flux_block_pair, undoing


@pytest.fixture(scope="module")
def dev():
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed (pip install triton); the references stay in use")
    if torch.cuda.is_available():
        yield torch.device("cuda")
        return
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        yield torch.device("cpu")


def outs_and_grads(fn, args, wrt, seed=1):
    outs = fn(*args)
    outs = list(outs) if isinstance(outs, tuple) else [outs]
    gen = torch.Generator().manual_seed(seed)
    gouts = [torch.randn(o.shape, generator=gen).to(o.device, o.dtype) for o in outs]
    return [o.detach() for o in outs] + list(torch.autograd.grad(outs, wrt, gouts))


def assert_close(got, want, dtype):
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.shape == w.shape and g.dtype == w.dtype, i
        err = ((g.float() - w.float()).abs().max() / w.float().abs().max()).item()
        assert err <= TOLERANCE[dtype], f"tensor {i}: max rel. error {err:.2e} > {TOLERANCE[dtype]:.0e}"


def leaves(args):
    from torch.utils._pytree import tree_flatten

    return [t for t in tree_flatten(args)[0] if isinstance(t, torch.Tensor) and t.requires_grad]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("streams", ["double", "single"])
def test_qk_norm_rope_fwd_bwd(dev, dtype, streams):
    if streams == "double":  # txt 3 + img 5 tokens, pe shared by the batch, q/k strided views of qkv
        segs, pe = qk_example(dev, dtype)
    else:  # one stream of 7 tokens, 5 heads, pe per batch element
        segs, _ = qk_example(dev, dtype, B=2, H=5, lt=7, li=1)
        segs, pe = segs[:1], reference.make_pe(2, 7, 128, device=dev)
    args = (segs, pe)
    want = outs_and_grads(reference.qk_norm_rope_cat, args, leaves(args))
    got = outs_and_grads(lambda s, p: fast.qk_norm_rope_cat(s, p, fallback=False), args, leaves(args))
    assert got[0].is_contiguous()
    assert_close(got, want, dtype)
    if dtype == torch.bfloat16:  # the kernel rounds where QKNorm rounds: the forward is bit-identical (on a GPU,
        # where rsqrt and the sum order differ by an fp32 ulp, but for rare bf16 rounding ties)
        for g, w in zip(got[:2], want[:2], strict=True):
            assert torch.equal(g, w) if dev.type == "cpu" else (g != w).float().mean() < 1e-3


def test_qk_norm_rope_frozen_scales_and_one_output_used(dev):
    """Frozen norm scales (no dw reduction) and k unused downstream (its incoming gradient is None)."""
    (q, k, qw, kw), pe = qk_example(dev, torch.bfloat16, B=1, H=2, lt=5, li=1)[0][0], reference.make_pe(1, 5, 128)
    qw, kw, pe = qw.detach(), kw.detach(), pe.to(dev)
    go = torch.randn(1, 2, 5, 128).to(dev, torch.bfloat16)
    (want_dq,) = torch.autograd.grad(reference.qk_norm_rope(q, k, qw, kw, pe)[0], [q], go)
    dq, dk = torch.autograd.grad(fast.qk_norm_rope(q, k, qw, kw, pe, fallback=False)[0], [q, k], go)
    assert_close([dq], [want_dq], torch.bfloat16)
    assert dk.abs().max() == 0


def test_qk_norm_rope_fp8_scales_as_in_fp8_base_models(dev):
    """sd-scripts' fp8_base casts the whole model, RMSNorm scales included, and reads them back as fp32."""
    (q, k, qw, kw), pe = qk_example(dev, torch.bfloat16, B=1, H=2, lt=3, li=1)[0][0], reference.make_pe(1, 3, 128)
    qw8, kw8 = qw.detach().to(torch.float8_e4m3fn), kw.detach().to(torch.float8_e4m3fn)
    args = (q, k)
    want = outs_and_grads(lambda a, b: reference.qk_norm_rope(a, b, qw8, kw8, pe.to(dev)), args, [q, k])
    got = outs_and_grads(lambda a, b: fast.qk_norm_rope(a, b, qw8, kw8, pe.to(dev), fallback=False), args, [q, k])
    assert_close(got, want, torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("hidden", [96, 100])
def test_modulate_fwd_bwd(dev, dtype, hidden):
    args = modulate_example(dev, dtype, B=2, L=7, C=hidden)
    want = outs_and_grads(reference.modulate, args, leaves(args))
    got = outs_and_grads(lambda *a: fast.modulate(*a, fallback=False), args, leaves(args))
    assert_close(got, want, dtype)


def test_modulate_batch_broadcast_and_long_rows(dev):
    x = (torch.randn(3, 37, 64) + 1).to(dev).requires_grad_()  # L=37 spreads over several programs per batch
    shift, scale = ((torch.randn(1, 1, 64) * 0.3).to(dev).requires_grad_() for _ in range(2))
    args = (x, shift, scale)
    want = outs_and_grads(reference.modulate, args, leaves(args))
    got = outs_and_grads(lambda *a: fast.modulate(*a, fallback=False), args, leaves(args))
    assert_close(got, want, torch.float32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gated_residual_fwd_bwd(dev, dtype):
    args = gated_example(dev, dtype, B=2, L=9, C=100)
    want = outs_and_grads(reference.gated_residual, args, leaves(args))
    got = outs_and_grads(lambda *a: fast.gated_residual(*a, fallback=False), args, leaves(args))
    assert_close(got, want, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("hidden", [96, 100])
def test_gated_modulate_fwd_bwd(dev, dtype, hidden):
    args = gated_modulate_example(dev, dtype, B=2, L=7, C=hidden)
    want = outs_and_grads(reference.gated_modulate, args, leaves(args))
    got = outs_and_grads(lambda *a: fast.gated_modulate(*a, fallback=False), args, leaves(args))
    assert_close(got, want, dtype)


def test_gated_modulate_long_rows_frozen_modulation_and_residual_unused(dev):
    """L=37 spreads over several programs per batch element; frozen modulation vectors (no sums over L); the
    residual output feeding nothing (its incoming gradient is None)."""
    x, gate, y, shift, scale = gated_modulate_example(dev, torch.float32, B=2, L=37, C=64)
    gate, shift, scale = gate.detach(), shift.detach(), scale.detach()
    go = torch.randn(2, 37, 64).to(dev)
    want = torch.autograd.grad(reference.gated_modulate(x, gate, y, shift, scale)[1], [x, y], go)
    got = torch.autograd.grad(fast.gated_modulate(x, gate, y, shift, scale, fallback=False)[1], [x, y], go)
    assert_close(list(got), list(want), torch.float32)
    args = gated_modulate_example(dev, torch.float32, B=2, L=37, C=64)
    want = outs_and_grads(reference.gated_modulate, args, leaves(args))
    got = outs_and_grads(lambda *a: fast.gated_modulate(*a, fallback=False), args, leaves(args))
    assert_close(got, want, torch.float32)


def test_fused_bf16_is_at_least_as_accurate_as_the_reference(dev):
    """One rounding instead of four: against a float64 truth the kernel is no worse than sd-scripts' math."""
    x, shift, scale = (t.detach() for t in modulate_example(dev, torch.bfloat16, B=2, L=33, C=256))
    truth = reference.modulate(x.double(), shift.double(), scale.double())
    err_ref = (reference.modulate(x, shift, scale).double() - truth).abs().mean()
    err_fast = (fast.modulate(x, shift, scale, fallback=False).double() - truth).abs().mean()
    assert err_fast <= err_ref
    x, gate, y = (t.detach() for t in gated_example(dev, torch.bfloat16, B=2, L=33, C=256))
    truth = reference.gated_residual(x.double(), gate.double(), y.double())
    err_ref = (reference.gated_residual(x, gate, y).double() - truth).abs().mean()
    err_fast = (fast.gated_residual(x, gate, y, fallback=False).double() - truth).abs().mean()
    assert err_fast <= err_ref


def test_unsupported_inputs_fall_back_or_raise(dev):
    x = torch.randn(7, 96, device=dev)  # 2-D: not [B, L, C]
    shift = scale = torch.randn(96, device=dev)
    with pytest.raises(fast.Unsupported, match="must be"):
        fast.modulate(x, shift, scale, fallback=False)
    assert torch.equal(fast.modulate(x, shift, scale), reference.modulate(x, shift, scale))
    segs, pe = qk_example(dev, torch.float32)
    with pytest.raises(fast.Unsupported, match="pe requires grad"):
        fast.qk_norm_rope_cat(segs, pe.requires_grad_(), fallback=False)


def _model(fm, dtype):
    return flux_block_pair(fm, 256, 2, 0.05).to(dtype)


def test_kernels_installed_into_sd_scripts_blocks_verify(dev, fm, monkeypatch):
    model = _model(fm, torch.bfloat16).to(dev)
    selection = unchecked(["qk_norm_rope", "modulate", "gated_residual", "gated_modulate"])
    seconds = {}
    assert patch.apply_kernels(model, selection, seconds=seconds) == list(selection.installed)  # verified
    assert set(seconds) == {*selection.installed, "verify"} and all(t > 0 for t in seconds.values())  # the log line
    patch.remove_kernels(model)
    # a kernel that is slightly wrong inside the block is caught by verification, and nothing stays installed:
    # named by the user, that is an error; in auto, a warning and plain sd-scripts
    monkeypatch.setattr(fast, "gated_residual", lambda x, gate, y: x + 1.2 * gate * y)
    with pytest.raises(KernelError, match="failed verification: patched double-stream block differs"):
        patch.apply_kernels(model, selection)
    assert "_forward" not in model.double_blocks[0].__dict__
    assert patch.apply_kernels(model, dataclasses.replace(selection, explicit=False)) == []
    assert "_forward" not in model.single_blocks[0].__dict__


def test_compiled_blocks_use_the_reference_for_the_fused_ops(dev, fm):
    """fast.TRACED: inside compile_blocks' graphs the fused ops are the reference's code, which inductor compiles (a
    double block with them, compiled for a second shape, gave wrong gradients on the H200); eager blocks keep the
    fused kernels. Compiled at two shapes, the block gives the eager patched block's numbers at both."""
    import torch._dynamo

    from flux_kernels.patches import compile_blocks

    model = _model(fm, torch.float32).to(dev)
    fused = ["qk_norm_rope", "modulate", "gated_residual", "gated_modulate"]
    patch.apply_kernels(model, unchecked(fused), verify=False)
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm.print_readable(print_output=False))
        return gm.forward

    block = model.double_blocks[0]
    shapes = [(3, 5), (4, 9)]  # (text, image) tokens
    eager = [outs_and_grads(block, a, leaves(a)) for a in (_double_inputs(dev, lt, li) for lt, li in shapes)]
    torch._dynamo.reset()
    with undoing(lambda: compile_blocks.remove(model), lambda: patch.remove_kernels(model), torch._dynamo.reset):
        note = compile_blocks.install(model, backend=capture)
        got = [outs_and_grads(block, a, leaves(a)) for a in (_double_inputs(dev, lt, li) for lt, li in shapes)]
    # none of the fused ops' custom ops (the attention output's rearrange is a custom op of its own, and stays)
    fused_ops = [g.replace("torch.ops.flux_kernels.heads_to_tokens", "") for g in graphs]
    assert graphs and not any("torch.ops.flux_kernels." in g for g in fused_ops)
    assert "qk_norm_rope, modulate, gated_residual, gated_modulate: inductor's code inside the compiled" in note
    for g, w in zip(got, eager, strict=True):
        assert_close(g, w, torch.float32)


def _double_inputs(dev, lt: int, li: int, hidden: int = 256):
    gen = torch.Generator().manual_seed(lt * 100 + li)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen).to(dev).requires_grad_()

    pe = reference.make_pe(1, lt + li, 128, device=dev, generator=gen)
    return rnd(1, li, hidden), rnd(1, lt, hidden), rnd(1, hidden), pe, None


def test_patched_block_traces_without_graph_breaks(dev, fm):
    """The kernels are custom ops: torch.compile (here its aot_eager backend) sees them as opaque calls."""
    import torch._dynamo

    model = _model(fm, torch.float32).to(dev)
    names = ["qk_norm_rope", "modulate", "gated_residual", "gated_modulate", "attention"]
    patch.apply_kernels(model, unchecked(names), verify=False)
    for kind, block in (("single", model.single_blocks[0]), ("double", model.double_blocks[0])):
        block.train()
        block.enable_gradient_checkpointing()
        args = verify._verify_inputs(block, kind, dev, torch.float32, True)
        explained = torch._dynamo.explain(block.forward)(*args)
        assert explained.graph_break_count == 0, (kind, explained.break_reasons)
        assert block._flux_kernels.attention.choice == {}  # tracing never probes
        torch._dynamo.reset()
    # once the run's backend is chosen (an SDPA one under sdpa_kernel), traced code uses it without graph breaks
    block = model.single_blocks[0]
    args = verify._verify_inputs(block, "single", dev, torch.float32, True)
    block.disable_gradient_checkpointing()
    block(*args)  # eager: probes this shape
    dispatch = block._flux_kernels.attention
    assert len(dispatch.choice) == 1
    ((key, name),) = dispatch.choice.items()
    assert dispatch.decide_run(key[0], torch.float32, dev, True) == name  # every SDPA backend compiles
    explained = torch._dynamo.explain(block.forward)(*args)
    assert explained.graph_break_count == 0, explained.break_reasons
    torch._dynamo.reset()


AOT = """
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from flux_kernels.ops import tl_modulate as tm
from flux_kernels.ops import tl_qk_norm_rope as tq
from flux_kernels.ops import tl_quantize as tz
from flux_kernels.ops import tl_single_qkv as ts
from flux_kernels.ops import tl_transpose as tt

U8 = {"src_ptr", "dst_ptr"}
F32 = {"pe_ptr", "mean_ptr", "rstd_ptr", "dqw_ptr", "dkw_ptr", "dsc_part_ptr", "dsh_part_ptr", "dg_part_ptr", "col_ptr",
       "scale_ptr", "rq_ptr", "rk_ptr"}
FP8 = {"out_ptr"}  # tl_quantize's output
ODD = {"L", "H", "l_off", "rows_per_prog", "n_progs", "eps"}  # not multiples of 16 in general
PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"


def sig(fn, consts):
    def ty(n):
        if n in consts:
            return "constexpr"
        if n.endswith("_ptr"):
            return "*u8" if n in U8 else "*fp32" if n in F32 else "*fp8e4nv" if n in FP8 else "*bf16"
        return "fp32" if n == "eps" else "i32"

    return {n: ty(n) for n in fn.arg_names}


def attrs(fn, consts):  # what the JIT specialises at FLUX shapes: aligned pointers, strides and C multiples of 16
    names = [n for n in fn.arg_names if n not in consts and n not in ODD]
    return {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in names}


qk = dict(D=128, BLOCK_T=2, BLOCK_H=8, RTNE=False)  # FLUX: 24 heads in groups of 8, 2 tokens per program
row = dict(BLOCK_C=4096, RTNE=False)  # hidden 3072
cases = [  # (kernel, constexprs, num_warps as flux_kernels.ops._launch launches them)
    (tq.qk_norm_rope_fwd, qk, 8),
    (tq.qk_norm_rope_bwd, {**qk, "COMPUTE_DW": True}, 8),
    (ts.qkv_bwd, qk, 8),
    (ts.gelu_bwd, dict(BLOCK_T=4, BLOCK_M=1024, RTNE=False), 8),  # _launch.GELU_TILE
    (tm.modulate_fwd, row, 8),
    (tm.modulate_bwd, {**row, "COMPUTE_DSS": True}, 16),
    (tm.gated_fwd, row, 8),
    (tm.gated_bwd, {**row, "COMPUTE_DGATE": True}, 16),
    (tm.gated_modulate_fwd, row, 8),
    (tm.gated_modulate_bwd, {**row, "HAS_DRES": True, "COMPUTE_DG": True, "COMPUTE_DSS": True}, 16),
    (tt.transpose_2d, dict(BLOCK_R=64, BLOCK_C=64), 4),  # fp8.TRANSPOSE_TILE, triton's default warps
    *((tz.quantize_rows_2d, dict(E4M3_MAX=448.0, HAS_COL=True, BLOCK=b, RTNE=False), w)  # fp8.quantize_launch
      for b, w in ((1024, 4), (2048, 8), (4096, 16))),
]
for cap in map(int, sys.argv[1:]):
    for fn, consts, warps in cases:
        src = ASTSource(fn, sig(fn, consts), consts, attrs(fn, consts))
        k = triton.compile(src, target=GPUTarget("cuda", cap, 32), options={"num_warps": warps})
        ptx = k.asm["ptx"]
        store = "st.global.v2" if fn is tz.quantize_rows_2d else "st.global.v4"  # 8 fp8 values per thread: 8 bytes
        assert "ld.global.v4" in ptx and store in ptx, (cap, fn.__name__, "no 16-byte loads or full-width stores")
        if cap == 90:
            with tempfile.TemporaryDirectory() as d:
                Path(d, "k.ptx").write_text(ptx)
                cmd = [str(PTXAS), "-v", "--gpu-name=sm_90a", os.path.join(d, "k.ptx"), "-o", os.path.join(d, "k.o")]
                info = subprocess.run(cmd, capture_output=True, text=True, check=True).stderr
            assert " 0 bytes spill stores" in info, (fn.__name__, info)
            print(fn.__name__, [line.split(": ")[-1] for line in info.splitlines() if "registers" in line])
"""


@pytest.mark.parametrize("rows, cols", [(37, 96), (130, 70), (3, 1000), (64, 64)])
def test_fp8_transpose_is_the_exact_transpose(dev, rows, cols):
    from flux_kernels.patches import fp8

    gen = torch.Generator().manual_seed(rows)
    w8 = (torch.randn(rows, cols, generator=gen) * 40).to(fp8.E4M3).to(dev)
    got = fp8.transpose(w8)
    assert got.dtype == fp8.E4M3 and got.shape == (cols, rows) and got.is_contiguous()
    assert torch.equal(got.view(torch.uint8), w8.t().contiguous().view(torch.uint8))


@pytest.mark.parametrize(
    ("rows", "cols", "with_col"), [(6, 700, True), (5, 1000, False), (4, 3001, True), (3, 5000, False)]
)
def test_fp8_quantize_rows_op_matches_quantize_rows(dev, rows, cols, with_col):
    """The Triton row quantisation (one sweep where the row fits in a block, two otherwise) against quantize_rows,
    on a strided view with a zero row, a row reaching into e4m3's subnormals and values at its rounding ties'
    neighbourhood: the same scales and fp8 values (compared as numbers: the interpreter drops the sign of zero)."""
    from flux_kernels.patches import fp8

    gen = torch.Generator().manual_seed(rows * cols)
    x = (torch.randn(rows, cols + 3, generator=gen) * 7).bfloat16()[:, :cols]
    x[1] = 0
    x[2] *= torch.logspace(-6, 0, cols).bfloat16()
    col = torch.rand(1, cols, generator=gen) + 0.5 if with_col else None
    got8, got_s = fp8.quantize_rows_op(x.to(dev), None if col is None else col.to(dev))
    want8, want_s = fp8.quantize_rows(x.float() * col if with_col else x)
    assert got8.dtype == fp8.E4M3 and got8.shape == x.shape and got_s.shape == (rows, 1)
    assert torch.equal(got_s.cpu(), want_s)
    assert torch.equal(got8.cpu().float(), want8.float())
    assert (want8.float() != 0).float().mean() > 0.5  # most values survive: the comparison is not of zeros


def test_fp8_probe_runs_the_row_kernel_and_rejects_it_broken(dev, monkeypatch):
    """fp8_matmul's probe quantises rows wider than fp8.WIDE_ROWS, forward and backward, so on a device where the
    Triton row kernel runs, the probe runs it: a kernel returning a wrong scale is rejected."""
    from flux_kernels.patches import fp8
    from flux_kernels.runtime.registry import REGISTRY, probe
    from tests.conftest import cpu_row_scales

    if dev.type == "cpu" and not cpu_row_scales():
        pytest.skip("this torch's CPU _scaled_mm takes no per-row scales, which the fp8 probe needs")
    calls = []
    real = fp8.quantize_rows_op

    def counted(x, col=None):
        calls.append(x.shape)
        return real(x, col)

    monkeypatch.setattr(fp8, "quantize_rows_op", counted)
    assert probe(REGISTRY["fp8_matmul"], dev).ok
    assert len(calls) == 2 and all(shape[-1] > fp8.WIDE_ROWS for shape in calls)  # the activations, the gradient
    monkeypatch.setattr(fp8, "quantize_rows_op", lambda x, col=None: (lambda q, s: (q, s * 1.5))(*real(x, col)))
    verdict = probe(REGISTRY["fp8_matmul"], dev)
    assert not verdict.ok and "reference" in verdict.reason


def test_kernels_compile_to_cubin_for_hopper_and_blackwell_without_a_gpu(tmp_path):
    """The interpreter does not run Triton's compiler; this does (front end, LLVM, the wheel's ptxas), so a kernel
    that would fail to compile on a GPU fails here, before anyone borrows one. Specialised as the JIT does at
    FLUX's shapes, every kernel moves data in 16-byte vectors and ptxas spills nothing for sm_90."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    import os
    import subprocess
    import sys
    from pathlib import Path

    import triton

    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("this triton wheel has no CUDA backend/ptxas")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"TRITON_CACHE_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", AOT, "90", "120"], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]


GRAM_AOT = """
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from flux_kernels.ops import tl_lora_norms as tn

fn = tn.gram_row_norms
sig = {n: "i32" for n in fn.arg_names} | {"u_ptr": "*fp32", "du_ptr": "*fp32", "m_ptr": "*fp64", "out_ptr": "*fp32",
                                          "scale": "fp32", "BLOCK_N": "constexpr", "R": "constexpr"}
for cap in map(int, sys.argv[1:]):
    for R, block in ((16, 64), (32, 32), (64, 16)):  # flux_kernels.ops._launch.gram_row_norms' tiles
        triton.compile(ASTSource(fn, sig, {"BLOCK_N": block, "R": R}), target=GPUTarget("cuda", cap, 32),
                       options={"num_warps": 4})
"""


def test_lora_norms_kernel_compiles_for_the_cards_flux_train_supports(tmp_path):
    """gram_row_norms' float64 dots compile for Ampere (sm_80, sm_86), Ada (sm_89), Hopper (sm_90) and the RTX 50
    series (sm_120), at every rank tile. (Not for sm_100 at rank 16 with Triton 3.7: there lora_norms falls back
    to the torch ops, see test_kernels_lora_norms.)"""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    import os
    import subprocess
    import sys
    from pathlib import Path

    import triton

    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("this triton wheel has no CUDA backend/ptxas")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"TRITON_CACHE_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", GRAM_AOT, "80", "86", "89", "90", "120"], env=env,
                          capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]


def test_interpreter_works_when_triton_was_imported_before_it_was_switched_on():
    """In one pytest process something else may import triton first; the kernels avoid triton.language's own
    @jit helpers (tl.sum, tl.zeros), which would then be compiled-only and crash the interpreter."""
    if importlib.util.find_spec("triton") is None or torch.cuda.is_available():
        pytest.skip("needs triton and no GPU (the interpreter path)")
    import os
    import subprocess
    import sys

    code = (
        "import os, triton.language\n"
        "os.environ['TRITON_INTERPRET'] = '1'\n"
        "from flux_kernels.runtime.registry import REGISTRY, probe\n"
        "for name in ('modulate', 'gated_residual'):  # qk_norm_rope uses the same helpers, slowly\n"
        "    r = probe(REGISTRY[name], 'cpu')\n"
        "    assert r.ok, (name, r.reason)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]


def test_attention_is_probed_at_the_first_real_forward_of_the_flux_model(fm, tmp_path):
    """sd-scripts' Flux with the attention kernel: the run's backend is not decided at install, nor by a sample
    rendered before training (no grad); the model's first training forward probes at its real shape, image plus
    text tokens, before any block runs (so before compiled blocks are traced), and only once; remove_kernels drops
    the hook."""
    from tests.conftest import tiny_flux, tiny_flux_forward

    model = tiny_flux(fm)
    options = {"attention": {"cache_path": tmp_path / "attention.json", "device": torch.device("cpu")}}
    assert patch.apply_kernels(model, unchecked(["attention"]), options=options) == ["attention"]
    dispatch = model.double_blocks[0]._flux_kernels.attention
    assert patch.attention_decision(model) is None and dispatch.run_choice is None

    def forward(img_tokens: int, txt_tokens: int, mask: bool):
        return tiny_flux_forward(model, img_tokens, txt_tokens, mask, seed=img_tokens)

    with torch.no_grad():  # a sample before training: another shape, and not every rank renders one
        forward(40, 8, mask=False)
    assert patch.attention_decision(model) is None and dispatch.run_choice is None
    out = forward(16, 8, mask=True)
    assert torch.isfinite(out).all()
    line = patch.attention_decision(model)
    assert line is not None and line.startswith(f"{dispatch.run_choice} at (1, 2, 24, 128) float32 mask=True"), line
    assert ((1, 2, 24, 128), 24, torch.float32, torch.device("cpu"), True) in dispatch.choice
    n = len(dispatch.choice)  # with verify_blocks' tiny shape: the model is on the run's device (the CPU) here
    forward(32, 8, mask=False)  # another bucket: the run's decision stays, the eager blocks probe their new shape
    assert patch.attention_decision(model) == line and len(dispatch.choice) == n + 1
    patch.remove_kernels(model)
    assert patch.RUN_PROBE not in model.__dict__ and not model._forward_pre_hooks
