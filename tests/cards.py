"""Cards as flux_trainer.launch.device.DeviceInfo describes them, for tests that decide per card without one."""

from __future__ import annotations

from flux_trainer.launch.device import DeviceInfo

H200 = DeviceInfo("NVIDIA H200", 0, (9, 0), "hopper", 139.8, 1, True, True, "2.11.0", "13.0", ("sm_90",))
RTX4090 = DeviceInfo("NVIDIA GeForce RTX 4090", 0, (8, 9), "ada", 23.6, 1, True, True, "2.7.0", "12.8", ("sm_89",))
