"""GPU detection as data: families by capability, the arch check, and detect_device against a mocked torch.cuda."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from flux_trainer.launch.device import DeviceInfo, arch_supported, detect_device, family_for

CU126 = ("sm_50", "sm_60", "sm_70", "sm_75", "sm_80", "sm_86", "sm_90")
CU128 = ("sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120", "compute_120")


def gpu(name: str, cap: tuple[int, int], arch_list: tuple[str, ...], cuda: str = "12.6") -> DeviceInfo:
    return DeviceInfo(
        name=name,
        index=0,
        capability=cap,
        family=family_for(cap, name),
        vram_gib=31.4,
        count=1,
        bf16=cap >= (8, 0),
        fp8=cap >= (8, 9),
        torch_version="2.7.0",
        torch_cuda=cuda,
        arch_list=arch_list,
    )


@pytest.mark.parametrize(
    ("cap", "name", "family"),
    [
        ((12, 0), "NVIDIA GeForce RTX 5090", "blackwell_consumer"),
        ((12, 1), "NVIDIA GB10", "blackwell_consumer"),
        ((10, 0), "NVIDIA B200", "blackwell"),
        ((10, 3), "NVIDIA B300", "blackwell"),
        ((9, 0), "NVIDIA H200", "hopper"),
        ((8, 9), "NVIDIA GeForce RTX 4090", "ada"),
        ((8, 6), "NVIDIA GeForce RTX 3090", "ampere"),
        ((8, 0), "NVIDIA A100-SXM4-80GB", "ampere"),
        ((7, 5), "Tesla T4", "older"),
        (None, "", "cpu"),
    ],
)
def test_family_for(cap, name, family):
    assert family_for(cap, name) == family


def test_family_for_uses_the_name_only_without_a_capability():
    assert family_for(None, "NVIDIA H100 80GB HBM3") == "hopper"
    assert family_for(None, "NVIDIA GeForce RTX 4090") == "ada"
    # the capability decides when known, whatever the name says
    assert family_for((8, 6), "NVIDIA H100") == "ampere"


def test_sm120_on_a_cu126_build_is_unsupported_and_names_cuda_12_8():
    ok, message = arch_supported(gpu("NVIDIA GeForce RTX 5090", (12, 0), CU126))
    assert not ok
    assert "CUDA 12.8" in message and "cu128" in message and "sm_120" in message
    assert "download." not in message and "index-url" not in message  # no registry host names


def test_sm120_on_a_cu128_build_is_supported():
    ok, message = arch_supported(gpu("NVIDIA GeForce RTX 5090", (12, 0), CU128, cuda="12.8"))
    assert ok, message


@pytest.mark.parametrize(
    ("cap", "arch_list", "expected"),
    [
        ((8, 9), CU126, True),  # sm_86 cubins run on sm_89 (same major, lower minor)
        ((9, 0), ("sm_80", "sm_86"), False),  # another major: cubins do not carry over
        ((12, 0), ("sm_80", "compute_90"), True),  # PTX of a lower capability JIT-compiles
        ((8, 6), ("sm_90", "compute_90"), False),  # PTX of a higher capability does not
        ((10, 0), ("sm_90a", "compute_90a"), False),  # arch-specific 'a' code runs only on that exact card
        ((9, 0), ("sm_90a",), True),
    ],
)
def test_arch_compatibility_rules(cap, arch_list, expected):
    assert arch_supported(gpu("card", cap, arch_list))[0] is expected


def test_cpu_needs_no_arch_check():
    assert arch_supported(DeviceInfo.cpu(torch_version="2.13.0+cpu"))[0]


def test_detect_device_without_cuda_is_cpu():
    info = detect_device()
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: covered by the mocked test and tests/gpu")
    assert info.family == "cpu" and info.count == 0 and not info.is_gpu
    assert info.torch_version == torch.__version__


def test_detect_device_reads_torch_cuda(monkeypatch):
    import torch

    props = SimpleNamespace(name="NVIDIA GeForce RTX 4090", major=8, minor=9, total_memory=25_386_352_640)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props)
    monkeypatch.setattr(torch.cuda, "get_arch_list", lambda: list(CU126))
    monkeypatch.setattr(torch.version, "cuda", "12.6")
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    info = detect_device()
    assert (info.name, info.capability, info.family, info.count) == ("NVIDIA GeForce RTX 4090", (8, 9), "ada", 2)
    assert info.bf16 and info.fp8 and info.torch_cuda == "12.6" and info.arch_list == CU126
    assert 23.5 < info.vram_gib < 23.7
    assert not info.peer_to_peer  # GeForce RTX 40xx: no P2P
    assert "sm_89" in info.describe() and "x2" in info.describe()


def test_importing_the_launch_package_touches_no_torch():
    import subprocess
    import sys

    code = "import sys, flux_trainer.launch; sys.exit(1 if 'torch' in sys.modules else 0)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
