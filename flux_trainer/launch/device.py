"""What device is this: the one place that asks torch (and the driver) about the GPU.

Everything else in flux-train (environment profiles, the launch command, memory presets, kernel choice) takes a
`DeviceInfo` and never asks torch again, so tests can hand in any card as plain data. torch is imported only inside
`detect_device`: importing this module touches no CUDA.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

FAMILIES = ("blackwell_consumer", "blackwell", "hopper", "ada", "ampere", "older", "rocm", "cpu")

# Capability -> the first CUDA toolkit that ships code for it; the torch build must be at least this "cuXYZ".
_MIN_CUDA = {
    (12, 1): "12.9",
    (12, 0): "12.8",
    (11, 0): "13.0",
    (10, 3): "12.9",
    (10, 0): "12.8",
    (9, 0): "11.8",
    (8, 9): "11.8",
    (8, 7): "11.4",
    (8, 6): "11.1",
    (8, 0): "11.0",
}

# Used only when the capability is unknown (e.g. a name read from nvidia-smi): first match wins.
_NAME_FAMILIES = (
    (r"RTX\s*50\d\d|RTX PRO \d+ Blackwell|GB10\b", "blackwell_consumer"),
    (r"\bG?B[23]00\b", "blackwell"),
    (r"\bG?H[12]00\b|\bH20\b|\bH800\b", "hopper"),
    (r"RTX\s*40\d\d|\bL40S?\b|\bL4\b|RTX \d+ Ada", "ada"),
    (r"RTX\s*30\d\d|\bA100\b|\bA800\b|\bA[1-6]0\b|RTX A\d+", "ampere"),
)
# GeForce cards of these generations have no GPU peer-to-peer; NCCL must not try it (see profiles.py).
_NO_P2P_NAMES = re.compile(r"RTX\s*(40|50)\d\d")


@dataclass(frozen=True)
class DeviceInfo:
    """One GPU as flux-train sees it (the first visible one: multi-GPU runs are assumed to be one model of card)."""

    name: str
    index: int
    capability: tuple[int, int] | None  # None without a GPU
    family: str  # one of FAMILIES
    vram_gib: float
    count: int  # visible GPUs (CUDA_VISIBLE_DEVICES applies)
    bf16: bool
    fp8: bool  # tensor-core fp8 matmuls (sm_89 and newer)
    torch_version: str = ""
    torch_cuda: str | None = None  # torch.version.cuda: the CUDA the wheel was built for; None on CPU builds
    arch_list: tuple[str, ...] = field(default_factory=tuple)  # torch.cuda.get_arch_list(): sm_XY / compute_XY
    driver: str | None = None  # NVIDIA kernel driver version, when readable without starting anything

    @property
    def is_gpu(self) -> bool:
        return self.family != "cpu"

    @property
    def peer_to_peer(self) -> bool:
        """False for GeForce RTX 40xx/50xx: no P2P between cards, so NCCL must go through host memory."""
        return not _NO_P2P_NAMES.search(self.name)

    @classmethod
    def cpu(
        cls,
        torch_version: str = "",
        torch_cuda: str | None = None,
        arch_list: tuple[str, ...] = (),
        driver: str | None = None,
    ) -> DeviceInfo:
        """No usable GPU: a CPU run (tiny models, tests)."""
        return cls(
            name="cpu",
            index=0,
            capability=None,
            family="cpu",
            vram_gib=0.0,
            count=0,
            bf16=False,
            fp8=False,
            torch_version=torch_version,
            torch_cuda=torch_cuda,
            arch_list=tuple(arch_list),
            driver=driver,
        )

    def describe(self) -> str:
        """One line for logs and messages: 'NVIDIA GeForce RTX 5090 (sm_120, blackwell_consumer, 31.4 GiB) x2'."""
        if not self.is_gpu:
            return f"no CUDA GPU (torch {self.torch_version or '?'})"
        cap = f"sm_{self.capability[0]}{self.capability[1]}" if self.capability else "sm_?"
        count = f" x{self.count}" if self.count > 1 else ""
        return f"{self.name} ({cap}, {self.family}, {self.vram_gib:.1f} GiB){count}"


def family_for(capability: tuple[int, int] | None, name: str = "") -> str:
    """The GPU family that picks presets and environment profiles, from the compute capability.

    The name is only a fallback when the capability is unknown. Families follow what changes our choices:
    sm_80+ has bf16 and TF32, sm_89+ has fp8 tensor cores, sm_90+ datacenter parts have P2P/NVLink and 80+ GB.
    """
    if capability is None:
        for pattern, family in _NAME_FAMILIES:
            if name and re.search(pattern, name):
                return family
        return "cpu"
    major, minor = capability
    if major >= 12:
        return "blackwell_consumer"  # sm_120 RTX 50xx / RTX PRO, sm_121 GB10
    if major in (10, 11):
        return "blackwell"  # sm_100 B200/GB200, sm_103 B300, sm_110 Thor
    if major == 9:
        return "hopper"
    if (major, minor) >= (8, 9):
        return "ada"
    if major == 8:
        return "ampere"
    return "older"


def arch_supported(info: DeviceInfo) -> tuple[bool, str]:
    """Does the installed torch ship kernels for this card? (ok, message)

    A card runs a cubin `sm_XY` of its own major version with minor <= its own ('a' variants only on exactly
    that card), or JIT-compiles PTX `compute_XY` for any XY <= its capability. Without either, the first kernel
    fails with "no kernel image is available", after minutes of model loading: better to say it up front.
    """
    if not info.is_gpu:
        return True, "no CUDA GPU: nothing to check"
    if info.family == "rocm":
        return True, "ROCm build: architecture not checked"
    cap = info.capability
    if cap is None or not info.arch_list:
        return True, f"torch {info.torch_version} reports no architecture list: not checked"
    card = cap[0] * 10 + cap[1]
    for arch in info.arch_list:
        m = re.fullmatch(r"(sm|compute)_(\d+)([af]?)", arch)
        if not m:
            continue
        kind, code, suffix = m.group(1), int(m.group(2)), m.group(3)
        if kind == "compute" and (code == card or (suffix != "a" and code <= card)):
            return True, f"{info.name} (sm_{card}) runs torch's PTX {arch} (JIT-compiled on first use)"
        if kind == "sm" and (code == card or (suffix != "a" and code // 10 == cap[0] and code <= card)):
            return True, f"torch {info.torch_version} has kernels for {info.name} ({arch})"
    need = _MIN_CUDA.get(cap, "12.8")
    tag = "cu" + need.replace(".", "")
    built = f"CUDA {info.torch_cuda}" if info.torch_cuda else "no CUDA (CPU-only build)"
    return False, (
        f"torch {info.torch_version} (built for {built}, architectures {' '.join(info.arch_list)}) has no kernels "
        f"for {info.name} (sm_{card}): install the PyTorch build for CUDA {need} or newer (pytorch.org 'Get started' "
        f"selector, {tag}), torch 2.7 or newer for sm_120"
    )


def _driver_version() -> str | None:
    """The NVIDIA kernel driver's version from /proc: a file read, no subprocess, no CUDA context."""
    try:
        text = Path("/proc/driver/nvidia/version").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    m = re.search(r"Kernel Module(?: for \S+)?\s+(\d+(?:\.\d+)+)", text)
    return m.group(1) if m else None


def detect_device(index: int = 0) -> DeviceInfo:
    """Ask torch once about GPU `index` (default the first visible one).

    Uses only device properties (no tensor, no `mem_get_info`), so the launcher process does not take a CUDA
    context and its ~500 MB of VRAM away from the training child on the same card.
    """
    import torch

    version = str(torch.__version__)
    cuda = torch.version.cuda
    hip = getattr(torch.version, "hip", None)
    driver = _driver_version()
    if not torch.cuda.is_available():
        return DeviceInfo.cpu(torch_version=version, torch_cuda=cuda, driver=driver)
    arch_list = tuple(torch.cuda.get_arch_list())
    count = torch.cuda.device_count()
    props = torch.cuda.get_device_properties(index)
    capability = (int(props.major), int(props.minor))
    family = "rocm" if hip else family_for(capability, props.name)
    return DeviceInfo(
        name=str(props.name),
        index=index,
        capability=capability,
        family=family,
        vram_gib=round(props.total_memory / 2**30, 2),
        count=count,
        bf16=capability >= (8, 0) or bool(hip),
        fp8=capability >= (8, 9) and not hip,
        torch_version=version,
        torch_cuda=cuda,
        arch_list=arch_list,
        driver=driver,
    )


def named_device(
    name: str, card: str, capability: tuple[int, int], vram_gib: float, count: int, here: DeviceInfo
) -> DeviceInfo:
    """The card a `hardware=NAME` preset describes, as if detected: its family, bf16 and fp8 from the capability.
    The software is this machine's (`here`'s torch); the architecture list is left empty (the card's own machine
    has its own torch build; `arch_supported` says it was not checked)."""
    capability = (int(capability[0]), int(capability[1]))
    return DeviceInfo(
        name=card,
        index=0,
        capability=capability,
        family=family_for(capability, card),
        vram_gib=float(vram_gib),
        count=max(1, count),
        bf16=capability >= (8, 0),
        fp8=capability >= (8, 9),
        torch_version=here.torch_version,
        torch_cuda=here.torch_cuda,
        arch_list=(),
        driver=None,
    )


def is_card(named: DeviceInfo, match: str | None, detected: DeviceInfo) -> bool:
    """Whether the detected card is the one a preset names: its name matches the preset's `match` (a regex,
    case-insensitive; else the preset's card name is contained in it) and the capability is the same."""
    if not detected.is_gpu or detected.capability != named.capability:
        return False
    if match:
        return re.search(match, detected.name, flags=re.IGNORECASE) is not None
    return named.name.lower() in detected.name.lower()
