"""flux_kernels.ops.prodigy against prodigyopt itself: the same parameters, state and step sizes over several steps on
fresh random tensors (one all-zero, like LoRA's up weights), in the settings flux-train uses and their variants;
one host read per step instead of two per tensor; install / uninstall and the fallbacks."""

from __future__ import annotations

import copy
import logging

import pytest
import torch

from flux_kernels.ops import prodigy

prodigyopt = pytest.importorskip("prodigyopt", reason="prodigyopt is not installed (the reference)")

SHAPES = [(16, 96), (96, 16), (7, 5), (33,)]
OURS = dict(decouple=True, weight_decay=0.01, use_bias_correction=True, safeguard_warmup=True, d_coef=1.0)


def make_params(seed: int = 0, dtype=torch.float32) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter((torch.randn(*s, generator=gen) * 0.1).to(dtype)) for s in SHAPES]
    params.append(torch.nn.Parameter(torch.zeros(96, 16, dtype=dtype)))  # zero-initialised, as LoRA's up weights
    return params


def run(optimizer, params, steps: int, seed: int = 1) -> None:
    """Gradients of a quadratic pull towards fixed random targets, plus noise: Prodigy's step size grows on it."""
    gen = torch.Generator().manual_seed(seed)
    targets = [torch.randn(p.shape, generator=torch.Generator().manual_seed(99)).to(p.dtype) for p in params]
    for step in range(steps):
        for i, (p, t) in enumerate(zip(params, targets, strict=True)):
            noise = (torch.randn(p.shape, generator=gen) * 1e-2).to(p.dtype)
            p.grad = None if (i == 2 and step == 1) else (p.detach() - t) + noise  # one tensor skips a step
        optimizer.step()


def pair(groups_of, dtype=torch.float32, **kwargs):
    ref_params, fast_params = make_params(dtype=dtype), make_params(dtype=dtype)
    ref = prodigyopt.Prodigy(groups_of(ref_params), lr=1.0, **kwargs)
    fast = prodigyopt.Prodigy(groups_of(fast_params), lr=1.0, **kwargs)
    prodigy.install(fast)
    return (ref, ref_params), (fast, fast_params)


def assert_same(ref, ref_params, fast, fast_params, rel: float) -> None:
    """Parameters and state relative to each tensor's largest value; the step-size statistics relative."""
    for a, b in zip(ref_params, fast_params, strict=True):
        sa, sb = ref.state[a], fast.state[b]
        assert sa.keys() == sb.keys() and sa["step"] == sb["step"]
        pairs = [("param", a.detach(), b.detach())] + [(k, sa[k], sb[k]) for k in sorted(set(sa) - {"step"})]
        for key, want, got in pairs:  # s, p0, exp_avg (when beta1 > 0), exp_avg_sq
            scale = want.abs().max().clamp_min(1e-30)
            assert ((got - want).abs().max() / scale).item() <= rel, key
    for ga, gb in zip(ref.param_groups, fast.param_groups, strict=True):
        for key in ("d", "d_max", "d_hat", "d_numerator", "d_denom", "k"):
            assert gb[key] == pytest.approx(ga[key], rel=rel), key


@pytest.mark.parametrize(
    "kwargs",
    [
        OURS,  # configs/optimizer/prodigy.yaml
        dict(OURS, decouple=False),  # coupled weight decay: added to the gradient
        dict(OURS, use_bias_correction=False, safeguard_warmup=False),
        dict(OURS, betas=(0.0, 0.99)),  # no first moment
        dict(weight_decay=0.0, d_coef=0.5, growth_rate=1.02),
    ],
    ids=["flux-train", "coupled-decay", "no-bias-correction", "beta1-0", "other"],
)
@pytest.mark.parametrize("flat", [True, False], ids=["flat", "multi-tensor"])
def test_matches_prodigyopt_over_steps(kwargs, flat, monkeypatch):
    """In float64 the two agree to rounding (1e-13 seen over 20 steps): the same arithmetic. (In float32 the sums'
    different order is amplified through the adapting step size: next test.) Both paths: the flat buffers, and the
    multi-tensor ops (which also take the step where a tensor has no gradient, in `run`)."""
    monkeypatch.setattr(prodigy, "FLAT", flat)
    (ref, rp), (fast, fp) = pair(lambda ps: ps, dtype=torch.float64, **kwargs)
    for _ in range(5):
        run(ref, rp, 4, seed=_)
        run(fast, fp, 4, seed=_)
        assert_same(ref, rp, fast, fp, rel=1e-10)
    assert fast.param_groups[0]["d"] > fast.param_groups[0]["d0"]  # the step size did adapt: not a trivial match


def test_matches_prodigyopt_in_float32():
    (ref, rp), (fast, fp) = pair(lambda ps: ps, **OURS)
    run(ref, rp, 12)
    run(fast, fp, 12)
    assert_same(ref, rp, fast, fp, rel=1e-5)


def test_two_groups_one_frozen_at_lr_zero():
    def groups(ps):
        return [{"params": ps[:3]}, {"params": ps[3:], "lr": 0.0}]

    (ref, rp), (fast, fp) = pair(groups, **OURS)
    run(ref, rp, 4)
    run(fast, fp, 4)
    assert_same(ref, rp, fast, fp, rel=1e-5)


def every_grad(params, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = (p.detach() - 0.5) + torch.randn(p.shape, generator=gen, dtype=p.dtype) * 1e-2


def test_the_flat_state_is_prodigyopts_and_survives_a_save_and_load():
    """With every gradient present the state lives in flat buffers: each state tensor a view into one buffer, shaped
    as prodigyopt shapes it (a zero tensor's p0 still a scalar). Saved and loaded into prodigyopt's own optimizer or
    into a fast one (whose state is then no longer views: copied in again), both continue as the original does, and
    so does the original after loading it back over a step it took since."""
    import io

    (ref, rp), (fast, fp) = pair(lambda ps: ps, dtype=torch.float64, **OURS)
    for step in range(3):
        for opt, ps in ((ref, rp), (fast, fp)):
            every_grad(ps, step)
            opt.step()
    assert_same(ref, rp, fast, fp, rel=1e-10)
    storages = {fast.state[p]["exp_avg_sq"].untyped_storage().data_ptr() for p in fp}
    assert len(storages) == 1
    for a, b in zip(rp, fp, strict=True):
        assert {k: tuple(v.shape) for k, v in ref.state[a].items() if k != "step"} == {
            k: tuple(v.shape) for k, v in fast.state[b].items() if k != "step"
        }
    buf = io.BytesIO()
    torch.save(fast.state_dict(), buf)
    resumed = []
    for install in (False, True):
        params = [torch.nn.Parameter(p.detach().clone()) for p in fp]
        opt = prodigyopt.Prodigy(params, lr=1.0, **OURS)
        if install:
            prodigy.install(opt)
        buf.seek(0)
        opt.load_state_dict(torch.load(buf, weights_only=False))
        resumed.append((opt, params))
    snapshot = [p.detach().clone() for p in fp]
    every_grad(fp, 99)
    fast.step()  # a step the load below undoes: the flat buffers now hold state the loaded one replaces
    buf.seek(0)
    fast.load_state_dict(torch.load(buf, weights_only=False))
    with torch.no_grad():
        for p, saved in zip(fp, snapshot, strict=True):
            p.copy_(saved)
    for step in range(3, 6):
        for opt, ps in [(fast, fp), *resumed]:
            every_grad(ps, step)
            opt.step()
    for opt, ps in resumed:
        assert_same(fast, fp, opt, ps, rel=1e-10)
    loaded = resumed[1][0]
    assert len({loaded.state[p]["s"].untyped_storage().data_ptr() for p in resumed[1][1]}) == 1  # views again


def test_one_host_read_per_step_instead_of_two_per_tensor(monkeypatch):
    (ref, rp), (fast, fp) = pair(lambda ps: ps, **OURS)
    run(ref, rp, 1)
    run(fast, fp, 1)  # the first step initialises the state (one more read, for all tensors at once)
    reads = {"item": 0, "tolist": 0}
    for name in reads:
        original = getattr(torch.Tensor, name)

        def counted(self, *a, _name=name, _orig=original, **k):
            reads[_name] += 1
            return _orig(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, counted)
    run(fast, fp, 1)
    assert reads == {"item": 0, "tolist": 1}
    reads.update(item=0, tolist=0)
    run(ref, rp, 1)
    assert reads["item"] == 2 * len(rp)  # prodigyopt: a dot product and a sum read back for every tensor


def test_the_numerator_over_several_chunks_still_matches(monkeypatch):
    """The numerator's tensors flattened into chunks of at most CHUNK elements: here 200, so the five tensors (96
    to 1536 elements) split into four chunks, one of them a tensor alone that is larger than a chunk."""
    monkeypatch.setattr(prodigy, "CHUNK", 200)
    assert prodigy._chunks(make_params(), 200) == [[0], [1], [2, 3], [4]]
    (ref, rp), (fast, fp) = pair(lambda ps: ps, dtype=torch.float64, **OURS)
    run(ref, rp, 6)
    run(fast, fp, 6)
    assert_same(ref, rp, fast, fp, rel=1e-10)


def ops_per_step(n_tensors: int) -> int:
    """Device operations (views excluded) one fast step runs over `n_tensors` parameters (after the first step,
    which creates the state)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not func.is_view:
                Count.n += 1
            return func(*args, **(kwargs or {}))

    gen = torch.Generator().manual_seed(3)
    params = [torch.nn.Parameter(torch.randn(4, 6, generator=gen)) for _ in range(n_tensors)]
    opt = prodigyopt.Prodigy(params, lr=1.0, **OURS)
    prodigy.install(opt)
    run(opt, params, 1)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)
    with Count():
        opt.step()
    return Count.n


def test_the_number_of_device_ops_does_not_grow_with_the_tensors():
    """A FLUX LoRA has 608 tensors: an op per tensor is a kernel launch per tensor (prodigyopt's dots, ~1.2k per
    step, were most of the first fast step's GPU time). Multi-tensor and flattened ops keep the count flat."""
    few, many = ops_per_step(6), ops_per_step(60)
    assert many == few, (few, many)
    assert few < 40


def test_install_keeps_the_class_state_and_hooks_and_uninstall_restores():
    params = make_params()
    opt = prodigyopt.Prodigy(params, lr=1.0, **OURS)
    assert "one device sync per step" in prodigy.install(opt)
    assert isinstance(opt, prodigyopt.Prodigy) and type(opt).__name__ == "FastProdigy"
    calls = []
    opt.register_step_post_hook(lambda *a: calls.append(1))
    run(opt, params, 2)
    assert calls == [1, 1]  # torch.optim's step hooks still run, once per step
    saved = copy.deepcopy(opt.state_dict())
    assert prodigy.uninstall(opt) and type(opt) is prodigyopt.Prodigy and not prodigy.uninstall(opt)
    plain = prodigyopt.Prodigy(make_params(), lr=1.0, **OURS)
    plain.load_state_dict(saved)  # a state saved with the fast step resumes with prodigyopt's own
    assert plain.param_groups[0]["k"] == 2


def test_other_optimizers_and_uncovered_settings():
    with pytest.raises(ValueError, match="not prodigyopt's Prodigy"):
        prodigy.install(torch.optim.AdamW(make_params()))
    (ref, rp), (fast, fp) = pair(lambda ps: ps, slice_p=2, **OURS)  # slice_p: prodigyopt's own step runs
    run(ref, rp, 3)
    run(fast, fp, 3)
    for a, b in zip(rp, fp, strict=True):
        assert torch.equal(a, b)


def test_registry_selects_it_for_the_optimizer_only_and_its_probe_compares_with_prodigyopt():
    from flux_kernels.runtime import registry

    assert registry.select("prodigy_step,lora_grad_norms", "cpu").installed == ("lora_grad_norms",)
    chosen = registry.select("prodigy_step,lora_grad_norms", "cpu", target="optimizer")
    assert chosen.installed == ("prodigy_step",)
    assert registry.select("auto", "cpu", target="optimizer").installed == ("prodigy_step", "adamw_step")
    assert registry.select("off", "cpu", target="optimizer").installed == ()
    ok, why = prodigy.self_check(torch.device("cpu"))
    assert ok and "matches prodigyopt" in why


def test_the_probe_rejects_a_wrong_step(monkeypatch):
    from flux_kernels.runtime import registry

    real = prodigy.fast_step

    def off_by_a_bit(self, closure=None):
        real(self, closure)
        for group in self.param_groups:
            for p in group["params"]:
                p.data.mul_(1.001)

    monkeypatch.setattr(prodigy, "fast_step", off_by_a_bit)
    result = registry.probe(registry.REGISTRY["prodigy_step"], "cpu")
    assert not result.ok and "differs from prodigyopt" in result.reason


def test_runner_hook_installs_it_and_refuses_another_optimizer_only_when_named(caplog):
    from flux_kernels.runtime.errors import KernelError
    from flux_trainer.sdscripts.hooks import install_optimizer_kernels

    opt = prodigyopt.Prodigy(make_params(), lr=1.0, **OURS)
    assert install_optimizer_kernels(opt, {"set": "attention,prodigy_step"}) == ["prodigy_step"]
    assert type(opt).__name__ == "FastProdigy"
    auto = prodigyopt.Prodigy(make_params(), lr=1.0)
    assert install_optimizer_kernels(auto, {"set": "auto"}) == ["prodigy_step"]  # the default optimizer, by default
    assert type(auto).__name__ == "FastProdigy"
    with caplog.at_level(logging.INFO, logger="flux_trainer.runner"):  # auto with another optimizer: a log line
        assert install_optimizer_kernels(torch.optim.AdamW(make_params()), {"set": "auto"}) == ["adamw_step"]
    assert (
        "kernel prodigy_step skipped: the optimizer is torch.optim.adamw.AdamW, not prodigyopt's Prodigy" in caplog.text
    )
    with pytest.raises(KernelError, match="not prodigyopt's Prodigy; remove prodigy_step from kernels="):
        install_optimizer_kernels(torch.optim.AdamW(make_params()), {"set": "prodigy_step"})
    assert install_optimizer_kernels(torch.optim.AdamW(make_params()), {"set": "off"}) == []


def test_the_run_log_lists_the_optimizer_kernel_with_the_model_kernels(tmp_path, monkeypatch, caplog):
    from types import SimpleNamespace

    from flux_trainer.sdscripts import hooks

    monkeypatch.setattr(hooks, "install_kernels", lambda unet, kernels, device: ["lora_grad_norms"])
    h = hooks.RunHooks(SimpleNamespace(kernels={"set": "auto"}, metrics={"enabled": False}), tmp_path)
    opt = prodigyopt.Prodigy(make_params(), lr=1.0)
    with caplog.at_level(logging.INFO, logger="flux_trainer.runner"):
        h.optimizer_created(opt)  # sd-scripts builds the optimizer before the model kernels go in
        h.before_prepare(None, SimpleNamespace(max_train_steps=3), SimpleNamespace(device="cpu"))
    assert h.kernels_installed == ["lora_grad_norms", "prodigy_step"]
    assert "kernels installed: lora_grad_norms, prodigy_step" in caplog.text
