"""The `accelerate launch` command and the accelerate config it reads: pure builders, nothing is started here.

The config is generated for every run and passed with `--config_file`, so a user's `accelerate config` default
(~/.cache/huggingface/accelerate/default_config.yaml, perhaps DeepSpeed or another GPU count) never changes a
flux-train run. The same launcher keys describe single GPU, multi-GPU and multi-node; the process count, node
count and rendezvous address are also on the command line so `command.txt` reads on its own.
"""

from __future__ import annotations

import ipaddress
import sys
from pathlib import Path
from typing import Any

from flux_trainer.config.errors import ConfigError
from flux_trainer.launch.device import DeviceInfo

RUNNER_MODULE = "flux_trainer.sdscripts.runner"
MIXED_PRECISION = ("no", "fp16", "bf16")


def _int_or_none(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.strip().isdigit():
        return int(value.strip())
    return None


def _loopback(address: str) -> bool:
    if address.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(address.strip()).is_loopback
    except ValueError:
        return False


def resolve_gpus(cfg: Any, info: DeviceInfo) -> int:
    """Processes per node: `launcher.gpus` as a number, "all" -> every visible GPU, 1 on a CPU-only machine.

    Checks every launcher key against the device and raises one ConfigError listing all problems.
    """
    launcher = cfg.launcher
    problems: list[str] = []
    raw = launcher.gpus
    gpus = _int_or_none(raw)
    if isinstance(raw, str) and raw.strip().lower() == "all":
        gpus = max(info.count, 1)
    elif gpus is None or gpus < 1:
        problems.append(f"launcher.gpus={raw!r}: use a number of GPUs >= 1, or 'all'")
        gpus = 1
    elif not info.is_gpu and gpus > 1:
        problems.append(
            f"launcher.gpus={gpus} but no CUDA GPU is visible ({info.describe()}): use launcher.gpus=1 for a CPU run, "
            "or install a CUDA build of torch"
        )
    elif info.is_gpu and gpus > info.count:
        problems.append(
            f"launcher.gpus={gpus} but only {info.count} GPU{'s' if info.count != 1 else ''} visible "
            f"({info.describe()}; CUDA_VISIBLE_DEVICES limits this): use launcher.gpus={info.count} "
            "or launcher.gpus=all"
        )
    nodes = launcher.nodes
    if nodes < 1:
        problems.append(f"launcher.nodes={nodes}: use 1 or more")
    elif not 0 <= launcher.node_rank < nodes:
        problems.append(f"launcher.node_rank={launcher.node_rank}: use 0 to {nodes - 1} (launcher.nodes={nodes})")
    if nodes > 1 and not info.is_gpu:
        problems.append(f"launcher.nodes={nodes} needs CUDA GPUs; this machine has {info.describe()}")
    if nodes > 1 and _loopback(str(launcher.main_address)):
        problems.append(
            f"launcher.main_address={launcher.main_address} with launcher.nodes={nodes}: set it to an address of "
            "node 0 that every node can reach"
        )
    if not (0 if nodes == 1 else 1) <= launcher.main_port <= 65535:
        problems.append(f"launcher.main_port={launcher.main_port}: use a free TCP port 1-65535 (e.g. 29500)")
    if launcher.cpu_threads_per_process < 1:
        problems.append(f"launcher.cpu_threads_per_process={launcher.cpu_threads_per_process}: use 1 or more")
    mixed = cfg.precision.mixed
    if mixed not in MIXED_PRECISION:
        problems.append(f"precision.mixed={mixed!r}: choose one of {', '.join(MIXED_PRECISION)}")
    elif mixed == "bf16" and info.is_gpu and not info.bf16:
        problems.append(
            f"precision.mixed=bf16 needs sm_80 or newer; {info.describe()} has no bf16: use precision.mixed=fp16"
        )
    if problems:
        raise ConfigError(problems)
    return gpus


def accelerate_config(cfg: Any, info: DeviceInfo) -> dict[str, Any]:
    """The accelerate config file's content for this run (write it as .json or .yaml: accelerate reads by suffix).

    Keys are exactly accelerate's `ClusterConfig` fields (accelerate rejects unknown ones). Dynamo stays off here:
    flux-train compiles blocks itself where it helps, not the whole model through accelerate.
    """
    gpus = resolve_gpus(cfg, info)
    launcher = cfg.launcher
    processes = gpus * launcher.nodes
    config: dict[str, Any] = {
        "compute_environment": "LOCAL_MACHINE",
        "debug": False,
        "distributed_type": "MULTI_GPU" if processes > 1 else "NO",
        "downcast_bf16": "no",
        "dynamo_config": {"dynamo_backend": "NO"},
        "enable_cpu_affinity": False,
        "gpu_ids": "all",
        "machine_rank": int(launcher.node_rank),
        "main_training_function": "main",
        "mixed_precision": str(cfg.precision.mixed),
        "num_machines": int(launcher.nodes),
        "num_processes": processes,
        "rdzv_backend": "static",
        "same_network": True,
        "tpu_env": [],
        "tpu_use_cluster": False,
        "tpu_use_sudo": False,
        "use_cpu": not info.is_gpu,
    }
    if processes > 1:
        config["main_process_ip"] = str(launcher.main_address)
        config["main_process_port"] = int(launcher.main_port)
    return config


def launch_command(
    cfg: Any,
    *,
    run_dir: Path,
    accelerate_config_path: Path,
    runner_args: list[str],
    info: DeviceInfo,
    python: str = sys.executable,
    cpu_threads: int | None = None,
    module: str = RUNNER_MODULE,
) -> list[str]:
    """`python -m accelerate.commands.launch ... -m flux_trainer.sdscripts.runner ARGS` as an argument list.

    `python -m accelerate.commands.launch` instead of the `accelerate` script: the same interpreter (venv) as
    flux-train, whatever PATH says. `--quiet` keeps accelerate from adding its own CalledProcessError traceback
    after a single-process failure, so the end of train.log is the real error. Multi-process runs go through
    torchrun, whose per-rank error files land in `<run_dir>/torchrun`. `cpu_threads` defaults to
    launcher.cpu_threads_per_process; accelerate exports it as OMP_NUM_THREADS, overriding the environment.
    """
    gpus = resolve_gpus(cfg, info)
    launcher = cfg.launcher
    processes = gpus * launcher.nodes
    threads = cpu_threads if cpu_threads is not None else int(launcher.cpu_threads_per_process)
    cmd = [python, "-m", "accelerate.commands.launch", "--config_file", str(accelerate_config_path)]
    if info.is_gpu:
        cmd += ["--num_processes", str(processes), "--num_machines", str(launcher.nodes)]
    else:
        cmd += ["--cpu"]
    if processes > 1:
        cmd += [
            "--multi_gpu",
            "--machine_rank",
            str(launcher.node_rank),
            "--main_process_port",
            str(launcher.main_port),
            "--log_dir",
            str(Path(run_dir) / "torchrun"),
        ]
        if launcher.nodes > 1:
            cmd += ["--main_process_ip", str(launcher.main_address)]
    else:
        cmd += ["--quiet"]
    cmd += ["--num_cpu_threads_per_process", str(threads), "-m", module, *runner_args]
    return cmd
