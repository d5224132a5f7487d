"""L2-cache persistence windows (CUDA 11+, Ampere and newer): mark one address range of a stream's accesses as
"persisting", so it is evicted from L2 after other data. An experiment, not a kernel: the issue's seed notes claim
gains from it, and `scripts/bench_kernels.py --l2` measures whether a window over a FLUX block's activations or
weights makes the block's forward+backward faster. Nothing installs it into training unless that measurement says
it pays.

PyTorch has no API for it; this calls the CUDA runtime PyTorch itself loaded (same context, same streams) through
ctypes, with the structures of CUDA's driver_types.h:

    struct cudaAccessPolicyWindow { void *base_ptr; size_t num_bytes; float hitRatio;
                                    enum cudaAccessProperty hitProp, missProp; }        // 32 bytes with padding
    union  cudaLaunchAttributeValue { char pad[64]; struct cudaAccessPolicyWindow accessPolicyWindow; ... }
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
from contextlib import contextmanager
from dataclasses import dataclass

import torch

ACCESS_NORMAL, ACCESS_STREAMING, ACCESS_PERSISTING = 0, 1, 2  # enum cudaAccessProperty
LIMIT_PERSISTING_L2 = 0x06  # cudaLimitPersistingL2CacheSize
ATTR_MAX_PERSISTING_L2 = 108  # cudaDevAttrMaxPersistingL2CacheSize
ATTR_MAX_WINDOW = 109  # cudaDevAttrMaxAccessPolicyWindowSize
STREAM_ATTR_ACCESS_POLICY_WINDOW = 1  # cudaLaunchAttributeAccessPolicyWindow (= cudaStreamAttributeAccessPolicyWindow)


class AccessPolicyWindow(ctypes.Structure):
    _fields_ = [
        ("base_ptr", ctypes.c_void_p),
        ("num_bytes", ctypes.c_size_t),
        ("hitRatio", ctypes.c_float),
        ("hitProp", ctypes.c_int),
        ("missProp", ctypes.c_int),
    ]


class LaunchAttributeValue(ctypes.Union):
    _fields_ = [("pad", ctypes.c_char * 64), ("accessPolicyWindow", AccessPolicyWindow)]


@dataclass(frozen=True)
class L2Info:
    l2_bytes: int  # the whole L2
    max_persisting_bytes: int  # how much of it may be set aside for persisting lines
    max_window_bytes: int  # the largest address range one window may name


def _loaded_cudart_path(maps_path: str = "/proc/self/maps") -> str | None:
    """The libcudart PyTorch has loaded (so ctypes talks to the same runtime and context), from /proc/self/maps."""
    try:
        with open(maps_path) as maps:
            for line in maps:
                path = line.rsplit(" ", 1)[-1].strip()
                if "libcudart.so" in os.path.basename(path):
                    return path
    except OSError:
        return None
    return None


@functools.cache
def cudart() -> ctypes.CDLL:
    """The CUDA runtime library, the one already in this process when there is one (loaded once)."""
    torch.cuda.init()
    path = _loaded_cudart_path() or ctypes.util.find_library("cudart")
    if path is None:
        raise OSError("no libcudart found (neither loaded by PyTorch nor on the library path)")
    return ctypes.CDLL(path)


def _check(rt: ctypes.CDLL, code: int, what: str) -> None:
    if code != 0:
        rt.cudaGetErrorString.restype = ctypes.c_char_p
        raise RuntimeError(f"{what} failed: CUDA error {code} ({rt.cudaGetErrorString(code).decode()})")


def l2_info(device: torch.device) -> L2Info:
    rt = cudart()
    index = device.index if device.index is not None else torch.cuda.current_device()
    values = []
    for attr in (ATTR_MAX_PERSISTING_L2, ATTR_MAX_WINDOW):
        out = ctypes.c_int(0)
        _check(rt, rt.cudaDeviceGetAttribute(ctypes.byref(out), attr, index), f"cudaDeviceGetAttribute({attr})")
        values.append(out.value)
    return L2Info(torch.cuda.get_device_properties(index).L2_cache_size, *values)


def window_bytes(nbytes: int, info: L2Info) -> int:
    """How much of a tensor of `nbytes` one window covers: the device's window and persisting limits."""
    return max(0, min(nbytes, info.max_window_bytes, info.max_persisting_bytes))


def stream_window(stream: torch.cuda.Stream) -> AccessPolicyWindow:
    """The access policy window `stream` has now (num_bytes 0: none)."""
    rt = cudart()
    value = LaunchAttributeValue()
    handle = ctypes.c_void_p(stream.cuda_stream)
    _check(
        rt,
        rt.cudaStreamGetAttribute(handle, STREAM_ATTR_ACCESS_POLICY_WINDOW, ctypes.byref(value)),
        "cudaStreamGetAttribute",
    )
    return value.accessPolicyWindow


@contextmanager
def persisting_window(tensor: torch.Tensor, hit_ratio: float = 1.0, stream: torch.cuda.Stream | None = None):
    """Within the block, kernels launched on `stream` (default: the current one) treat `tensor`'s bytes (up to the
    device limits) as persisting in L2 for `hit_ratio` of its lines, the rest streaming. Restored on exit: the
    window removed, persisting lines reset to normal, the set-aside returned. Yields the bytes covered."""
    if not 0.0 <= hit_ratio <= 1.0:
        raise ValueError(f"hit_ratio={hit_ratio}: must be within [0, 1]")
    if tensor.device.type != "cuda":
        raise ValueError(f"an L2 window needs a CUDA tensor, not one on {tensor.device}")
    info = l2_info(tensor.device)
    covered = window_bytes(tensor.numel() * tensor.element_size(), info)
    if covered == 0:
        raise RuntimeError(f"this device allows no L2 persistence ({info})")
    rt = cudart()
    handle = ctypes.c_void_p((stream or torch.cuda.current_stream(tensor.device)).cuda_stream)
    value = LaunchAttributeValue()
    value.accessPolicyWindow = AccessPolicyWindow(
        tensor.data_ptr(), covered, float(hit_ratio), ACCESS_PERSISTING, ACCESS_STREAMING
    )
    _check(rt, rt.cudaDeviceSetLimit(LIMIT_PERSISTING_L2, ctypes.c_size_t(covered)), "cudaDeviceSetLimit")
    _check(
        rt,
        rt.cudaStreamSetAttribute(handle, STREAM_ATTR_ACCESS_POLICY_WINDOW, ctypes.byref(value)),
        "cudaStreamSetAttribute",
    )
    try:
        yield covered
    finally:
        off = LaunchAttributeValue()
        off.accessPolicyWindow = AccessPolicyWindow(None, 0, 0.0, ACCESS_NORMAL, ACCESS_NORMAL)
        rt.cudaStreamSetAttribute(handle, STREAM_ATTR_ACCESS_POLICY_WINDOW, ctypes.byref(off))
        rt.cudaCtxResetPersistingL2Cache()
        rt.cudaDeviceSetLimit(LIMIT_PERSISTING_L2, ctypes.c_size_t(0))
