"""Registry, probe and selection: a wrong fast kernel is rejected and auto falls back with one log line and the
reason; a kernel the user named that cannot run is an error naming why; where each kernel applies."""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import os
import subprocess
import sys

import pytest
import torch

from flux_kernels.ops import reference
from flux_kernels.runtime import applies, registry
from flux_kernels.runtime import device as devmod
from flux_kernels.runtime.device import DeviceInfo, as_device_info, family_of
from flux_kernels.runtime.errors import KernelError
from flux_kernels.runtime.registry import REGISTRY, KernelSpec, probe, select
from flux_kernels.runtime.request import parse_request

HOPPER = DeviceInfo("cuda", 0, "NVIDIA H200", (9, 0), "hopper", True, 139.8, 132)
TURING = DeviceInfo("cuda", 0, "Tesla T4", (7, 5), "turing_or_older", False, 15.0, 40)


def _always(device):
    return True, "test"


def _gated_example(device, dtype):
    gen = torch.Generator().manual_seed(0)
    x, y = ((torch.randn(2, 5, 16, generator=gen) + 0.5).to(dtype).requires_grad_() for _ in range(2))
    gate = (torch.randn(2, 1, 16, generator=gen) + 1.0).to(dtype).requires_grad_()
    return x, gate, y


def _spec(name, fast, applies=_always) -> KernelSpec:
    return KernelSpec(
        name, "test kernel", applies, lambda model, **o: name, reference.gated_residual, fast, _gated_example
    )


GOOD = _spec("good", lambda x, g, y: x + g * y)
OFF_BY_A_LITTLE = _spec("off_by_a_little", lambda x, g, y: (x + g * y) * 1.01)
WRONG_GRAD = _spec("wrong_grad", lambda x, g, y: x + g.detach() * y)  # right forward, no gate gradient
CRASHES = _spec("crashes", lambda x, g, y: torch.cat([x, g]))
NEEDS_GPU = _spec("needs_gpu", lambda x, g, y: x + g * y, applies=lambda d: (False, "needs a CUDA GPU"))
TEST_REGISTRY = {s.name: s for s in (GOOD, OFF_BY_A_LITTLE, WRONG_GRAD, CRASHES, NEEDS_GPU)}


def test_probe_accepts_a_correct_kernel_and_rejects_wrong_ones():
    assert probe(GOOD, "cpu").ok
    bad = probe(OFF_BY_A_LITTLE, "cpu")
    assert not bad.ok and "output 0" in bad.reason and bad.max_err == pytest.approx(0.01, rel=0.3)
    no_grad = probe(WRONG_GRAD, "cpu")
    assert not no_grad.ok and "gradient" in no_grad.reason
    crash = probe(CRASHES, "cpu")
    assert not crash.ok and crash.reason.startswith("probe crashed: RuntimeError")


def test_probe_tolerance_is_per_dtype():
    slightly_off = _spec("slightly_off", lambda x, g, y: (x + g * y) * (1 + 1e-3))  # fine for bf16, not fp32
    assert probe(dataclasses.replace(slightly_off, dtypes=(torch.bfloat16,)), "cpu").ok
    assert not probe(dataclasses.replace(slightly_off, dtypes=(torch.float32,)), "cpu").ok


def test_auto_installs_what_passes_and_skips_the_rest_with_one_log_line_each(caplog):
    with caplog.at_level(logging.INFO, logger="flux_kernels.runtime.registry"):
        sel = select("auto", "cpu", registry=TEST_REGISTRY)
    assert sel.installed == ("good",)
    assert [s.name for s in sel.specs] == ["good"]
    assert set(sel.skipped) == {"off_by_a_little", "wrong_grad", "crashes", "needs_gpu"}
    assert sel.skipped["needs_gpu"] == "needs a CUDA GPU"
    assert "probe failed vs reference" in sel.skipped["off_by_a_little"]
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 4 and all(line.startswith("kernel ") and " skipped: " in line for line in lines)
    assert "skipped: off_by_a_little (probe failed" in sel.summary()


def test_each_kernels_probe_time_is_kept_and_summed_slowest_first():
    """The wall time of each candidate's applies + probe (the start-up cost before training), for the run log."""
    import time

    def slow_check(seconds):
        def check(device):
            time.sleep(seconds)
            return True, "checked"

        return check

    slow = dataclasses.replace(GOOD, name="slow", check=slow_check(0.3))
    slower = dataclasses.replace(GOOD, name="slower", check=slow_check(0.6))
    sel = select("auto", "cpu", registry={**TEST_REGISTRY, "slow": slow, "slower": slower})
    assert set(sel.seconds) == set(TEST_REGISTRY) | {"slow", "slower"}  # skipped ones too: they were probed
    assert 0.3 <= sel.seconds["slow"] < 0.6 <= sel.seconds["slower"] and sel.seconds["needs_gpu"] < 0.05
    line = sel.probe_time()
    assert line.startswith(f"{sum(sel.seconds.values()):.1f} s (slower 0.") and ", slow 0.3 s" in line
    assert "needs_gpu" not in line  # under 0.05 s: not named
    assert registry.Selection(()).probe_time() == "0.0 s"


def test_explicit_request_that_cannot_run_raises_with_the_reason():
    assert select(["good"], "cpu", registry=TEST_REGISTRY).installed == ("good",)
    with pytest.raises(KernelError, match="'needs_gpu' cannot run on cpu: needs a CUDA GPU"):
        select(["good", "needs_gpu"], "cpu", registry=TEST_REGISTRY)
    with pytest.raises(KernelError, match="'off_by_a_little' cannot run .* probe failed vs reference"):
        select("off_by_a_little", "cpu", registry=TEST_REGISTRY)
    with pytest.raises(KernelError, match="unknown kernel 'nope'; choose from good, off_by_a_little"):
        select(["nope"], "cpu", registry=TEST_REGISTRY)


def test_auto_plus_and_minus_named_kernels():
    """auto,name adds a kernel to auto's set and insists on it; auto,-name takes one out of it."""
    extra = {**TEST_REGISTRY, "opt_in": dataclasses.replace(GOOD, name="opt_in", in_auto=False)}
    assert select("auto", "cpu", registry=extra).installed == ("good",)  # opt_in is not in auto
    sel = select("auto,opt_in", "cpu", registry=extra)
    assert sel.installed == ("good", "opt_in") and not sel.explicit
    assert sel.insists("opt_in") and not sel.insists("good")  # auto's own kernels still fall back
    assert "needs_gpu" in sel.skipped  # auto's skip, not an error
    assert select("auto, -good ,opt_in", "cpu", registry=extra).installed == ("opt_in",)
    with pytest.raises(KernelError, match="'needs_gpu' cannot run on cpu"):  # named beside auto: insisted on
        select("auto,needs_gpu", "cpu", registry=extra)
    with pytest.raises(KernelError, match="-good takes a kernel out of auto: write auto,-good"):
        select("opt_in,-good", "cpu", registry=extra)
    with pytest.raises(KernelError, match="unknown kernel 'nope'.*auto,-name takes one out"):
        select("auto,-nope", "cpu", registry=extra)
    with pytest.raises(KernelError, match="'good' is both added and taken out"):
        select("auto,good,-good", "cpu", registry=extra)
    explicit = select(["opt_in"], "cpu", registry=extra)
    assert explicit.explicit and explicit.insists("opt_in")


def test_the_launcher_checks_kernel_names_without_importing_the_kernels():
    """kernels.set is checked against request.KERNEL_NAMES, the registry's names without torch._dynamo and the
    kernels' modules (~1.5 s of every launch on a 2-core CPU); the registry refuses to load if the two differ."""
    from flux_kernels.runtime.request import KERNEL_NAMES

    assert KERNEL_NAMES == tuple(REGISTRY)
    code = (
        "import sys; from flux_trainer.config.validate import kernel_set_problem; "
        "assert kernel_set_problem('auto,-attention') is None and 'unknown' in kernel_set_problem('auto,nope'); "
        "print(sorted(m for m in sys.modules if m.startswith(('flux_kernels.', 'torch._dynamo'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "['flux_kernels.runtime', 'flux_kernels.runtime.request']"


def test_a_bad_kernel_set_is_a_config_error_before_anything_loads(compose):
    from flux_trainer.config import ConfigError
    from flux_trainer.config.validate import kernel_set_problem, validate

    assert kernel_set_problem("auto") is None and kernel_set_problem("auto,qk_norm_rope,-compile_blocks") is None
    assert "unknown kernel 'qk_norm'" in kernel_set_problem("auto,qk_norm")
    with pytest.raises(ConfigError, match="kernels.set=compile,attention: unknown kernel 'compile'"):
        validate(compose("+dataset=mychar", "kernels.set='compile,attention'"))
    from flux_trainer.config.paths import shipped_config_dir

    presets = sorted(p.stem for p in (shipped_config_dir() / "kernels").glob("*.yaml"))
    assert {"auto", "off", "fp8", "fused"} <= set(presets)
    for preset in presets:  # every shipped kernel set parses
        assert kernel_set_problem(compose("+dataset=mychar", f"kernels={preset}").kernels.set) is None, preset
    # the presets built on auto keep what auto adds (prodigy_step with Prodigy) and name what they add to it
    fp8 = parse_request(compose("+dataset=mychar", "kernels=fp8").kernels.set, REGISTRY)
    assert fp8.auto and fp8.named == ("fp8_matmul",)


def test_off_installs_nothing_and_real_registry_explicit_compile_on_cpu_raises():
    assert select("off", "cpu").installed == () and select("off", "cpu").skipped == {}
    assert select([], "cpu").installed == ()
    with pytest.raises(KernelError, match="compile_blocks.*only meaningful on a CUDA GPU"):
        select("compile_blocks", "cpu")
    with pytest.raises(KernelError, match="attention.*only meaningful on a CUDA GPU"):
        select("attention", "cpu")


def test_every_registry_entry_is_frozen_and_complete():
    assert list(REGISTRY) == ["chroma_blocks", "attention", "qk_norm_rope", "modulate", "gated_residual",
                              "gated_modulate", "single_qkv", "double_qkv", "fp8_matmul", "lora_fold", "flux_prologue",
                              "lora_grad_norms",
                              "prodigy_step", "adamw_step", "single_process_reduce", "coalesced_reduce",
                              "selective_checkpoint", "compile_blocks", "activation_offload",
                              "block_swap"]  # fmt: skip
    # these install into the optimizer, this one into our trainer
    assert {n: s.target for n, s in REGISTRY.items() if s.target != "model"} == {
        "prodigy_step": "optimizer", "adamw_step": "optimizer", "single_process_reduce": "trainer",
        "coalesced_reduce": "trainer"}  # fmt: skip
    # auto = our forward for Chroma's blocks (on Chroma) +
    # the attention choice + the single blocks' q/k/v with a written-out backward + fp8 matmuls (on an fp8
    # base only) + the LoRA folded into the wide layers' GEMM + the per-step embeddings without syncs + the LoRA norms
    # (where a LoRA is applied) + Prodigy's or AdamW's step (whichever the optimizer is) + no all-reduce on one
    # process, one per dtype on several + selective checkpointing (where blocks are checkpointed) + regional compile;
    # the Triton ops are opt-in until they beat compile_blocks, the double blocks' q/k/v until a whole step shows its
    # gain, activation_offload until it is measured at the tiers' caps; block_swap where sd-scripts swaps blocks
    assert [n for n, s in REGISTRY.items() if s.in_auto] == ["chroma_blocks", "attention", "single_qkv",
                                                              "fp8_matmul", "lora_fold",
                                                              "flux_prologue",
                                                              "lora_grad_norms", "prodigy_step", "adamw_step",
                                                              "single_process_reduce", "coalesced_reduce",
                                                              "selective_checkpoint", "compile_blocks",
                                                              "block_swap"]  # fmt: skip
    assert [n for n, s in REGISTRY.items() if s.auto_if is not None] == ["chroma_blocks", "fp8_matmul", "lora_fold",
                                                                         "lora_grad_norms",
                                                                         "selective_checkpoint",
                                                                         "block_swap"]  # fmt: skip
    for spec in REGISTRY.values():
        with pytest.raises(dataclasses.FrozenInstanceError):
            spec.name = "x"
        assert spec.check is not None or (spec.reference and spec.fast and spec.example), spec.name
    assert "no backward" in REGISTRY["attention"].description


def test_where_kernels_apply(monkeypatch):
    monkeypatch.setattr(applies, "triton_available", lambda: True)
    assert applies.triton_applies(HOPPER) == (True, "NVIDIA H200 (hopper)")
    ok, why = applies.triton_applies(TURING)
    assert not ok and "sm_80" in why
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert applies.triton_applies("cpu") == (False, "needs a CUDA GPU (device is cpu)")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert applies.triton_applies("cpu")[0]
    monkeypatch.setattr(applies, "triton_available", lambda: False)
    assert applies.triton_applies(HOPPER) == (False, "triton is not installed (pip install triton)")
    assert applies.compile_applies(HOPPER)[1].startswith("torch.compile's GPU backend needs triton")
    assert applies.cuda_applies({"type": "cuda", "name": "x", "capability": [8, 9]}) == (True, "x (ada)")


def test_device_info_without_cuda_calls():
    assert device_info_cpu() == DeviceInfo("cpu", None, "cpu", None, "cpu", True, None, None)
    assert as_device_info({"type": "cuda", "capability": (12, 0)}).family == "blackwell_consumer"
    fam = {(10, 0): "blackwell", (9, 0): "hopper", (8, 9): "ada", (8, 6): "ampere", (7, 5): "turing_or_older"}
    assert all(family_of(c) == f for c, f in fam.items())


def device_info_cpu():
    return devmod.device_info("cpu")


def test_flux_kernels_works_without_triton_and_never_imports_sd_scripts_or_flux_trainer():
    """A machine without triton imports every module, gets the references, and auto installs nothing."""
    code = """
import sys
sys.modules["triton"] = None  # as if not installed
import torch
from flux_kernels.ops import fast, reference
from flux_kernels.patches import patch
from flux_kernels.patches.attention import dispatch
from flux_kernels.runtime import registry
from flux_kernels.runtime.errors import KernelError
x, s = torch.randn(2, 5, 8), torch.randn(2, 1, 8)
assert torch.equal(fast.modulate(x, s, s), reference.modulate(x, s, s))
sel = registry.select("auto", "cpu")
# plain PyTorch: the ones auto takes on a CPU
assert sel.installed == ("chroma_blocks", "flux_prologue", "lora_grad_norms"), sel
assert set(sel.skipped) == {"attention", "single_qkv", "fp8_matmul", "lora_fold", "selective_checkpoint",
                            "compile_blocks", "block_swap"}, sel
for name in ("qk_norm_rope", "modulate", "gated_residual", "gated_modulate"):
    try:
        registry.select([name], "cpu")
        raise AssertionError(name + " selected without triton")
    except KernelError as e:
        assert "triton is not installed" in str(e), e
bad = [m for m in sys.modules if m.split(".")[0] in ("flux_trainer", "library", "triton") and sys.modules[m]]
assert not bad, bad
"""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_real_kernels_auto_on_cpu_via_interpreter(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: tests/gpu covers the real kernels there")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    sel = select("auto", "cpu")  # auto's kernels need CUDA but 3 plain-PyTorch ones; the Triton ones are not in auto
    assert sel.installed == ("chroma_blocks", "flux_prologue", "lora_grad_norms")
    assert set(sel.skipped) == {"attention", "single_qkv", "fp8_matmul", "lora_fold", "selective_checkpoint",
                                "compile_blocks", "block_swap"}  # fmt: skip
    triton_kernels = ["qk_norm_rope", "modulate", "gated_residual", "gated_modulate"]
    sel = select(triton_kernels, "cpu")  # named: each probed against its reference through the interpreter
    assert sel.installed == tuple(triton_kernels) and sel.explicit


def test_a_kernel_auto_would_skip_on_this_model_is_not_probed():
    """A static auto_if (Chroma's blocks, selective checkpointing with block swap) is asked before the probe when
    select gets the model: auto skips it with the reason and spends nothing probing it; named, it is probed as
    before (apply_kernels then says why it cannot go in), and without the model nothing changes."""
    probed = []

    def check(device):
        probed.append(device)
        return True, "checked"

    def no_chroma(model):
        return (False, "no Chroma blocks") if model == "flux" else (True, "Chroma blocks")

    gated = dataclasses.replace(GOOD, name="gated", check=check, auto_if=no_chroma, auto_if_static=True)
    reg = {"good": GOOD, "gated": gated}
    sel = select("auto", "cpu", registry=reg, model="flux")
    assert sel.installed == ("good",) and sel.skipped == {"gated": "no Chroma blocks"} and probed == []
    assert select("auto", "cpu", registry=reg, model="chroma").installed == ("good", "gated") and len(probed) == 1
    assert select("auto,gated", "cpu", registry=reg, model="flux").installed == ("good", "gated")  # named: probed
    assert select("auto", "cpu", registry=reg).installed == ("good", "gated") and len(probed) == 3  # no model
    dynamic = dataclasses.replace(gated, auto_if_static=False)  # reads what earlier kernels left: judged later
    assert select("auto", "cpu", registry={"gated": dynamic}, model="flux").installed == ("gated",)


def test_the_static_conditions_are_chroma_blocks_and_selective_checkpoint():
    assert {n for n, s in REGISTRY.items() if s.auto_if_static} == {"chroma_blocks", "selective_checkpoint"}
