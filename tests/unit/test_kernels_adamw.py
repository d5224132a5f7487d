"""adamw_step: torch's AdamW put on its fused step, against the step sd-scripts builds, on CPU (torch has a fused
AdamW there too, so the real kernel runs)."""

from __future__ import annotations

import io
import logging

import pytest
import torch

from flux_kernels.ops import adamw

pytestmark = pytest.mark.skipif(
    "cpu" not in adamw._fused_devices(), reason=f"torch {torch.__version__} has no fused AdamW on the CPU"
)


def make_params(seed: int = 0) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    shapes = [(16, 48), (48, 16), (5,), (16, 48)]
    return [torch.nn.Parameter(torch.randn(*s, generator=gen) * 0.1) for s in shapes]


def train(opt, params, steps: int, seed: int = 1) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen) + p.detach()
        opt.step()


@pytest.fixture
def fused_calls(monkeypatch):
    """How many times torch's fused AdamW kernel ran."""
    calls = []
    real = torch._fused_adamw_

    def spy(*args, **kwargs):
        calls.append(len(args[0]))
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "_fused_adamw_", spy)
    return calls


def test_installed_the_fused_kernel_runs_and_trains_like_the_plain_step(fused_calls):
    plain_params, fused_params = make_params(), make_params()
    plain = torch.optim.AdamW(plain_params, lr=1e-2, weight_decay=0.01)
    fused = torch.optim.AdamW(fused_params, lr=1e-2, weight_decay=0.01)
    line = adamw.install(fused)
    assert line.startswith("adamw_step: 4 tensors in 1 group(s)")
    train(plain, plain_params, 5)
    assert fused_calls == []  # the plain optimizer never takes the fused path
    train(fused, fused_params, 5)
    assert fused_calls == [4] * 5  # one call per step for all four tensors
    for a, b, start in zip(plain_params, fused_params, make_params(), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)
        assert (b - start).abs().max() > 1e-3  # it trained
    assert all(float(fused.state[p]["step"]) == 5 for p in fused_params)


def test_uninstall_puts_the_plain_step_back(fused_calls):
    params = make_params()
    opt = torch.optim.AdamW(params, lr=1e-2)
    adamw.install(opt)
    train(opt, params, 1)
    assert adamw.uninstall(opt) and not adamw.uninstall(opt)
    train(opt, params, 2)
    assert fused_calls == [4]  # only the step taken while installed
    assert (opt.param_groups[0]["fused"], opt.param_groups[0]["foreach"]) == (None, None)


def test_saved_state_resumes_the_same_with_or_without_the_kernel(fused_calls):
    """Step counts are saved as host scalars (plain AdamW's form), and a loaded state (its groups come with it) is
    fused again at the next step: 3 steps, save, 3 more steps, all equal to 6 uninterrupted plain steps."""
    ref_params = make_params()
    ref = torch.optim.AdamW(ref_params, lr=1e-2, weight_decay=0.01)
    train(ref, ref_params, 3, seed=1)
    train(ref, ref_params, 3, seed=2)

    first_params = make_params()
    first = torch.optim.AdamW(first_params, lr=1e-2, weight_decay=0.01)
    adamw.install(first)
    train(first, first_params, 3, seed=1)
    live = {id(first.state[p]["step"]) for p in first_params}
    as_saved = first.state_dict()
    assert not live & {id(s["step"]) for s in as_saved["state"].values()}  # copies: the live counts stay put
    assert {id(first.state[p]["step"]) for p in first_params} == live
    buffer = io.BytesIO()
    torch.save(as_saved, buffer)  # as accelerate saves it: a file, nothing shared with the live state
    buffer.seek(0)
    saved = torch.load(buffer)  # the checks on the saved state; each resume below loads the file again
    assert all(s["step"].device.type == "cpu" and s["step"].dtype == torch.float32 for s in saved["state"].values())
    assert (saved["param_groups"][0]["fused"], saved["param_groups"][0]["foreach"]) == (None, None)
    assert first.param_groups[0]["fused"] is True  # the live optimizer is still fused

    for with_kernel in (True, False):
        params = [torch.nn.Parameter(p.detach().clone()) for p in first_params]
        opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)
        if with_kernel:
            adamw.install(opt)
        buffer.seek(0)
        opt.load_state_dict(torch.load(buffer))  # the loaded tensors are trained in place: a fresh copy each time
        before = len(fused_calls)
        train(opt, params, 3, seed=2)
        assert len(fused_calls) - before == (3 if with_kernel else 0)  # without it: the plain AdamW as built
        for a, b in zip(ref_params, params, strict=True):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)


def test_what_it_does_not_take():
    assert "not torch.optim.AdamW" in adamw.problem(torch.optim.SGD(make_params(), lr=0.1))
    assert "fused already" in adamw.problem(torch.optim.AdamW(make_params(), fused=True))
    assert "differentiable" in adamw.problem(torch.optim.AdamW(make_params(), differentiable=True))
    assert adamw.problem(torch.optim.AdamW([torch.nn.Parameter(torch.ones(3, dtype=torch.float64))])) is None
    with pytest.raises(ValueError, match="adamw_step: the optimizer is torch.optim.sgd.SGD"):
        adamw.install(torch.optim.SGD(make_params(), lr=0.1))
    assert adamw.problem(torch.optim.Adam(make_params())) is None


def test_the_probe_passes_here_and_rejects_a_wrong_step(monkeypatch):
    from flux_kernels.runtime import registry

    spec = registry.REGISTRY["adamw_step"]
    result = registry.probe(spec, "cpu")
    assert result.ok and "matches torch's default AdamW step" in result.reason
    real = adamw._to_fused

    def wrong(optimizer, args, kwargs):  # a fused step with a slightly different learning rate
        real(optimizer, args, kwargs)
        for group in optimizer.param_groups:
            group["lr"] *= 1.001

    monkeypatch.setattr(adamw, "_to_fused", wrong)
    result = registry.probe(spec, "cpu")
    assert not result.ok and "differs from torch's default step" in result.reason


def test_the_probe_rejects_a_step_that_is_not_fused(monkeypatch):
    from flux_kernels.runtime import registry

    monkeypatch.setattr(adamw, "_to_fused", lambda optimizer, args, kwargs: None)
    result = registry.probe(registry.REGISTRY["adamw_step"], "cpu")
    assert not result.ok and "did not run" in result.reason


def test_runner_installs_it_under_auto_with_adamw_and_skips_it_with_prodigy(caplog):
    import prodigyopt

    from flux_kernels.runtime.errors import KernelError
    from flux_trainer.sdscripts.hooks import install_optimizer_kernels

    opt = torch.optim.AdamW(make_params())
    assert install_optimizer_kernels(opt, {"set": "auto"}) == ["adamw_step"]
    assert getattr(opt, adamw.ATTR) is not None
    assert install_optimizer_kernels(torch.optim.AdamW(make_params()), {"set": "auto,-adamw_step"}) == []
    with caplog.at_level(logging.INFO, logger="flux_trainer.runner"):
        prodigy = prodigyopt.Prodigy(make_params(), lr=1.0)
        assert install_optimizer_kernels(prodigy, {"set": "auto"}) == ["prodigy_step"]
    assert "kernel adamw_step skipped: the optimizer is" in caplog.text
    with pytest.raises(KernelError, match="not torch.optim.AdamW; remove adamw_step from kernels="):
        install_optimizer_kernels(prodigyopt.Prodigy(make_params(), lr=1.0), {"set": "adamw_step"})
