"""What device is this: the one place flux_kernels asks (capability, family, bf16, VRAM, Triton).

Everything else (registry `applies`, the attention cache key, the benchmark) takes a `DeviceInfo`, so tests can
hand in a made-up Hopper or Turing card without owning one. Nothing here runs at import time.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

import torch

INTERPRET_ENV = "TRITON_INTERPRET"


@dataclass(frozen=True)
class DeviceInfo:
    type: str  # "cuda" | "cpu" | "mps" | ...
    index: int | None = None
    name: str = "cpu"
    capability: tuple[int, int] | None = None
    family: str = "cpu"  # blackwell_consumer | blackwell | hopper | ada | ampere | turing_or_older | cpu | other
    bf16: bool = True
    vram_gib: float | None = None
    sm_count: int | None = None

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.type, self.index) if self.index is not None else torch.device(self.type)


def family_of(capability: tuple[int, int] | None) -> str:
    """GPU family by compute capability, the same buckets as the `hardware` config group."""
    if capability is None:
        return "cpu"
    major, minor = capability
    if major == 12:
        return "blackwell_consumer"
    if major == 10:
        return "blackwell"
    if major == 9:
        return "hopper"
    if (major, minor) == (8, 9):
        return "ada"
    if major == 8:
        return "ampere"
    return "turing_or_older"


def device_info(device: torch.device | str | int | None = None) -> DeviceInfo:
    """Describe `device` (default: the current CUDA device if there is one, else CPU). Queries CUDA only when the
    device is a CUDA device, so calling it on a CPU-only machine never initialises CUDA."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if dev.type != "cuda":
        return DeviceInfo(type=dev.type, index=dev.index, name=dev.type, family="cpu" if dev.type == "cpu" else "other")
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    cap = (props.major, props.minor)
    return DeviceInfo(
        type="cuda",
        index=index,
        name=props.name,
        capability=cap,
        family=family_of(cap),
        bf16=cap >= (8, 0),
        vram_gib=round(props.total_memory / 2**30, 1),
        sm_count=props.multi_processor_count,
    )


def as_device_info(device: DeviceInfo | torch.device | str | int | dict | None) -> DeviceInfo:
    """Accept what callers have at hand: a DeviceInfo, a torch.device / string, or a dict of DeviceInfo fields."""
    if isinstance(device, DeviceInfo):
        return device
    if isinstance(device, dict):
        fields = dict(device)
        if fields.get("capability") is not None:
            fields["capability"] = tuple(fields["capability"])
            fields.setdefault("family", family_of(fields["capability"]))
        return DeviceInfo(**fields)
    return device_info(device)


_triton_found: bool | None = None


@torch.compiler.assume_constant_result
def triton_available() -> bool:
    """True if `import triton` would find a package. Does not import it (that takes a second and is not needed
    to decide). Looked up once per process: every fast op asks. A constant to torch.compile, which would otherwise
    break the graph at `find_spec` when traced code asks first (single_qkv's forward)."""
    global _triton_found
    if _triton_found is None:
        _triton_found = importlib.util.find_spec("triton") is not None
    return _triton_found


def triton_interpreting() -> bool:
    """Triton's CPU interpreter (TRITON_INTERPRET=1): runs the same kernels on CPU tensors, slowly. Tests use it."""
    return os.environ.get(INTERPRET_ENV, "0") not in ("", "0")


def triton_runs_on(tensor_or_device: torch.Tensor | torch.device | str) -> bool:
    """Can a Triton kernel run on tensors that live here: CUDA with triton installed, or CPU under the
    interpreter. Anything else (CPU without the interpreter, MPS) takes the reference path."""
    dev = tensor_or_device.device if isinstance(tensor_or_device, torch.Tensor) else torch.device(tensor_or_device)
    if not triton_available():
        return False
    if dev.type == "cuda":
        return True
    return dev.type == "cpu" and triton_interpreting()
