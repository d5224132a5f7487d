"""flux_kernels.patches.attention.fa4 on the CPU: the two custom ops (cuDNN's forward with its log-sum-exp,
FlashAttention-4's backward; here their plain-PyTorch math) against PyTorch's SDPA, forward and backward;
torch.library's op checks; compiled blocks calling the ops when the probe chose `cudnn_fa4`; why the probe leaves it out
(not installed, an older GPU, a mask); selective checkpointing keeping its output. The CUDA path is
tests/gpu/test_attention_fa4_gpu.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import tomli
import torch
import torch.nn.functional as F

from flux_kernels.memory import selective_checkpoint
from flux_kernels.ops.reference import max_rel_err
from flux_kernels.patches.attention import fa4 as attention_fa4
from flux_kernels.patches.attention import probe as attention_probe
from flux_kernels.patches.attention.backends import BACKENDS, AttentionBackend, heads_to_tokens
from flux_kernels.patches.attention.dispatch import AttentionDispatch


def _qkv(shape, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen).to(dtype) for _ in range(4)]


def _sdpa_and_op(shape, dtype):
    q, k, v, go = _qkv(shape, dtype)
    results = []
    for fn in (F.scaled_dot_product_attention, attention_fa4.cudnn_fa4):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = fn(*leaves)
        out.backward(go)
        results.append([out.detach()] + [t.grad for t in leaves])
    return results


@pytest.mark.parametrize("shape", [(1, 2, 33, 16), (2, 3, 70, 32)])
# float64 only to 1e-6: the log-sum-exp is float32, as the kernels keep it
@pytest.mark.parametrize(("dtype", "tol"), [(torch.float64, 1e-6), (torch.float32, 2e-5), (torch.bfloat16, 3e-2)])
def test_the_ops_are_attention_and_its_gradient(shape, dtype, tol):
    want, got = _sdpa_and_op(shape, dtype)
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype and max_rel_err(g, w) <= tol


def _wide_slice(x):
    """x's values as a column slice of a buffer twice as wide: the layout of a single block's attention gradient."""
    wide = torch.zeros(*x.shape[:-1], 2 * x.shape[-1], dtype=x.dtype)
    wide[..., : x.shape[-1]] = x
    return wide[..., : x.shape[-1]]


def test_the_output_is_token_major_so_the_tokens_form_is_a_view():
    q, k, v, go = _qkv((2, 3, 11, 8), torch.float32)
    out, _ = torch.ops.flux_kernels.cudnn_lse_attention(q, k, v)
    assert out.shape == (2, 3, 11, 8) and out.transpose(1, 2).is_contiguous()
    assert attention_fa4.token_major(out).data_ptr() == out.data_ptr()  # no copy
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    tokens = attention_fa4.cudnn_fa4_tokens(*leaves)
    assert tokens.shape == (2, 11, 24) and tokens._base is not None  # a view, no copy
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    want = heads_to_tokens(F.scaled_dot_product_attention(*ref))
    assert max_rel_err(tokens, want) < 1e-5
    # the gradient in the layout a single block's backward makes (a column slice of a wider buffer)
    g = _wide_slice(go.transpose(1, 2).flatten(2))
    assert not g.is_contiguous()
    tokens.backward(g)
    want.backward(g.contiguous())
    for got, w in zip(leaves, ref, strict=True):
        assert max_rel_err(got.grad, w.grad) < 1e-5


def test_flash_attention_4_gets_aligned_gradients_as_they_are_and_others_copied():
    go = torch.randn(1, 7, 3 * 8, dtype=torch.bfloat16)
    sliced = _wide_slice(go).unflatten(2, (3, 8)).transpose(1, 2)  # row stride 48 elements: aligned
    assert attention_fa4.fa4_layout(sliced) is sliced
    broadcast = torch.ones(()).to(torch.bfloat16).expand(1, 3, 7, 8)  # the gradient of out.sum()
    copied = attention_fa4.fa4_layout(broadcast)
    assert copied is not broadcast and copied.transpose(1, 2).is_contiguous() and torch.equal(copied, broadcast)
    odd = torch.randn(1, 7, 3, 9, dtype=torch.bfloat16)[..., :8].transpose(1, 2)  # strides of 9 elements: 18 bytes
    assert attention_fa4.fa4_layout(odd) is not odd and torch.equal(attention_fa4.fa4_layout(odd), odd)


def test_the_probe_checks_a_tokens_form_with_the_gradient_layout_training_gives(tmp_path, monkeypatch):
    """A tokens form whose backward reads the gradient as if it were contiguous is right for a contiguous gradient
    and wrong for a column slice: the probe, which hands it the slice, rejects it."""

    class AssumesContiguous(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):
            return grad.as_strided(grad.shape, torch.empty(grad.shape).stride())  # wrong unless contiguous

    def careless_tokens(q, k, v, mask):
        return AssumesContiguous.apply(attention_fa4.cudnn_fa4_tokens(q, k, v, mask))

    q, k, v, go = _qkv((1, 2, 9, 8), torch.float32)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    careless_tokens(*leaves, None).backward(go.transpose(1, 2).flatten(2))  # contiguous: right
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    F.scaled_dot_product_attention(*ref).backward(go)
    assert max_rel_err(leaves[0].grad, ref[0].grad) < 1e-5
    monkeypatch.setattr(attention_probe, "unavailable", lambda backend, dev: "")
    fa4 = BACKENDS["cudnn_fa4"]
    backends = {"good": fa4, "careless": AttentionBackend("careless", fa4.run, cuda_only=False, op=fa4.op,
                                                          tokens=careless_tokens)}  # fmt: skip
    results = {r.name: r for r in attention_probe.probe_attention((1, 2, 19, 8), torch.float32, "cpu", False,
                                                            backends=backends, cache_path=tmp_path / "c.json",
                                                            reps=1)}  # fmt: skip
    assert results["good"].ok
    assert not results["careless"].ok and results["careless"].error.startswith("wrong"), results["careless"]


def test_the_log_sum_exp_is_the_softmax_statistic_flash_backwards_take():
    q, k, v, _ = _qkv((1, 2, 9, 8))
    out, lse = torch.ops.flux_kernels.cudnn_lse_attention(q, k, v)
    assert lse.shape == (1, 2, 9) and lse.dtype == torch.float32
    want = torch.logsumexp((q @ k.transpose(-1, -2)) / 8**0.5, dim=-1)
    assert torch.allclose(lse.double(), want, atol=1e-6)


def test_a_backward_without_the_row_sum_term_is_caught():
    q, k, v, go = _qkv((1, 2, 17, 8))
    out, lse = attention_fa4.reference_forward(q, k, v)
    dq, dk, dv = attention_fa4.reference_backward(go, q, k, v, out, lse)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    F.scaled_dot_product_attention(*leaves).backward(go)
    assert max_rel_err(dq, leaves[0].grad) < 1e-6  # lse is fp32
    # the same with rowsum(dO * O) dropped (a plausible slip): wrong dq and dk, which the probe's check would see
    bad_out = torch.zeros_like(out)
    bad = attention_fa4.reference_backward(go, q, k, v, bad_out, lse)
    assert max_rel_err(bad[0], leaves[0].grad) > 0.1 and torch.allclose(bad[2], dv)


def test_torch_library_op_checks():
    q, k, v, go = _qkv((1, 2, 12, 8), torch.float32)
    torch.library.opcheck(torch.ops.flux_kernels.cudnn_lse_attention.default, [t.requires_grad_() for t in (q, k, v)])
    out, lse = attention_fa4.reference_forward(q.detach(), k.detach(), v.detach())
    torch.library.opcheck(torch.ops.flux_kernels.fa4_attention_backward.default,
                          (go, q.detach(), k.detach(), v.detach(), out, lse))  # fmt: skip


def test_compiled_blocks_call_the_ops_when_the_probe_chose_them(tmp_path, monkeypatch):
    """With `cudnn_fa4` as the run's choice, traced code calls its custom ops (no graph break, no SDPA); the result
    and the gradients are the attention's."""
    monkeypatch.setattr(attention_probe, "unavailable", lambda backend, dev: "")  # as on a GPU with flash-attn-4
    backends = {"cudnn_fa4": BACKENDS["cudnn_fa4"]}
    dispatch = AttentionDispatch(cache_path=tmp_path / "c.json", backends=backends)
    assert dispatch.decide_run((1, 2, 21, 8), torch.float32, "cpu", False) == "cudnn_fa4"
    assert BACKENDS["cudnn_fa4"].compilable
    seen = []

    def backend(gm, example_inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm

    fn = torch.compile(lambda q, k, v: dispatch(q, k, v, None) * 2, backend=backend, fullgraph=True)
    q, k, v, go = _qkv((1, 2, 21, 8), torch.float32)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = fn(*leaves)
    out.backward(go)
    assert any("cudnn_lse_attention" in s for s in seen) and not any("scaled_dot_product" in s for s in seen)
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    (F.scaled_dot_product_attention(*ref) * 2).backward(go)
    assert max_rel_err(out, F.scaled_dot_product_attention(q, k, v) * 2) < 1e-5
    for g, w in zip(leaves, ref, strict=True):
        assert max_rel_err(g.grad, w.grad) < 1e-5


def test_why_the_probe_leaves_it_out(monkeypatch):
    backend = BACKENDS["cudnn_fa4"]
    assert backend.requires == "flash_attn.cute" and backend.min_capability == (9, 0)
    monkeypatch.setattr(attention_probe, "importable", lambda module: False)
    assert attention_probe.unavailable(backend, torch.device("cpu")) == "needs CUDA (device is cpu)"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda dev=None: (8, 6))
    assert attention_probe.unavailable(backend, torch.device("cuda")) == "needs sm90 or newer (the GPU is sm86)"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda dev=None: (9, 0))
    assert attention_probe.unavailable(backend, torch.device("cuda")) == (
        f"flash_attn.cute is not installed (pip install {attention_fa4.DISTRIBUTION})"
    )
    monkeypatch.setattr(attention_probe, "importable", lambda module: True)
    assert attention_probe.unavailable(backend, torch.device("cpu")) == "needs CUDA (device is cpu)"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda dev=None: (8, 9))
    assert attention_probe.unavailable(backend, torch.device("cuda")) == "needs sm90 or newer (the GPU is sm89)"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda dev=None: (12, 0))
    assert attention_probe.unavailable(backend, torch.device("cuda")) == ""
    q, k, v, _ = _qkv((1, 2, 5, 8))
    with pytest.raises(NotImplementedError, match="no attention mask"):
        attention_fa4.cudnn_fa4(q, k, v, torch.ones(1, 2, 5, 5, dtype=torch.bool))


def test_a_missing_parent_package_reads_as_not_installed():
    assert not attention_probe.importable("surely_not_a_package_here.cute")
    assert attention_probe.importable("torch.nn")


def test_the_probe_with_a_mask_rejects_it(tmp_path, monkeypatch):
    monkeypatch.setattr(attention_probe, "unavailable", lambda backend, dev: "")
    backends = {"cudnn_fa4": BACKENDS["cudnn_fa4"],
                "math": AttentionBackend("math", BACKENDS["sdpa_math"].run, cuda_only=False)}  # fmt: skip
    results = attention_probe.probe_attention((1, 2, 19, 8), torch.float32, "cpu", True, backends=backends,
                                        cache_path=tmp_path / "c.json", reps=1)  # fmt: skip
    by_name = {r.name: r for r in results}
    assert not by_name["cudnn_fa4"].ok and "no attention mask" in by_name["cudnn_fa4"].error
    assert attention_probe.chosen(results) == "math"
    unmasked = attention_probe.probe_attention((1, 2, 19, 8), torch.float32, "cpu", False, backends=backends,
                                         cache_path=tmp_path / "c.json", reps=1)  # fmt: skip
    assert {r.name: r for r in unmasked}["cudnn_fa4"].ok


def test_selective_checkpointing_keeps_its_output():
    q, k, v, _ = _qkv((1, 2, 5, 8))
    assert selective_checkpoint.keeps(torch.ops.flux_kernels.cudnn_lse_attention.default, (q, k, v))
    assert not selective_checkpoint.keeps(torch.ops.flux_kernels.fa4_attention_backward.default, (q, k, v))


def test_the_cache_key_names_flash_attn_4():
    assert "flash-attn-4" in attention_probe.library_versions()


def test_the_environment_can_leave_a_backend_out_of_the_probe(tmp_path, monkeypatch):
    monkeypatch.setattr(attention_probe, "unavailable", lambda backend, dev: "")
    backends = {"cudnn_fa4": BACKENDS["cudnn_fa4"],
                "math": AttentionBackend("math", BACKENDS["sdpa_math"].run, cuda_only=False)}  # fmt: skip
    monkeypatch.setenv(attention_probe.EXCLUDE_ENV, "cudnn_fa4, other")
    results = attention_probe.probe_attention((1, 2, 19, 8), torch.float32, "cpu", False, backends=backends,
                                        cache_path=tmp_path / "c.json", reps=1)  # fmt: skip
    assert [r.name for r in results] == ["math"]
    monkeypatch.delenv(attention_probe.EXCLUDE_ENV)
    results = attention_probe.probe_attention((1, 2, 19, 8), torch.float32, "cpu", False, backends=backends,
                                        cache_path=tmp_path / "c.json", reps=1)  # fmt: skip
    assert sorted(r.name for r in results) == ["cudnn_fa4", "math"]  # another cache entry: both tried


def test_under_autocast_it_takes_the_dtype_sdpa_would():
    q, k, v, go = _qkv((1, 2, 23, 16), torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = F.scaled_dot_product_attention(q, k, v)
        got = attention_fa4.cudnn_fa4(q, k, v)
    assert got.dtype == want.dtype == torch.bfloat16 and max_rel_err(got, want) < 3e-2
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = attention_fa4.cudnn_fa4(*leaves)
    out.backward(go.to(out.dtype))
    assert all(t.grad.dtype == torch.float32 for t in leaves)  # gradients back in the inputs' dtype


def test_the_version_it_names_is_the_one_flux_trains_fa4_extra_pins():
    """What the probe and the doctor tell a user to install is what `pip install ".[fa4]"` installs."""
    pyproject = tomli.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    assert pyproject["project"]["optional-dependencies"]["fa4"] == [attention_fa4.DISTRIBUTION]
