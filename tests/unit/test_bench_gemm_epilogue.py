"""scripts/bench_gemm_epilogue.py: what it says where it cannot run (the timing itself needs quack-kernels on an sm90
GPU), and that its variants compare each quack result with the matching cuBLAS product."""

from __future__ import annotations

import types

import pytest
import torch

from tests.conftest import load_script


@pytest.fixture(scope="module")
def epilogue():
    return load_script("bench_gemm_epilogue")


def test_without_a_gpu_it_says_what_is_missing_and_exits_2(epilogue, capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: the benchmark would run for real")
    assert epilogue.main([]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


class FakeQuack:
    """quack.gemm_interface's three calls computed with torch, off by `factor` (1.0: right)."""

    def __init__(self, factor=1.0):
        self.factor = factor
        self.configs_used = []
        self.gemm_tuned = types.SimpleNamespace(fn=self._at_config)

    def _at_config(self, a, b, out, bias=None, config=None):
        self.configs_used.append(config)
        out.copy_(self.gemm(a, b, bias))

    def gemm(self, a, b, bias=None, tuned=True):
        return (a @ b + (0 if bias is None else bias)) * self.factor

    def gemm_act(self, a, b, bias=None, activation=None, tuned=True, postact_out=None):
        pre = self.gemm(a, b, bias)
        post = torch.nn.functional.gelu(pre, approximate="tanh")
        return pre, post if postact_out is None else postact_out.copy_(post)

    def gemm_dact(self, a, b, pre, activation=None, tuned=True, dx_out=None):
        dx = torch.ops.aten.gelu_backward(self.gemm(a, b), pre, approximate="tanh")
        return dx if dx_out is None else dx_out.copy_(dx), None


@pytest.mark.parametrize("factor, right", [(1.0, True), (1.05, False)])
def test_each_quack_variant_is_checked_against_the_matching_cublas_product(epilogue, factor, right):
    rows = epilogue.variants(24, 32, 80, FakeQuack(factor), False, torch.Generator().manual_seed(0), dev="cpu")
    assert [label for label, _, _ in rows][:2] == ["fwd cuBLAS addmm", "fwd cuBLAS addmm, GELU"]
    checked = [(label, epilogue.rel_l2_err(fn(), want)) for label, fn, want in rows if want is not None]
    assert [label for label, _ in checked] == ["fwd quack gemm", "fwd quack gemm_act", "bwd quack gemm",
                                               "bwd quack gemm_dact"]  # fmt: skip
    assert all((err < 1e-2) == right for _, err in checked), checked


@pytest.mark.parametrize("factor, right", [(1.0, True), (1.05, False)])
def test_the_single_block_forms_write_into_slices_and_are_checked_against_the_blocks_own(epilogue, factor, right):
    """The quack forms of the single block's MLP columns (outputs written into column slices of linear2's input and
    linear1's gradient) against what a compiled block computes now, at small odd sizes; compile left out (eager)."""
    sizes = {"tokens": 24, "hidden": 16, "qkv": 48, "mlp": 40}
    gen = torch.Generator().manual_seed(0)
    rows = epilogue.block_variants(FakeQuack(factor), False, gen, dev="cpu", compile=lambda f, **_: f, sizes=sizes)
    checked = {label: epilogue.rel_l2_err(fn()[-1], want) for label, fn, want in rows if want is not None}
    assert sorted(checked) == [f"blk {d} quack{how}" for d in ("bwd", "fwd") for how in (" into slice", ", graphed")]
    assert all((err < 1e-2) == right for err in checked.values()), checked


@pytest.mark.parametrize("how, bias", [("nk", True), ("kn", False)])
@pytest.mark.parametrize("factor, right", [(1.0, True), (1.05, False)])
def test_each_projection_is_checked_against_cublas_in_the_layout_the_step_uses(epilogue, how, bias, factor, right):
    """A Linear's forward (weight stored [N, K], read transposed, with its bias) and its input gradient (the same
    weight read as [K, N]) at small odd sizes: both quack variants are checked against torch's product."""
    case = ("p", 1, 24, 40, 56, how, bias)
    quack = FakeQuack(factor)
    configs = [("256x192 c12", "a config"), ("128x256 c21", "another")]
    rows = epilogue.projection_variants(case, quack, torch.Generator().manual_seed(0), dev="cpu", configs=configs)
    assert [label for label, _, want in rows if want is None] == ["cuBLAS"]
    assert [label for label, _, _ in rows][1:] == ["quack default", "quack tuned", "quack 256x192 c12",
                                                   "quack 128x256 c21"]  # fmt: skip
    assert rows[0][1]().shape == (24, 56)
    errs = [epilogue.rel_l2_err(fn(), want) for _, fn, want in rows if want is not None]
    assert len(errs) == 4 and all((err < 1e-2) == right for err in errs), errs
    assert quack.configs_used == ["a config", "another"]  # each variant at its own configuration
    untuned = epilogue.projection_variants(case, quack, torch.Generator().manual_seed(0), dev="cpu", tuned=False)
    assert [label for label, _, _ in untuned] == ["cuBLAS", "quack default"]


def test_a_sustained_timer_gives_the_rows_joules_and_rate_a_joule(epilogue):
    variant = ("v", lambda: torch.ones(2, 2), torch.ones(2, 2))
    row = epilogue.measure(variant, 10**12, 5, {"shape": "s"}, timer=lambda fn: {"ms": 2.0, "j": 0.5, "w": 250.0})
    assert row["tflops"] == pytest.approx(500.0) and row["tflop_per_j"] == pytest.approx(2.0) and row["w"] == 250.0
    assert row["rel_err"] == 0.0
    bare = epilogue.measure(variant, 10**12, 5, {"shape": "s"}, timer=lambda fn: {"ms": 2.0, "j": None, "w": None})
    assert "tflop_per_j" not in bare and "j" not in bare and bare["tflops"] == pytest.approx(500.0)


def test_the_step_totals_weight_each_projection_by_its_calls_and_best_takes_each_ones_fastest(epilogue):
    rows = [{"shape": "a", "calls": 38, "variant": "cuBLAS", "ms": 1.0},
            {"shape": "a", "calls": 38, "variant": "quack", "ms": 0.5},
            {"shape": "b", "calls": 19, "variant": "cuBLAS", "ms": 2.0},
            {"shape": "b", "calls": 19, "variant": "quack", "error": "RuntimeError: no"}]  # fmt: skip
    assert epilogue.step_totals(rows) == {"cuBLAS": 38 + 38, "quack": None, "best": 19 + 38}
    assert all(name.startswith(("single", "img", "txt")) for name, *_ in epilogue.PROJECTIONS)
    assert sum(calls for _, calls, *_ in epilogue.PROJECTIONS) == 4 * 38 + 16 * 19
