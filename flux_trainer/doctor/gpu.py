"""Doctor checks of the GPU itself: what it is, whether the driver and the installed PyTorch build can drive it,
and whether bf16 and fp8 matmuls give the right numbers on it.

The first three (`gpu_identity`, `driver_check`, `torch_build_check`) read only the `DeviceInfo` that
`flux_trainer.launch.device.detect_device` made, so they run in microseconds and are testable with any made-up
card. `bf16_check` and `fp8_check` run tiny kernels on the real device (torch is imported only there), and
`power_limit_check` reads the real card's power limit through NVML.
"""

from __future__ import annotations

import re

from flux_trainer.doctor.core import FAIL, PASS, SKIP, WARN, CheckResult, one_line
from flux_trainer.launch import device as launch_device
from flux_trainer.launch.device import DeviceInfo, arch_supported

GROUP = "gpu"
# Oldest Linux driver per CUDA major version (minor-version compatibility: any 12.x runtime on a 525+ driver), and
# per family: Blackwell cards need the R570 branch, the first one that knows them.
_DRIVER_FOR_CUDA = {13: (580, 65), 12: (525, 60), 11: (450, 80)}
_DRIVER_FOR_FAMILY = {"blackwell_consumer": (570, 0), "blackwell": (570, 0)}


def _version_tuple(text: str | None) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", text or ""))


def _sm(info: DeviceInfo) -> str:
    return f"sm_{info.capability[0]}{info.capability[1]}" if info.capability else "sm_?"


def cuda_tag_for(info: DeviceInfo) -> str:
    """The PyTorch wheel index tag (cu128, ...) this card needs at least: cu128 for sm_120, cu126 for older cards."""
    table = getattr(launch_device, "_MIN_CUDA", {})  # capability -> first CUDA with code for it
    need = table.get(info.capability, "12.8") if info.capability else "12.8"
    tag = "cu" + need.replace(".", "")
    return tag if tag >= "cu126" else "cu126"  # the oldest index PyTorch 2.7+ still publishes


def install_command(tag: str) -> str:
    """The fix, without naming a package index host: PyTorch's 'Get started' selector gives the exact line."""
    cuda = f"{tag[2:-1]}.{tag[-1]}"
    return f"install the PyTorch build for CUDA {cuda} or newer ({tag}; pytorch.org 'Get started' selector)"


def gpu_identity(info: DeviceInfo) -> CheckResult:
    """Name, capability, family, VRAM, driver; without a GPU, why not (CPU-only torch on a machine with a driver
    is the classic one: training would silently run on the CPU)."""
    data = {
        "name": info.name,
        "capability": list(info.capability) if info.capability else None,
        "family": info.family,
        "vram_gib": info.vram_gib,
        "count": info.count,
        "driver": info.driver,
    }
    if info.is_gpu:
        count = f", {info.count} visible" if info.count > 1 else ""
        driver = f", driver {info.driver}" if info.driver else ", driver version unknown"
        bf16 = "bf16" if info.bf16 else "no bf16"
        fp8 = ", fp8" if info.fp8 else ""
        evidence = f"{info.name}, {_sm(info)} ({info.family}), {info.vram_gib:.1f} GiB, {bf16}{fp8}{driver}{count}"
        if info.family == "older":
            return CheckResult(
                "gpu",
                WARN,
                evidence + ": no bf16 tensor cores, FLUX trains in bf16 (fp16 overflows in its activations)",
                "use an Ampere (sm_80) or newer GPU",
                GROUP,
                data,
            )
        return CheckResult("gpu", PASS, evidence, "", GROUP, data)
    torch_text = f"torch {info.torch_version or '?'}"
    if info.torch_cuda is None and info.driver:
        tag = "cu128" if _version_tuple(info.driver) >= (570,) else "cu126"
        return CheckResult(
            "gpu",
            FAIL,
            f"NVIDIA driver {info.driver} is installed but {torch_text} is a CPU-only build: training would run on "
            "the CPU",
            install_command(tag),
            GROUP,
            data,
        )
    if info.torch_cuda and info.driver:
        return CheckResult(
            "gpu",
            FAIL,
            f"{torch_text} (CUDA {info.torch_cuda}) sees no GPU although NVIDIA driver {info.driver} is loaded",
            "check `nvidia-smi`, CUDA_VISIBLE_DEVICES and that the driver supports CUDA "
            f"{info.torch_cuda} (see the driver row)",
            GROUP,
            data,
        )
    build = f"CUDA {info.torch_cuda}" if info.torch_cuda else "CPU-only build"
    return CheckResult(
        "gpu",
        WARN,
        f"no CUDA GPU ({torch_text}, {build}, no NVIDIA driver found): only the tiny random model trains on a CPU",
        "train FLUX on an NVIDIA GPU (Ampere or newer) with a CUDA build of PyTorch",
        GROUP,
        data,
    )


def driver_check(info: DeviceInfo) -> CheckResult:
    """The kernel driver is new enough for the CUDA that torch was built with, and for this card's family."""
    if not info.driver:
        why = "no NVIDIA driver found" if not info.is_gpu else "driver version not readable (/proc/driver/nvidia)"
        return CheckResult("driver", SKIP, why, "", GROUP)
    have = _version_tuple(info.driver)
    needs = []
    cuda = _version_tuple(info.torch_cuda)
    if cuda and cuda[0] in _DRIVER_FOR_CUDA:
        needs.append((_DRIVER_FOR_CUDA[cuda[0]], f"CUDA {info.torch_cuda} (torch's build)"))
    if info.is_gpu and info.family in _DRIVER_FOR_FAMILY:
        needs.append((_DRIVER_FOR_FAMILY[info.family], f"{_sm(info)} ({info.family})"))
    missing = [(v, why) for v, why in needs if have < v]
    data = {"driver": info.driver, "needs": [".".join(map(str, v)) for v, _ in needs]}
    if missing:
        version = max(v for v, _ in missing)
        whys = " and ".join(why for _, why in missing)
        return CheckResult(
            "driver",
            FAIL,
            f"driver {info.driver} is older than {whys} needs ({'.'.join(map(str, version))} or newer)",
            f"update the NVIDIA driver to {version[0]} or newer",
            GROUP,
            data,
        )
    said = ", ".join(f"{why} needs {v[0]}+" for v, why in needs) or "no minimum known"
    return CheckResult("driver", PASS, f"driver {info.driver} ({said})", "", GROUP, data)


def _arch_summary(arch_list: tuple[str, ...]) -> str:
    if len(arch_list) <= 4:
        return " ".join(arch_list)
    return f"{arch_list[0]} ... {arch_list[-1]} ({len(arch_list)})"


def torch_build_check(info: DeviceInfo) -> CheckResult:
    """The installed torch ships kernels for this card (arch list), else the exact install command."""
    build = f"torch {info.torch_version or '?'} (CUDA {info.torch_cuda or 'none'})"
    data = {"torch": info.torch_version, "cuda": info.torch_cuda, "arch_list": list(info.arch_list)}
    if not info.is_gpu:
        return CheckResult("torch build", SKIP, f"{build}: no CUDA GPU to match", "", GROUP, data)
    ok, message = arch_supported(info)
    archs = f"; architectures {_arch_summary(info.arch_list)}" if info.arch_list else ""
    tag = cuda_tag_for(info)
    if not ok:
        return CheckResult("torch build", FAIL, message, install_command(tag), GROUP, data)
    if "PTX" in message:
        return CheckResult(
            "torch build",
            WARN,
            f"{message}: the first start JIT-compiles for minutes and prebuilt-only kernels (FlashAttention) are "
            f"missing{archs}",
            install_command(tag),
            GROUP,
            data,
        )
    return CheckResult("torch build", PASS, f"{build}: {message}{archs}", "", GROUP, data)


# ---- tiny kernels on the device ---------------------------------------------------------------------------------


def _cuda_ready(info: DeviceInfo, check: str, device=None) -> CheckResult | None:
    """A skip row when there is nothing to run on, else None (an explicit `device`, tests' CPU, always runs)."""
    if device is not None:
        return None
    if not info.is_gpu:
        return CheckResult(check, SKIP, "no CUDA GPU", "", GROUP)
    import torch

    if not torch.cuda.is_available():
        return CheckResult(check, SKIP, "CUDA is not available in this process", "", GROUP)
    return None


def _rel_err(got, want) -> float:
    err = ((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-12)).item()
    return float("nan") if err != err else err


def bf16_check(info: DeviceInfo, tolerance: float = 1e-2, device=None) -> CheckResult:
    """A 64x256 @ 256x96 bf16 matmul on the GPU against fp32 on the CPU of the same bf16-rounded inputs. A build
    without this card's kernels fails here with 'no kernel image is available', the error users meet after a
    30-minute model load."""
    if (skip := _cuda_ready(info, "bf16 matmul", device)) is not None:
        return skip
    import torch

    dev = torch.device("cuda", info.index) if device is None else torch.device(device)
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(64, 256, generator=gen).bfloat16()
    b = torch.randn(256, 96, generator=gen).bfloat16()
    want = a.float() @ b.float()
    try:
        got = (a.to(dev) @ b.to(dev)).float().cpu()
    except Exception as e:  # noqa: BLE001 - any error here is the verdict
        return CheckResult(
            "bf16 matmul",
            FAIL,
            f"bf16 matmul on {info.name} raised {one_line(e)}",
            install_command(cuda_tag_for(info)),
            GROUP,
        )
    err = _rel_err(got, want)
    data = {"max_rel_err": err, "tolerance": tolerance}
    if not err <= tolerance:
        return CheckResult(
            "bf16 matmul",
            FAIL,
            f"bf16 matmul differs from fp32: max rel. error {err:.2e} > {tolerance:.0e}",
            "reinstall PyTorch for this card's CUDA; check the GPU (nvidia-smi -q for ECC / Xid errors)",
            GROUP,
            data,
        )
    if not info.bf16:
        return CheckResult(
            "bf16 matmul",
            WARN,
            f"bf16 runs but {_sm(info)} has no bf16 tensor cores (emulated, slow); max rel. error {err:.1e}",
            "use an Ampere (sm_80) or newer GPU",
            GROUP,
            data,
        )
    return CheckResult("bf16 matmul", PASS, f"64x256x96 bf16 vs fp32: max rel. error {err:.1e}", "", GROUP, data)


def fp8_applies(info: DeviceInfo) -> tuple[bool, str]:
    """fp8 tensor-core matmuls exist on sm_89 and newer (Ada, Hopper, Blackwell)."""
    if not info.is_gpu:
        return False, "no CUDA GPU"
    if not info.fp8:
        return False, f"{_sm(info)} ({info.family}) has no fp8 tensor cores (sm_89 and newer); fp8 not used here"
    return True, ""


def fp8_check(info: DeviceInfo, tolerance: float = 1e-2, device=None) -> CheckResult:
    """torch._scaled_mm (e4m3 x e4m3 -> bf16, unit scales) against fp32 on the CPU of the same fp8 values."""
    ok, why = fp8_applies(info)
    if not ok:
        return CheckResult("fp8 matmul", SKIP, why, "", GROUP)
    if (skip := _cuda_ready(info, "fp8 matmul", device)) is not None:
        return skip
    import torch

    if not hasattr(torch, "_scaled_mm") or not hasattr(torch, "float8_e4m3fn"):
        return CheckResult(
            "fp8 matmul",
            FAIL,
            f"torch {torch.__version__} has no fp8 matmul (torch._scaled_mm)",
            install_command(cuda_tag_for(info)),
            GROUP,
        )
    dev = torch.device("cuda", info.index) if device is None else torch.device(device)
    gen = torch.Generator().manual_seed(0)
    a = (torch.randn(64, 128, generator=gen) * 0.5).to(torch.float8_e4m3fn)
    b = (torch.randn(96, 128, generator=gen) * 0.5).to(torch.float8_e4m3fn)  # mat2 must be column-major: b.t()
    want = a.float() @ b.float().t()
    try:
        one = torch.ones((), device=dev, dtype=torch.float32)
        out = torch._scaled_mm(a.to(dev), b.to(dev).t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
        got = (out[0] if isinstance(out, tuple) else out).float().cpu()  # torch < 2.4 returned (out, amax)
    except Exception as e:  # noqa: BLE001
        return CheckResult(
            "fp8 matmul",
            FAIL,
            f"torch._scaled_mm on {info.name} raised {one_line(e)}",
            f"{install_command(cuda_tag_for(info))} (fp8 matmuls need torch 2.7+ built for this card)",
            GROUP,
        )
    err = _rel_err(got, want)
    data = {"max_rel_err": err, "tolerance": tolerance}
    if not err <= tolerance:
        return CheckResult(
            "fp8 matmul",
            FAIL,
            f"fp8 e4m3 matmul differs from fp32: max rel. error {err:.2e} > {tolerance:.0e}",
            "reinstall PyTorch for this card's CUDA; until then keep precision=bf16",
            GROUP,
            data,
        )
    return CheckResult("fp8 matmul", PASS, f"64x128x96 e4m3 -> bf16: max rel. error {err:.1e}", "", GROUP, data)


def power_limit_check(info: DeviceInfo, nvml=None) -> CheckResult:
    """A card whose power limit is set below its default trains slower: FLUX LoRA steps run at the limit (the lent
    H200 drew 685-702 W of its 700 W default, its SM clock at 1605-1785 of 1980 MHz). `nvml`: an NvmlReader (tests)."""
    check = "power limit"
    if not info.is_gpu:
        return CheckResult(check, SKIP, "no CUDA GPU", "", GROUP)
    if nvml is None:
        from flux_trainer.metrics.nvml import NvmlReader

        nvml = NvmlReader(info.index)
    limits = nvml.power_limits_w()
    if limits is None:
        return CheckResult(check, SKIP, "NVML does not say (no nvidia-ml-py, or the board keeps it)", "", GROUP)
    limit, default = limits
    data = {"limit_w": limit, "default_w": default}
    if limit < 0.95 * default:
        return CheckResult(
            check,
            WARN,
            f"{limit:.0f} W, below the card's default {default:.0f} W: training steps run at the limit, so slower",
            f"restore the default (sudo nvidia-smi -i {info.index} -pl {default:.0f}) or expect slower steps",
            GROUP,
            data,
        )
    return CheckResult(check, PASS, f"{limit:.0f} W (the card's default {default:.0f} W)", "", GROUP, data)


def kernels_for_card(info: DeviceInfo, only: tuple[str, ...] | None = None) -> CheckResult:
    """Which of flux_kernels' kernels and attention backends a run on this card gets, from its capability (each is
    still probed against its reference at the run's start), and on which cards they were verified; `only`: the
    kernels the run's trainer takes (musubi-tuner's models: backend.options.MUSUBI_KERNELS)."""
    check = "kernels for card"
    if not info.is_gpu:
        return CheckResult(check, SKIP, "no CUDA GPU: flux_kernels apply to CUDA GPUs", "", GROUP)
    from flux_kernels.runtime import cards

    card = {"type": "cuda", "name": info.name, "capability": info.capability, "bf16": info.bf16,
            "vram_gib": info.vram_gib}  # fmt: skip
    line = cards.summary(card, only=only)
    verified = info.family in cards.VERIFIED_ON
    kernels = [c.name for c in cards.kernels_on(card) if c.applies and (only is None or c.name in only)]
    data = {"verified_here": verified, "kernels": kernels}
    fix = "" if verified else "nothing to do: the run probes each kernel on this card and says what it installed"
    return CheckResult(check, PASS if verified else WARN, line, fix, GROUP, data)


def identity_checks(info: DeviceInfo) -> list[CheckResult]:
    """The no-kernel part: identity, driver, torch build."""
    return [gpu_identity(info), driver_check(info), torch_build_check(info)]


def runtime_checks(info: DeviceInfo) -> list[CheckResult]:
    """The real-device part: bf16 and fp8 matmuls on it, its power limit, the kernels a run on it gets."""
    return [bf16_check(info), fp8_check(info), power_limit_check(info), kernels_for_card(info)]
