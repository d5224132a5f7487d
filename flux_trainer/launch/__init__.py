"""Launching a run: what device this is, the environment for it, the `accelerate launch` command, the child process.

device.py asks torch once (lazily: importing this package touches no CUDA); profiles.py and command.py are pure
builders over that answer; supervise.py is the only module that starts a process.
"""

from flux_trainer.launch.command import accelerate_config, launch_command, resolve_gpus
from flux_trainer.launch.device import DeviceInfo, arch_supported, detect_device, family_for
from flux_trainer.launch.failure import explain_failure
from flux_trainer.launch.profiles import EnvRecord, Profile, environment_profile, profile_json, profile_lines
from flux_trainer.launch.supervise import run_supervised

__all__ = [
    "DeviceInfo",
    "EnvRecord",
    "Profile",
    "accelerate_config",
    "arch_supported",
    "detect_device",
    "environment_profile",
    "explain_failure",
    "family_for",
    "launch_command",
    "profile_json",
    "profile_lines",
    "resolve_gpus",
    "run_supervised",
]
