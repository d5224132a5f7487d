"""Attention backends and kernels in the doctor, on the CPU with simulated backends: one that imports but raises and
one that returns wrong numbers are FAIL rows (never a silent skip); missing ones skip; a changed flux_kernels API
degrades to a warning row instead of crashing the doctor."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from flux_kernels.patches.attention import probe as fk_probe
from flux_kernels.patches.attention.backends import AttentionBackend
from flux_kernels.runtime import registry as fk_registry
from flux_kernels.runtime.registry import KernelSpec
from flux_trainer.doctor import attention as doctor_attention
from flux_trainer.launch.device import DeviceInfo

SHAPE = (1, 2, 33, 16)


def sdpa(q, k, v, mask):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def broken(q, k, v, mask):
    raise RuntimeError("CUDA error: no kernel image is available for execution on the device")


def wrong(q, k, v, mask):
    return sdpa(q, k, v, mask) * 1.5  # plausible shape and dtype, wrong numbers


def no_kernel(q, k, v, mask):
    raise RuntimeError("No available kernel. Aborting execution.")


def backends(**runs):
    return {name: AttentionBackend(name, run, cuda_only=False) for name, run in runs.items()}


def check(**runs):
    rows = doctor_attention.attention_checks("cpu", shape=SHAPE, dtype=torch.float32, backends=backends(**runs))
    return {r.check.removeprefix("attention: "): r for r in rows}


def test_a_backend_that_imports_but_raises_is_a_fail():
    rows = check(sdpa=sdpa, mybackend=broken)
    assert rows["sdpa"].status == "pass", rows["sdpa"].evidence
    assert rows["mybackend"].status == "fail"
    assert "no kernel image" in rows["mybackend"].evidence and rows["mybackend"].fix


def test_a_backend_with_wrong_numbers_is_a_fail():
    rows = check(sdpa=sdpa, xformers=wrong)
    assert rows["xformers"].status == "fail"
    assert "wrong" in rows["xformers"].evidence
    assert "xformers" in rows["xformers"].fix


def test_an_sdpa_kernel_pytorch_does_not_have_for_this_card_is_a_warning():
    rows = check(sdpa=sdpa, sdpa_flash=no_kernel)
    assert rows["sdpa_flash"].status == "warn"


def test_but_the_default_sdpa_failing_is_a_fail():
    rows = check(sdpa=no_kernel)
    assert rows["sdpa"].status == "fail"


def test_missing_and_cuda_only_backends_are_skipped_with_the_reason():
    candidates = {
        "sdpa": AttentionBackend("sdpa", sdpa, cuda_only=False),
        "xformers": AttentionBackend("xformers", sdpa, requires="no_such_module_for_the_doctor_test", cuda_only=False),
        "sdpa_cudnn": AttentionBackend("sdpa_cudnn", sdpa, cuda_only=True),
        "sage": AttentionBackend("sage", sdpa, trainable=False, note="no backward pass"),
    }
    rows = doctor_attention.attention_checks("cpu", shape=SHAPE, dtype=torch.float32, backends=candidates)
    by = {r.check: r for r in rows}
    assert by["attention: xformers"].status == "skip" and "not installed" in by["attention: xformers"].evidence
    assert by["attention: sdpa_cudnn"].status == "skip" and "CUDA" in by["attention: sdpa_cudnn"].evidence
    assert by["attention: sage"].status == "skip" and "backward" in by["attention: sage"].evidence
    assert by["attention: sdpa"].status == "pass"


def test_the_real_backends_table_on_cpu_checks_sdpa_and_leaves_out_the_reference():
    rows = doctor_attention.attention_checks("cpu", shape=SHAPE, dtype=torch.float32)
    names = {r.check for r in rows}
    assert "attention: sdpa" in names and "attention: sdpa_math" not in names
    assert {r.check: r.status for r in rows}["attention: sdpa"] == "pass"


def test_a_changed_probe_api_is_a_warning_not_a_crash(monkeypatch):
    def changed(*args, **kwargs):
        raise TypeError("probe_attention() got an unexpected keyword argument 'backends'")

    monkeypatch.setattr(fk_probe, "probe_attention", changed)
    rows = check(sdpa=sdpa)
    assert [r.status for r in rows.values()] == ["warn"]
    assert "could not run" in next(iter(rows.values())).evidence


def test_an_unimportable_flux_kernels_is_a_warning(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "flux_kernels.patches.attention.probe", None)  # import now raises ImportError
    rows = doctor_attention.attention_checks("cpu", shape=SHAPE, dtype=torch.float32)
    assert len(rows) == 1 and rows[0].status == "warn" and "unusable" in rows[0].evidence


# ---- our kernels ---------------------------------------------------------------------------------------------


def example(device, dtype):
    return (torch.linspace(-2, 2, 7, dtype=dtype, device=device).requires_grad_(),)


def crash(x):
    raise RuntimeError("triton compilation failed")


def spec(name, fast, applies=(True, "here")):
    return KernelSpec(
        name, "test", lambda d: applies, lambda m: "", reference=torch.sin, fast=fast, example=example,
        dtypes=(torch.float32,),
    )  # fmt: skip


def test_kernel_rows_pass_fail_and_skip_by_their_probe():
    registry = {
        "good": spec("good", torch.sin),
        "wrong": spec("wrong", torch.cos),
        "crashes": spec("crashes", crash),
        "elsewhere": spec("elsewhere", torch.sin, applies=(False, "needs a CUDA GPU (device is cpu)")),
        "attention": spec("attention", torch.sin),  # covered by the attention rows, not repeated
    }
    rows = {r.check: r for r in doctor_attention.kernel_checks("cpu", registry=registry)}
    assert set(rows) == {"kernel: good", "kernel: wrong", "kernel: crashes", "kernel: elsewhere"}
    assert rows["kernel: good"].status == "pass"
    assert rows["kernel: wrong"].status == "fail" and "reference" in rows["kernel: wrong"].evidence
    assert rows["kernel: crashes"].status == "fail" and "triton compilation failed" in rows["kernel: crashes"].evidence
    assert rows["kernel: elsewhere"].status == "skip" and "CUDA" in rows["kernel: elsewhere"].evidence


def test_the_real_registry_on_cpu_skips_every_gpu_kernel_with_a_reason(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    rows = {r.check: r for r in doctor_attention.kernel_checks("cpu")}
    assert set(rows) == {f"kernel: {n}" for n in fk_registry.REGISTRY if n != "attention"}
    for name in ("chroma_blocks", "lora_grad_norms", "flux_prologue"):  # plain PyTorch: runs, and is probed, anywhere
        ok = rows.pop(f"kernel: {name}")
        assert ok.status == "pass" and "matches the reference" in ok.evidence
    ok = rows.pop("kernel: prodigy_step")  # so is the optimizer step, against prodigyopt
    assert ok.status == "pass" and "matches prodigyopt" in ok.evidence
    ok = rows.pop("kernel: adamw_step")  # and AdamW's, against torch's own (fused AdamW runs on the CPU too)
    assert ok.status == "pass" and "matches torch's default AdamW step" in ok.evidence
    ok = rows.pop("kernel: single_process_reduce")
    assert ok.status == "pass" and "bit for bit" in ok.evidence
    assert all(r.status == "skip" and r.evidence for r in rows.values())


def test_without_a_gpu_attention_and_kernels_are_one_skip_each():
    rows = doctor_attention.attention_and_kernel_checks(DeviceInfo.cpu())
    assert [(r.check, r.status) for r in rows] == [("attention", "skip"), ("kernels", "skip")]


def test_the_doctor_gives_flux_kernels_reasons_a_missing_package_marked_optional(monkeypatch):
    from flux_kernels.patches.attention import probe as attention_probe
    from flux_kernels.patches.attention.backends import BACKENDS

    cuda = torch.device("cuda")
    monkeypatch.setattr(attention_probe, "importable", lambda module: False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda dev=None: (9, 0))
    assert doctor_attention._optional(attention_probe.unavailable(BACKENDS["cudnn_fa4"], cuda)) == (
        "flash_attn.cute is not installed (optional; pip install flash-attn-4==4.0.0b36)"
    )
    assert doctor_attention._optional(attention_probe.unavailable(BACKENDS["xformers"], cuda)) == (
        "xformers is not installed (optional)"
    )
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda dev=None: (8, 6))  # the card cannot run it
    why = doctor_attention._optional(attention_probe.unavailable(BACKENDS["cudnn_fa4"], cuda))
    assert why == "needs sm90 or newer (the GPU is sm86)"
    monkeypatch.setattr(attention_probe, "importable", lambda module: True)  # as if flash-attn-4 were installed
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda dev=None: (8, 6))
    why = doctor_attention._optional(attention_probe.unavailable(BACKENDS["cudnn_fa4"], cuda))
    assert why == "needs sm90 or newer (the GPU is sm86)"
    assert doctor_attention._optional(attention_probe.unavailable(BACKENDS["sdpa_cudnn"], cuda)) == ""


@pytest.mark.parametrize("name", ["xformers", "flash_attn", "cudnn_fa4", "sdpa_flash", "other"])
def test_every_failing_backend_gets_a_fix(name):
    assert doctor_attention._fix_for(name)


class _LayoutBound(torch.autograd.Function):
    """Attention whose backward is wrong unless the incoming gradient is contiguous, the way torch 2.11 + cuDNN
    9.19 behave once a shape's first backward had a contiguous one."""

    @staticmethod
    def forward(ctx, q, k, v):
        ctx.save_for_backward(q, k, v)
        return sdpa(q, k, v, None)

    @staticmethod
    def backward(ctx, grad):
        with torch.enable_grad():
            q, k, v = (t.detach().requires_grad_() for t in ctx.saved_tensors)
            grads = torch.autograd.grad(sdpa(q, k, v, None), (q, k, v), grad)
        return grads if grad.is_contiguous() else tuple(g.flip(-2) for g in grads)


def layout_row(run):
    return doctor_attention.gradient_layout_check("cpu", name="mine", dtype=torch.float32, backends=backends(mine=run))


def test_a_backend_wrong_with_another_gradient_layout_is_a_warning_that_says_flux_train_is_safe():
    row = layout_row(lambda q, k, v, mask: _LayoutBound.apply(q, k, v))
    assert row.status == "warn" and row.data["max_rel_err"] > 0.5, row.evidence
    assert "flux-train's blocks always hand the attention one layout" in row.evidence
    assert "enable_cudnn_sdp(False)" in row.fix


def test_a_backend_right_with_either_gradient_layout_passes():
    row = layout_row(sdpa)
    assert row.status == "pass" and row.data["max_rel_err"] < 1e-5, row.evidence
    assert fk_probe.gradient_layout_error("sdpa_math", "cpu", dtype=torch.float32) < 1e-5


def test_the_layout_check_skips_a_missing_kernel_and_warns_when_it_cannot_run():
    assert layout_row(no_kernel).status == "skip"
    row = layout_row(broken)
    assert row.status == "warn" and "could not run" in row.evidence
