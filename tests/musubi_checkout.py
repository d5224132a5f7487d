"""The musubi-tuner checkout the tests use, found the way users' runs find it (`musubi_tuner=PATH`,
$FLUX_TRAIN_MUSUBI_TUNER, the cache folder): `MUSUBI` (None where there is none) and `WHY` (why not), and
`need_musubi()`, which skips a test with that reason; `FakeAccelerator`, what our musubi-tuner kernel install reads of
accelerate's Accelerator."""

from __future__ import annotations

import contextlib

import pytest
import torch

from flux_trainer.config import ConfigError
from flux_trainer.musubi.checkout import locate

try:
    MUSUBI, WHY = locate(), ""
except ConfigError as exc:  # pragma: no cover - depends on the machine
    MUSUBI, WHY = None, str(exc)


def need_musubi() -> None:
    if MUSUBI is None:
        pytest.skip(f"needs a musubi-tuner checkout: {WHY}")


class FakeAccelerator:
    """What install_kernels reads of accelerate's Accelerator: the device, unwrap_model, autocast (in `dtype`; None:
    none)."""

    def __init__(self, device: str = "cpu", dtype: torch.dtype | None = None) -> None:
        self.device = torch.device(device)
        self.dtype = dtype

    def unwrap_model(self, model):
        return model

    def autocast(self):
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)
