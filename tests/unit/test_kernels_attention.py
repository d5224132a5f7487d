"""Attention backend probe on CPU: the math backend passes, a deliberately wrong backend is rejected with the
reason, unavailable ones say why, SageAttention is never chosen; the cache key moves with versions."""

from __future__ import annotations

import contextlib
import json
import re

import pytest
import torch
import torch.nn.functional as F

from flux_kernels.patches.attention import probe as attention_probe
from flux_kernels.patches.attention.backends import BACKENDS, AttentionBackend, heads_to_tokens
from flux_kernels.patches.attention.dispatch import AttentionDispatch
from flux_kernels.patches.attention.probe import BackendResult, cache_key, chosen, probe_attention
from tests.conftest import undoing

SHAPE = (1, 2, 33, 16)


def _math(q, k, v, mask):
    return BACKENDS["sdpa_math"].run(q, k, v, mask)


def _slow_math(q, k, v, mask):  # correct, and slower by the test's clock (FAKE_MS)
    return _math(q, k, v, mask)


def _wrong(q, k, v, mask):  # forgets the mask and scales the output: plausible-looking, wrong
    return F.scaled_dot_product_attention(q, k, v) * 1.05


def _no_backward(q, k, v, mask):
    return _math(q.detach(), k.detach(), v.detach(), mask)


FAKE_MS = {"math": 1.0, "slow_math": 2.0, "draws": 3.0}


def fake_timer(name, run):
    run()
    return FAKE_MS[name]


FAKES = {
    "math": AttentionBackend("math", _math, cuda_only=False),
    "slow_math": AttentionBackend("slow_math", _slow_math, cuda_only=False),
    "wrong": AttentionBackend("wrong", _wrong, cuda_only=False),
    "no_backward": AttentionBackend("no_backward", _no_backward, cuda_only=False),
    "gpu_only": AttentionBackend("gpu_only", _math),
    "sage": BACKENDS["sage"],
}


@pytest.mark.parametrize("with_mask", [False, True])
def test_probe_rejects_wrong_backends_and_picks_the_fastest_correct(tmp_path, with_mask):
    path = tmp_path / "c.json"
    results = probe_attention(SHAPE, torch.float32, "cpu", with_mask, backends=FAKES, cache_path=path, timer=fake_timer)
    by_name = {r.name: r for r in results}
    assert by_name["math"].ok and by_name["slow_math"].ok
    assert by_name["math"].max_err < 1e-5 and by_name["math"].ms_fwd_bwd == 1.0
    assert chosen(results) == "math" and results[0].name == "math"  # fastest correct first
    assert not by_name["wrong"].ok and by_name["wrong"].error.startswith("wrong: max rel. error")
    assert not by_name["no_backward"].ok and "RuntimeError" in by_name["no_backward"].error
    assert by_name["gpu_only"].error == "needs CUDA (device is cpu)"
    assert not by_name["sage"].ok and "no backward" in by_name["sage"].error


def test_the_probe_leaves_the_runs_random_streams_as_they_were(tmp_path):
    """A backend that draws random numbers (as a fused op's dropout state can): the run, seeded before the probe,
    goes on drawing what it would have drawn had the verdict come from the cache."""

    def draws(q, k, v, mask):
        torch.rand(3)  # the global generator
        return _math(q, k, v, mask)

    backends = {"math": FAKES["math"], "draws": AttentionBackend("draws", draws, cuda_only=False)}
    before = torch.get_rng_state()
    draws(*(torch.randn(SHAPE) for _ in range(3)), None)
    assert not torch.equal(torch.get_rng_state(), before)  # it does draw
    torch.manual_seed(7)
    want = torch.rand(4)
    torch.manual_seed(7)
    results = probe_attention(SHAPE, torch.float32, "cpu", False, backends=backends, use_cache=False, timer=fake_timer)
    assert {r.name for r in results if r.ok} == {"math", "draws"}
    assert torch.equal(torch.rand(4), want)
    # a verdict from the cache: its choice is run again (checked, not timed), with the streams put back the same way
    only, path = {"draws": backends["draws"]}, tmp_path / "c.json"
    probe_attention(SHAPE, torch.float32, "cpu", False, backends=only, cache_path=path, timer=fake_timer)
    torch.manual_seed(7)
    assert chosen(probe_attention(SHAPE, torch.float32, "cpu", False, backends=only, cache_path=path)) == "draws"
    assert torch.equal(torch.rand(4), want)


def test_real_backends_on_cpu(tmp_path):
    results = probe_attention(SHAPE, torch.float32, "cpu", True, cache_path=tmp_path / "c.json", reps=2)
    by_name = {r.name: r for r in results}
    assert by_name["sdpa_math"].ok and by_name["sdpa"].ok
    assert by_name["sdpa_cudnn"].error == "needs CUDA (device is cpu)"
    assert by_name["xformers"].ok or by_name["xformers"].error
    assert chosen(results) in ("sdpa", "sdpa_math", "sdpa_flash")


def _with_calls_counted(backends):
    """The backends with each call of theirs counted by name."""
    calls = {}

    def counted(name, run):
        def call(*a):
            calls[name] = calls.get(name, 0) + 1
            return run(*a)

        return call

    wrapped = {n: AttentionBackend(n, counted(n, b.run), cuda_only=b.cuda_only, trainable=b.trainable, note=b.note)
               for n, b in backends.items()}  # fmt: skip
    return wrapped, calls


def test_results_are_cached_per_key_and_the_cached_choice_is_checked_again(tmp_path):
    path = tmp_path / "cache.json"
    backends, calls = _with_calls_counted(FAKES)
    first = probe_attention(SHAPE, torch.float32, "cpu", False, backends=backends, cache_path=path, timer=fake_timer)
    key = cache_key(SHAPE, torch.float32, "cpu", False, backends=list(FAKES))
    assert json.loads(path.read_text())[key][0]["chosen"] and chosen(first) == "math"
    assert calls["slow_math"] >= 2  # checked, then timed

    def no_timing(name, run):
        raise AssertionError("timed again instead of reading the cache")

    calls.clear()
    assert probe_attention(SHAPE, torch.float32, "cpu", False, backends=backends, cache_path=path,
                           timer=no_timing) == first  # fmt: skip
    assert calls == {"math": 1}  # the cached choice, run once against the truth; nothing else
    timed = []
    probe_attention((1, 2, 35, 16), torch.float32, "cpu", False, backends=backends, cache_path=path,
                    timer=lambda name, run: timed.append(name) or FAKE_MS[name])  # fmt: skip
    assert sorted(timed) == ["math", "slow_math"]  # another shape: probed afresh


def test_the_verdict_line_says_how_long_the_probe_took(tmp_path, caplog):
    dispatch = AttentionDispatch(cache_path=tmp_path / "c.json", backends={"math": FAKES["math"]})
    with caplog.at_level("INFO", logger="flux_kernels.patches.attention"):
        dispatch.prepare(SHAPE, torch.float32, "cpu", False)
        dispatch.prepare(SHAPE, torch.float32, "cpu", False)  # the cached verdict, checked again
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and all(re.search(r"mask=False: math \(fwd\+bwd: math [\d.]+ ms; \d+\.\d s\)$", x)
                                   for x in lines), lines  # fmt: skip


def test_where_nothing_passes_and_pytorchs_own_sdpa_failed_too_it_is_an_error(tmp_path):
    """No backend correct, the SDPA that sd-scripts itself calls among the rejected: nothing is left to fall back
    on, and a rejected backend is never used (the failure mode of a torch build that computes wrong attention on a
    new card)."""
    from flux_kernels.runtime.errors import KernelError

    backends = {"sdpa": AttentionBackend("sdpa", _wrong, cuda_only=False), "no_backward": FAKES["no_backward"]}
    dispatch = AttentionDispatch(cache_path=tmp_path / "c.json", backends=backends)
    want = r"attention: no backend is correct at \(1, 2, 33, 16\) float32 mask=False on cpu \(rejected: sdpa: wrong: "
    with pytest.raises(KernelError, match=want + r".*no_backward: RuntimeError"):
        dispatch.prepare(SHAPE, torch.float32, "cpu", False)
    assert dispatch.choice == {}


def test_where_nothing_passes_but_pytorchs_own_sdpa_was_not_probed_it_falls_back_to_it(tmp_path):
    dispatch = AttentionDispatch(cache_path=tmp_path / "c.json", backends={"wrong": FAKES["wrong"]})
    assert dispatch.prepare(SHAPE, torch.float32, "cpu", False) == "sdpa"


def test_a_cached_choice_that_is_wrong_here_is_probed_again(tmp_path, caplog):
    """The verdict on disk chose a backend that now gives wrong results under the same name and versions (a kernel
    loaded from a stale disk cache, say): the check rejects it, every backend is probed again, and the cache is
    rewritten."""
    path = tmp_path / "cache.json"
    backends = {"math": FAKES["math"], "slow_math": FAKES["slow_math"]}
    assert chosen(probe_attention(SHAPE, torch.float32, "cpu", False, backends=backends, cache_path=path,
                                  timer=fake_timer)) == "math"  # fmt: skip
    broken = {"math": AttentionBackend("math", _wrong, cuda_only=False), "slow_math": FAKES["slow_math"]}
    with caplog.at_level("WARNING", logger=attention_probe.__name__):
        results = probe_attention(SHAPE, torch.float32, "cpu", False, backends=broken, cache_path=path,
                                  timer=fake_timer)  # fmt: skip
    assert chosen(results) == "slow_math"
    assert "the cached choice math failed its check" in caplog.text and "wrong: max rel. error" in caplog.text
    key = cache_key(SHAPE, torch.float32, "cpu", False, backends=list(broken))
    assert [r["name"] for r in json.loads(path.read_text())[key] if r["chosen"]] == ["slow_math"]


def test_cache_key_changes_with_versions_device_and_shape():
    versions = {"torch": "2.11.0", "cuda": "13.0", "cudnn": "91000", "xformers": "none", "flash_attn": "none"}
    base = cache_key(SHAPE, torch.bfloat16, "cpu", False, versions)
    assert base == cache_key(SHAPE, torch.bfloat16, "cpu", False, dict(versions))
    assert base != cache_key(SHAPE, torch.bfloat16, "cpu", False, {**versions, "torch": "2.12.0"})
    assert base != cache_key(SHAPE, torch.bfloat16, "cpu", False, {**versions, "cudnn": "91100"})
    assert base != cache_key(SHAPE, torch.bfloat16, "cpu", False, {**versions, "xformers": "0.0.30"})
    assert base != cache_key(SHAPE, torch.float16, "cpu", False, versions)
    assert base != cache_key(SHAPE, torch.bfloat16, "cpu", True, versions)
    assert base != cache_key((1, 2, 34, 16), torch.bfloat16, "cpu", False, versions)
    h200 = {"type": "cuda", "name": "NVIDIA H200", "capability": (9, 0)}
    rtx = {"type": "cuda", "name": "NVIDIA GeForce RTX 5090", "capability": (12, 0)}
    assert "sm90" in cache_key(SHAPE, torch.bfloat16, h200, False, versions)
    assert cache_key(SHAPE, torch.bfloat16, h200, False, versions) != cache_key(
        SHAPE, torch.bfloat16, rtx, False, versions
    )
    assert set(attention_probe.library_versions()) >= {"torch", "cuda", "cudnn", "xformers", "flash_attn"}


def test_dispatch_probes_once_per_shape_and_uses_the_choice(tmp_path):
    calls = []

    def counting(q, k, v, mask):
        calls.append(q.shape)
        return _math(q, k, v, mask)

    dispatch = AttentionDispatch(cache_path=tmp_path / "c.json", backends={"counting": AttentionBackend(
        "counting", counting, cuda_only=False), "wrong": FAKES["wrong"]})  # fmt: skip
    q, k, v = (torch.randn(SHAPE) for _ in range(3))
    out = dispatch(q, k, v, None)
    assert torch.allclose(out, F.scaled_dot_product_attention(q, k, v), atol=1e-5)
    assert dispatch.choice == {(SHAPE, SHAPE[2], torch.float32, torch.device("cpu"), False): "counting"}
    n = len(calls)
    dispatch(q, k, v, None)
    assert len(calls) == n + 1  # no second probe


def _counting(calls):
    def run(q, k, v, mask):
        calls.append(tuple(q.shape))
        return _math(q, k, v, mask)

    return run


def test_traced_code_uses_the_run_choice_and_nothing_else(tmp_path, monkeypatch):
    """Compiled code never probes and calls plain SDPA; the run's backend, which `decide_run` chose at the run's
    real shape, is switched on around the compiled call (`compiled_context`), for every shape. A choice made eagerly
    at another shape (verify_blocks at a tiny shape, where the math backend may win) never reaches compiled code:
    math at 4608 tokens materialises [B, H, L, L] fp32 weights per block."""
    calls = []
    backends = {"counting": AttentionBackend("counting", _counting(calls), cuda_only=False, sdpa_kind="MATH")}
    dispatch = AttentionDispatch(cache_path=tmp_path / "c.json", backends=backends)
    tiny = [torch.randn(SHAPE) for _ in range(3)]
    dispatch(*tiny, None)  # eager: probes, chooses "counting" at SHAPE
    assert dispatch.choice and isinstance(dispatch.compiled_context(), contextlib.nullcontext)  # no run choice yet
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    big = [torch.randn(1, 2, 47, 16) for _ in range(3)]
    calls.clear()
    out = dispatch(*big, None)
    dispatch(*tiny, None)
    assert calls == [] and torch.allclose(out, F.scaled_dot_product_attention(*big), atol=1e-5)  # PyTorch's own
    assert dispatch.decide_run(big[0].shape, torch.float32, "cpu", False) == "counting"
    assert dispatch.run_line == "counting at (1, 2, 47, 16) float32 mask=False"
    calls.clear()  # the probe at the run's shape ran the backend
    assert torch.backends.cuda.flash_sdp_enabled()
    with dispatch.compiled_context():  # the math backend alone, as the chosen backend's sdpa_kind says
        assert torch.backends.cuda.math_sdp_enabled() and not torch.backends.cuda.flash_sdp_enabled()
        dispatch(*big, None)
    assert torch.backends.cuda.flash_sdp_enabled()  # put back after the call
    assert calls == [] and len(dispatch.choice) == 2  # traced code calls no backend itself, probes nothing


def test_a_backend_that_does_not_compile_is_kept_out_of_compiled_code(tmp_path, monkeypatch):
    calls = []
    backends = {"opaque": AttentionBackend("opaque", _counting(calls), cuda_only=False)}  # e.g. xformers
    dispatch = AttentionDispatch(cache_path=tmp_path / "c.json", backends=backends)
    assert dispatch.decide_run(SHAPE, torch.float32, "cpu", False) == "sdpa"
    assert dispatch.run_line.endswith("; compiled blocks use sdpa (opaque is not compiled)")
    q, k, v = (torch.randn(SHAPE) for _ in range(3))
    calls.clear()
    dispatch(q, k, v, None)
    assert calls == [SHAPE]  # eager code still uses the probe's winner
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    out = dispatch(q, k, v, None)
    assert calls == [SHAPE] and torch.allclose(out, F.scaled_dot_product_attention(q, k, v), atol=1e-5)


def test_calls_away_from_the_training_device_probe_nothing(tmp_path, caplog):
    """verify_blocks runs the patched blocks on tiny inputs wherever the model is (the CPU, before it moves to
    the GPU): no probe there (it used to log 'sdpa_math ... sdpa_cudnn: needs CUDA' for a GPU run), PyTorch's SDPA."""
    calls = []
    backends = {"counting": AttentionBackend("counting", _counting(calls), cuda_only=False, sdpa_kind="MATH")}
    dispatch = AttentionDispatch(cache_path=tmp_path / "c.json", backends=backends)
    dispatch.device = torch.device("cuda", 0)  # the run's device; the inputs below are on the CPU
    q, k, v = (torch.randn(SHAPE) for _ in range(3))
    with caplog.at_level("INFO", logger="flux_kernels.patches.attention"):
        out = dispatch(q, k, v, None)
    assert calls == [] and dispatch.choice == {} and caplog.records == []
    assert torch.allclose(out, F.scaled_dot_product_attention(q, k, v), atol=1e-5)


def test_probe_at_first_call_is_isolated_from_the_callers_autograd_state(tmp_path):
    """The first call at a shape probes inside the caller's forward: under gradient checkpointing (saved-tensor
    hooks), no_grad or autocast. None of it may reach the probe, or the checkpointed forward and its
    recomputation save different tensors (CheckpointError), or the probe's verdict depends on the context."""
    dispatch = AttentionDispatch(cache_path=tmp_path / "c.json", backends={"math": FAKES["math"]})
    packed = []

    def pack(t):
        packed.append(t.shape)
        return t

    q, k, v = (torch.randn(SHAPE) for _ in range(3))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.no_grad():
        dispatch(q, k, v, None)
    assert packed == [] and dispatch.choice  # probed, nothing saved through the caller's hooks, verdict "math"
    assert list(dispatch.choice.values()) == ["math"]

    q, k, v = (torch.randn(SHAPE, requires_grad=True) for _ in range(3))
    fresh = AttentionDispatch(cache_path=tmp_path / "d.json", backends={"math": FAKES["math"]})
    out = torch.utils.checkpoint.checkpoint(fresh, q, k, v, None, use_reentrant=False)
    out.sum().backward()  # the first call probed inside the checkpointed forward; the recomputation did not
    assert q.grad is not None and len(fresh.choice) == 1


def test_backend_result_is_plain_data():
    r = BackendResult("x", False, "why")
    assert (r.max_err, r.ms_fwd_bwd, r.chosen) == (None, None, False)


def test_a_backend_with_quadratic_memory_is_not_tried_at_long_sequences(tmp_path, monkeypatch):
    """The probe runs at the run's first forward; the math backend at 4608 tokens would borrow ~4 GiB there."""
    backends = {name: BACKENDS[name] for name in ("sdpa", "sdpa_math")}
    results = probe_attention(SHAPE, torch.float32, "cpu", False, backends=backends, use_cache=False,
                              timer=lambda name, fn: 1.0)  # fmt: skip
    assert all(r.ok for r in results)  # 2 x 33^2 weights: tried
    monkeypatch.setattr(attention_probe, "QUADRATIC_PROBE_BYTES", 2 * 33 * 33 * 4 - 1)
    results = {r.name: r for r in probe_attention(SHAPE, torch.float32, "cpu", False, backends=backends,
                                                  use_cache=False, timer=lambda name, fn: 1.0)}  # fmt: skip
    assert results["sdpa"].chosen and not results["sdpa_math"].ok
    assert results["sdpa_math"].error.startswith("not tried at 33 tokens: it materialises [B, H, L, L] weights")


def _decide_on_rank(rank: int, world: int, init: str, out_dir: str) -> None:
    """One process of the test below: its own probe verdict (rank 0: math, rank 1: PyTorch's own), then decide_run."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    with undoing(dist.destroy_process_group):
        backends = {name: BACKENDS[name] for name in ("sdpa", "sdpa_math")}
        dispatch = AttentionDispatch(cache_path=None, backends=backends)
        own = "sdpa_math" if rank == 0 else "sdpa"
        dispatch.choice[dispatch.shape_key(SHAPE, torch.float32, "cpu", False)] = own
        chosen_here = dispatch.decide_run(SHAPE, torch.float32, "cpu", False)
        with open(f"{out_dir}/rank{rank}.json", "w") as f:
            json.dump([own, chosen_here, dispatch.run_line], f)


def test_every_rank_uses_rank_zeros_attention_choice(tmp_path):
    """Several processes: each probes its own GPU and may choose differently on timing noise; all take rank 0's."""
    import torch.multiprocessing as mp

    world = 2
    mp.spawn(_decide_on_rank, args=(world, f"file://{tmp_path / 'rendezvous'}", str(tmp_path)), nprocs=world)
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    assert [own for own, _, _ in got] == ["sdpa_math", "sdpa"]  # they measured differently
    assert [chosen for _, chosen, _ in got] == ["sdpa_math", "sdpa_math"]
    assert got[1][2] == got[0][2] and got[0][2].startswith("sdpa_math at (1, 2, 33, 16)")


def test_heads_to_tokens_is_the_blocks_rearrange_and_hands_back_a_contiguous_gradient():
    """The blocks' "B H L D -> B L (H D)" after attention, as a custom op whose backward makes the attention's
    gradient contiguous (cuDNN attention keeps the gradient layout of its first backward at a shape)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 5, 4, generator=gen).requires_grad_()
    torch.library.opcheck(heads_to_tokens, (x,))
    out = heads_to_tokens(x)
    assert torch.equal(out, x.transpose(1, 2).flatten(2))
    wide = torch.randn(2, 5, 20, generator=gen)  # the single block's gradient: a slice of a wider one
    for grad in (torch.randn(2, 5, 12, generator=gen), wide[..., :12]):
        (gx,) = torch.autograd.grad(out, x, grad, retain_graph=True)
        assert gx.is_contiguous()
        assert torch.equal(gx, grad.reshape(2, 5, 3, 4).transpose(1, 2))
