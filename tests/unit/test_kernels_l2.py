"""flux_kernels.memory.l2 without a GPU: the ctypes structures match CUDA's driver_types.h layout, the window size
respects the device limits, bad requests are refused before the runtime is touched, and the runtime PyTorch loaded is
the one found. (Setting a window for real: tests/gpu/test_kernels_gpu.py.)"""

from __future__ import annotations

import ctypes

import pytest
import torch

from flux_kernels.memory import l2


def test_structures_have_the_cuda_header_layout():
    W = l2.AccessPolicyWindow
    assert ctypes.sizeof(W) == 32  # void*, size_t, float, two enums, padded to 8
    assert [getattr(W, f).offset for f in ("base_ptr", "num_bytes", "hitRatio", "hitProp", "missProp")] == [
        0,
        8,
        16,
        20,
        24,
    ]
    assert ctypes.sizeof(l2.LaunchAttributeValue) == 64  # union cudaLaunchAttributeValue { char pad[64]; ... }


def test_window_bytes_respect_both_device_limits():
    info = l2.L2Info(l2_bytes=60 << 20, max_persisting_bytes=45 << 20, max_window_bytes=128 << 20)
    assert l2.window_bytes(25 << 20, info) == 25 << 20
    assert l2.window_bytes(132 << 20, info) == 45 << 20  # the set-aside is the smaller limit
    assert l2.window_bytes(132 << 20, l2.L2Info(60 << 20, 45 << 20, 32 << 20)) == 32 << 20
    assert l2.window_bytes(1 << 20, l2.L2Info(60 << 20, 0, 128 << 20)) == 0  # no persistence on this device


def test_bad_requests_are_refused_before_the_runtime_is_called(monkeypatch):
    monkeypatch.setattr(l2, "cudart", lambda: pytest.fail("the CUDA runtime must not be called"))
    with pytest.raises(ValueError, match="hit_ratio=1.5"), l2.persisting_window(torch.ones(4), 1.5):
        pass
    with pytest.raises(ValueError, match="needs a CUDA tensor, not one on cpu"), l2.persisting_window(torch.ones(4)):
        pass


def test_the_runtime_pytorch_loaded_is_found_in_the_process_maps(tmp_path):
    maps = tmp_path / "maps"
    maps.write_text(
        "7f00-7f01 r-xp 00000000 08:01 1 /usr/lib/libc.so.6\n"
        "7f02-7f03 r-xp 00000000 08:01 2 /opt/venv/nvidia/cu13/lib/libcudart.so.13\n"
    )
    assert l2._loaded_cudart_path(str(maps)) == "/opt/venv/nvidia/cu13/lib/libcudart.so.13"
    maps.write_text("7f00-7f01 r-xp 00000000 08:01 1 /usr/lib/libc.so.6\n")
    assert l2._loaded_cudart_path(str(maps)) is None
    assert l2._loaded_cudart_path(str(tmp_path / "absent")) is None
