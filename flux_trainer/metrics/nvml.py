"""GPU readings from NVML (utilisation, power, temperature, SM clock), or nothing when NVML is not there.

Why NVML and not torch: utilisation, power, clocks and temperature are what explain a step that got slower
(thermal or power throttling, another process on the card) and torch does not report them. NVML is optional:
no NVIDIA driver, no ``nvidia-ml-py``, a CPU run, or a container without the library all give an empty reading,
with one debug line, never an exception or a warning per step.
"""

from __future__ import annotations

import logging
import os
from typing import Any

logger = logging.getLogger(__name__)


def _torch_uuid(index: int) -> str | None:
    """The CUDA device's UUID as NVML spells it, so CUDA_VISIBLE_DEVICES remapping cannot pick the wrong card."""
    try:
        import torch

        if not torch.cuda.is_available():
            return None
        uuid = str(torch.cuda.get_device_properties(index).uuid)
    except Exception:  # any failure just means "fall back to the index"
        return None
    return uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}"


class NvmlReader:
    """Reads one GPU through NVML. Initialises lazily on the first ``read()``; a failure disables it for good.

    ``device_index`` is torch's CUDA index. The handle is looked up by UUID (torch and NVML number GPUs
    differently when CUDA_VISIBLE_DEVICES is set), and by index only when no UUID is available and
    CUDA_VISIBLE_DEVICES is unset.
    """

    def __init__(self, device_index: int = 0, nvml: Any = None) -> None:
        self.device_index = device_index
        self._nvml = nvml  # injectable for tests; otherwise the pynvml module
        self._handle: Any = None
        self._state = "new"  # new | ready | off

    @property
    def available(self) -> bool:
        """True once a handle was obtained; triggers the lazy init."""
        self._init()
        return self._state == "ready"

    def _init(self) -> None:
        if self._state != "new":
            return
        self._state = "off"
        try:
            if self._nvml is None:
                import pynvml

                self._nvml = pynvml
            self._nvml.nvmlInit()
            uuid = _torch_uuid(self.device_index)
            if uuid is not None:
                self._handle = self._nvml.nvmlDeviceGetHandleByUUID(uuid)
            elif os.environ.get("CUDA_VISIBLE_DEVICES") is None:
                self._handle = self._nvml.nvmlDeviceGetHandleByIndex(self.device_index)
            else:
                logger.debug(
                    "NVML: no UUID for CUDA device %d under CUDA_VISIBLE_DEVICES; gpu/* off", self.device_index
                )
                return
        except Exception as exc:  # NVML missing is normal (CPU, no driver): say it once, quietly
            logger.debug("NVML unavailable, gpu/* tags off: %s", exc)
            return
        self._state = "ready"

    def read(self) -> dict[str, float]:
        """``gpu/util_pct``, ``gpu/power_w``, ``gpu/temp_c``, ``gpu/sm_clock_mhz``; a reading NVML refuses
        (some boards do not report power) is left out, the others still come."""
        self._init()
        if self._state != "ready":
            return {}
        n, h = self._nvml, self._handle
        readers = {
            "gpu/util_pct": lambda: n.nvmlDeviceGetUtilizationRates(h).gpu,
            "gpu/power_w": lambda: n.nvmlDeviceGetPowerUsage(h) / 1000.0,
            "gpu/temp_c": lambda: n.nvmlDeviceGetTemperature(h, n.NVML_TEMPERATURE_GPU),
            "gpu/sm_clock_mhz": lambda: n.nvmlDeviceGetClockInfo(h, n.NVML_CLOCK_SM),
        }
        out: dict[str, float] = {}
        for tag, fn in readers.items():
            try:
                out[tag] = float(fn())
            except Exception:  # NotSupported on this board: leave the tag out
                continue
        return out

    def energy_j(self) -> float | None:
        """The card's energy counter in joules (NVML counts millijoules since the driver loaded; Volta and newer),
        or None where it cannot be read."""
        self._init()
        if self._state != "ready":
            return None
        try:
            return self._nvml.nvmlDeviceGetTotalEnergyConsumption(self._handle) / 1000.0
        except Exception:
            return None

    def max_sm_clock_mhz(self) -> float | None:
        """The board's maximum SM clock, to show how far a throttled clock has fallen."""
        if not self.available:
            return None
        try:
            return float(self._nvml.nvmlDeviceGetMaxClockInfo(self._handle, self._nvml.NVML_CLOCK_SM))
        except Exception:
            return None

    def power_limits_w(self) -> tuple[float, float] | None:
        """The power limit the board enforces and its default, in watts; None where NVML does not say."""
        if not self.available:
            return None
        try:
            n, h = self._nvml, self._handle
            return n.nvmlDeviceGetEnforcedPowerLimit(h) / 1000.0, n.nvmlDeviceGetPowerManagementDefaultLimit(h) / 1000.0
        except Exception:
            return None

    def close(self) -> None:
        """Shut NVML down if we started it."""
        if self._state == "ready":
            try:
                self._nvml.nvmlShutdown()
            except Exception:
                pass
        self._state = "off"
