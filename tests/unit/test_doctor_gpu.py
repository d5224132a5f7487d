"""Doctor GPU rows from made-up cards: the arch check for sm_120 with and without a cu128 build, sm_90 / sm_89 /
sm_80, no GPU, a CPU-only torch on a machine with a driver, old drivers; the speed arithmetic and the FLUX block."""

from __future__ import annotations

import pytest
import torch

from flux_trainer.doctor import fast_checks
from flux_trainer.doctor import gpu as doctor_gpu
from flux_trainer.doctor import speed as doctor_speed
from flux_trainer.launch.device import DeviceInfo, family_for

CU126 = ("sm_50", "sm_60", "sm_70", "sm_75", "sm_80", "sm_86", "sm_90")
CU128 = ("sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120", "compute_120")


def card(name, cap, arch_list=CU128, cuda="12.8", driver="575.57.08", vram=31.4) -> DeviceInfo:
    return DeviceInfo(
        name=name,
        index=0,
        capability=cap,
        family=family_for(cap, name),
        vram_gib=vram,
        count=1,
        bf16=cap >= (8, 0),
        fp8=cap >= (8, 9),
        torch_version=f"2.7.0+cu{cuda.replace('.', '')}",
        torch_cuda=cuda,
        arch_list=arch_list,
        driver=driver,
    )


RTX5090 = "NVIDIA GeForce RTX 5090"


def rows_by_check(rows):
    return {r.check: r for r in rows}


def test_sm120_on_a_torch_without_sm120_fails_and_the_fix_names_cu128():
    row = doctor_gpu.torch_build_check(card(RTX5090, (12, 0), CU126, cuda="12.6"))
    assert row.status == "fail"
    assert "sm_120" in row.evidence
    assert "cu128" in row.fix and "CUDA 12.8" in row.fix


def test_sm120_with_a_cu128_build_passes():
    row = doctor_gpu.torch_build_check(card(RTX5090, (12, 0), CU128))
    assert row.status == "pass", row.evidence
    assert "sm_120" in row.evidence


def test_sm120_running_only_on_older_ptx_is_a_warning_with_the_install_command():
    row = doctor_gpu.torch_build_check(card(RTX5090, (12, 0), ("sm_80", "sm_90", "compute_90"), cuda="12.6"))
    assert row.status == "warn" and "PTX" in row.evidence
    assert "cu128" in row.fix


@pytest.mark.parametrize(
    ("name", "cap", "family", "fp8"),
    [
        ("NVIDIA H200", (9, 0), "hopper", True),
        ("NVIDIA GeForce RTX 4090", (8, 9), "ada", True),
        ("NVIDIA A100-SXM4-80GB", (8, 0), "ampere", False),
    ],
)
def test_datacenter_and_older_consumer_cards_pass_on_a_cu126_build(name, cap, family, fp8):
    info = card(name, cap, CU126, cuda="12.6", driver="560.35.03")
    rows = rows_by_check(doctor_gpu.identity_checks(info))
    assert rows["gpu"].status == "pass" and family in rows["gpu"].evidence
    assert rows["torch build"].status == "pass", rows["torch build"].evidence
    assert rows["driver"].status == "pass", rows["driver"].evidence
    assert doctor_gpu.fp8_applies(info)[0] is fp8


def test_fp8_is_skipped_with_a_reason_on_ampere():
    info = card("NVIDIA A100-SXM4-80GB", (8, 0))
    ok, why = doctor_gpu.fp8_applies(info)
    assert not ok and "sm_80" in why
    assert doctor_gpu.fp8_check(info).status == "skip"


def test_no_gpu_warns_and_skips_the_card_rows():
    rows = rows_by_check(doctor_gpu.identity_checks(DeviceInfo.cpu(torch_version="2.7.0+cpu")))
    assert rows["gpu"].status == "warn" and "no CUDA GPU" in rows["gpu"].evidence
    assert rows["torch build"].status == "skip"
    assert rows["driver"].status == "skip"
    assert doctor_gpu.bf16_check(DeviceInfo.cpu()).status == "skip"
    assert doctor_gpu.fp8_check(DeviceInfo.cpu()).status == "skip"


def test_cpu_only_torch_on_a_machine_with_an_nvidia_driver_fails():
    row = doctor_gpu.gpu_identity(DeviceInfo.cpu(torch_version="2.7.0+cpu", driver="570.86.10"))
    assert row.status == "fail"
    assert "CPU-only" in row.evidence and "570.86.10" in row.evidence
    assert "cu128" in row.fix


def test_a_driver_too_old_for_blackwell_fails_naming_570():
    row = doctor_gpu.driver_check(card(RTX5090, (12, 0), CU128, driver="560.35.03"))
    assert row.status == "fail" and "570" in row.fix


def test_a_driver_too_old_for_cuda_13_fails():
    row = doctor_gpu.driver_check(card("NVIDIA H200", (9, 0), CU128, cuda="13.0", driver="570.86.10"))
    assert row.status == "fail" and "580" in row.fix


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the skip path of a machine without CUDA")
def test_device_kernels_are_skipped_when_this_process_has_no_cuda():
    row = doctor_gpu.bf16_check(card("NVIDIA H200", (9, 0)))
    assert row.status == "skip" and "CUDA is not available" in row.evidence


@pytest.mark.parametrize(
    ("info", "status"),
    [
        (card(RTX5090, (12, 0), CU126, cuda="12.6"), "fail"),
        (card(RTX5090, (12, 0), CU128), "pass"),
        (card("NVIDIA H200", (9, 0), CU126, cuda="12.6"), "pass"),
        (card("NVIDIA GeForce RTX 4090", (8, 9), CU126, cuda="12.6"), "pass"),
        (card("NVIDIA A100-SXM4-80GB", (8, 0), CU126, cuda="12.6"), "pass"),
        (DeviceInfo.cpu(torch_version="2.7.0+cpu"), "skip"),
    ],
    ids=["sm120-cu126", "sm120-cu128", "sm90", "sm89", "sm80", "no-gpu"],
)
def test_fast_checks_carry_the_arch_verdict(compose, info, status):
    rows = rows_by_check(fast_checks(compose("model=random_tiny"), info, env={}))
    assert rows["torch build"].status == status
    assert not {r.group for r in rows.values()} & {"attention", "kernels", "speed"}  # no GPU kernels run


# ---- speed arithmetic --------------------------------------------------------------------------------------------


def test_block_flops_match_the_closed_form():
    h, m, t = 3072, 4 * 3072, 4096 + 512
    linear = 2 * t * h * (3 * h + m) + 2 * t * (h + m) * h + 2 * h * 3 * h
    attention = 4 * t * t * h
    assert doctor_speed.block_step_flops(3072, 24, 4096, 512) == pytest.approx(2 * linear + 3.5 * attention)


def test_the_flux_block_runs_forward_and_backward_on_cpu():
    step, block, x = doctor_speed.block_step(64, 2, 11, torch.device("cpu"), torch.float32)
    out, dx = step()
    assert out.shape == x.shape == dx.shape == (1, 11, 64)
    assert torch.isfinite(out).all() and dx.abs().sum() > 0
    assert not torch.equal(out, x)  # the block changed its input


@pytest.mark.parametrize(("measured", "status"), [(100.0, "warn"), (200.0, "pass")])
def test_speed_verdict_warns_below_half_of_expected(measured, status):
    row = doctor_speed.verdict("bf16 matmul speed", measured, 300.0, "8192^3", {})
    assert row.status == status
    assert row.data["fraction_of_expected"] == pytest.approx(measured / 300.0, abs=1e-3)


def test_speed_without_a_reference_is_reported_without_a_verdict():
    row = doctor_speed.verdict("bf16 matmul speed", 123.0, None, "8192^3", {})
    assert row.status == "pass" and "no reference" in row.evidence


def test_speed_is_skipped_without_a_gpu():
    assert [r.status for r in doctor_speed.speed_checks(DeviceInfo.cpu())] == ["skip"]


# ---- the device code paths, run on the CPU (explicit device, fixed timer) ---------------------------------------


def fixed_ms(ms):
    def timer(fn, warmup, reps):
        fn()  # runs the real work once, so a broken code path raises here
        return ms

    return timer


def test_bf16_and_fp8_matmul_checks_pass_on_a_working_device():
    h200 = card("NVIDIA H200", (9, 0))
    bf16 = doctor_gpu.bf16_check(h200, device="cpu")
    assert bf16.status == "pass" and bf16.data["max_rel_err"] < 1e-2
    fp8 = doctor_gpu.fp8_check(h200, device="cpu")
    assert fp8.status == "pass", fp8.evidence


def test_a_bf16_matmul_that_raises_is_a_fail_naming_the_error(monkeypatch):
    class Broken(torch.Tensor):
        def __matmul__(self, other):
            raise RuntimeError("CUDA error: no kernel image is available for execution on the device")

    real_to = torch.Tensor.to
    monkeypatch.setattr(torch.Tensor, "to", lambda self, *a, **k: real_to(self, *a, **k).as_subclass(Broken))
    row = doctor_gpu.bf16_check(card(RTX5090, (12, 0), CU126, cuda="12.6"), device="cpu")
    assert row.status == "fail" and "no kernel image" in row.evidence and "cu128" in row.fix


def test_matmul_speed_against_the_peak_table():
    h200 = card("NVIDIA H200", (9, 0))
    n = 64
    fast = doctor_speed.matmul_speed(h200, n=n, device="cpu", timer=fixed_ms(2 * n**3 / 700e12 * 1e3))
    assert fast.status == "pass" and fast.data["tflops"] == pytest.approx(700, rel=1e-3)
    slow = doctor_speed.matmul_speed(h200, n=n, device="cpu", timer=fixed_ms(2 * n**3 / 300e12 * 1e3))
    assert slow.status == "warn" and "38%" in slow.evidence  # 300 of the H200's measured 790


def test_block_speed_runs_the_block_and_judges_it():
    h200 = card("NVIDIA H200", (9, 0))
    row = doctor_speed.block_speed(h200, hidden=64, heads=2, tokens=(24, 8), device="cpu", timer=fixed_ms(1.0))
    assert row.check == "flux block speed" and row.data["tokens"] == [24, 8]
    flops = doctor_speed.block_step_flops(64, 2, 24, 8)
    assert row.data["tflops"] == pytest.approx(flops / 1e-3 / 1e12, abs=0.05)
    assert row.status == "warn"  # a tiny block cannot reach half the H200's rate


def test_a_measurement_that_fails_is_a_warning_not_a_crash():
    def oom(fn, warmup, reps):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 128.00 MiB")

    row = doctor_speed.matmul_speed(card("NVIDIA H200", (9, 0)), n=8, device="cpu", timer=oom)
    assert row.status == "warn" and "out of memory" in row.evidence


class Limits:
    """An NvmlReader stand-in: the enforced and default power limits, or None where NVML does not say."""

    def __init__(self, limits):
        self.limits = limits

    def power_limits_w(self):
        return self.limits


def test_a_power_limit_below_the_cards_default_warns_with_the_command_that_restores_it():
    h200 = card("NVIDIA H200", (9, 0))
    row = doctor_gpu.power_limit_check(h200, Limits((400.0, 700.0)))
    assert row.status == "warn" and row.evidence.startswith("400 W, below the card's default 700 W")
    assert "nvidia-smi -i 0 -pl 700" in row.fix and row.data == {"limit_w": 400.0, "default_w": 700.0}
    assert doctor_gpu.power_limit_check(h200, Limits((700.0, 700.0))).status == "pass"
    assert doctor_gpu.power_limit_check(h200, Limits((670.0, 700.0))).status == "pass"  # within 5%
    assert doctor_gpu.power_limit_check(h200, Limits(None)).status == "skip"
    assert doctor_gpu.power_limit_check(DeviceInfo.cpu()).status == "skip"


def test_the_power_limits_through_nvml():
    from types import SimpleNamespace

    from flux_trainer.metrics.nvml import NvmlReader

    fake = SimpleNamespace(
        nvmlInit=lambda: None,
        nvmlDeviceGetHandleByUUID=lambda uuid: "h",
        nvmlDeviceGetHandleByIndex=lambda i: "h",
        nvmlDeviceGetEnforcedPowerLimit=lambda h: 575_000,
        nvmlDeviceGetPowerManagementDefaultLimit=lambda h: 600_000,
    )
    assert NvmlReader(0, nvml=fake).power_limits_w() == (575.0, 600.0)
    del fake.nvmlDeviceGetPowerManagementDefaultLimit  # a board that does not report it
    assert NvmlReader(0, nvml=fake).power_limits_w() is None
