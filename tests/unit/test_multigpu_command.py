"""1 GPU, N GPUs, N nodes: from the command line's overrides (composed like `flux-train` does) to the accelerate
command and config, checked with accelerate's own parser and config loader; and the effective batch size."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from accelerate.commands.config.config_args import ClusterConfig
from accelerate.commands.launch import launch_command_parser

from flux_trainer.app import train
from flux_trainer.commands.sweep import effective_batch, effective_batch_line
from flux_trainer.launch.command import RUNNER_MODULE, accelerate_config, launch_command, resolve_gpus
from flux_trainer.launch.device import DeviceInfo

RUN = Path("/runs/r1")


def gpus(count: int, name: str = "NVIDIA H200", capability=(9, 0), family: str = "hopper") -> DeviceInfo:
    return DeviceInfo(
        name=name,
        index=0,
        capability=capability,
        family=family,
        vram_gib=139.8 if family == "hopper" else 23.6,
        count=count,
        bf16=True,
        fp8=True,
        torch_version="2.8.0",
        torch_cuda="12.8",
    )


def command_and_config(cfg, info: DeviceInfo, tmp_path: Path):
    """The command as accelerate parses it, and the config as accelerate loads it (it rejects unknown keys)."""
    config = accelerate_config(cfg, info)
    (tmp_path / "accelerate.yaml").write_text(yaml.safe_dump(config))
    loaded = ClusterConfig.from_yaml_file(str(tmp_path / "accelerate.yaml"))
    cmd = launch_command(
        cfg,
        run_dir=RUN,
        accelerate_config_path=tmp_path / "accelerate.yaml",
        runner_args=["--run-dir", str(RUN)],
        info=info,
        python="/venv/bin/python",
    )
    assert cmd[:3] == ["/venv/bin/python", "-m", "accelerate.commands.launch"]
    args = launch_command_parser().parse_args(cmd[3:])
    assert (
        args.module and args.training_script == RUNNER_MODULE and args.config_file == str(tmp_path / "accelerate.yaml")
    )
    return args, config, loaded


def test_one_gpu(compose, tmp_path):
    args, config, loaded = command_and_config(compose("+dataset=mychar"), gpus(8), tmp_path)
    assert (args.num_processes, args.num_machines, args.multi_gpu, args.quiet) == (1, 1, False, True)
    assert config["distributed_type"] == "NO" and loaded.num_processes == 1
    assert "main_process_ip" not in config and args.main_process_ip is None


@pytest.mark.parametrize(("value", "visible", "processes"), [("2", 2, 2), ("4", 8, 4), ("all", 8, 8), ("all", 2, 2)])
def test_n_gpus_of_one_node(value, visible, processes, compose, tmp_path):
    cfg = compose("+dataset=mychar", f"launcher.gpus={value}")
    args, config, loaded = command_and_config(cfg, gpus(visible), tmp_path)
    assert args.multi_gpu and (args.num_processes, args.num_machines, args.machine_rank) == (processes, 1, 0)
    assert args.main_process_port == 29500 and args.log_dir == str(RUN / "torchrun") and not args.quiet
    assert args.main_process_ip is None  # one node: torchrun's local rendezvous
    assert config["distributed_type"] == "MULTI_GPU" and config["num_processes"] == processes
    assert loaded.num_processes == processes and loaded.num_machines == 1


def test_two_nodes(compose, tmp_path):
    common = ("+dataset=mychar", "launcher.gpus=8", "launcher.nodes=2", "launcher.main_address=10.0.0.1")
    commands = {}
    for rank in (0, 1):
        cfg = compose(*common, f"launcher.node_rank={rank}", "launcher.main_port=29555")
        args, config, loaded = command_and_config(cfg, gpus(8), tmp_path)
        assert (args.num_processes, args.num_machines, args.machine_rank) == (16, 2, rank)
        assert (args.main_process_ip, args.main_process_port, args.multi_gpu) == ("10.0.0.1", 29555, True)
        assert (config["num_processes"], config["num_machines"], config["machine_rank"]) == (16, 2, rank)
        assert (config["main_process_ip"], config["main_process_port"]) == ("10.0.0.1", 29555)
        assert (loaded.machine_rank, loaded.main_process_ip, loaded.num_processes) == (rank, "10.0.0.1", 16)
        commands[rank] = launch_command(
            cfg, run_dir=RUN, accelerate_config_path=RUN / "a.yaml", runner_args=[], info=gpus(8), python="py"
        )
    # the same config on every node: only the machine rank differs
    differs = [i for i, (a, b) in enumerate(zip(commands[0], commands[1], strict=True)) if a != b]
    assert [(commands[0][i - 1], commands[0][i], commands[1][i]) for i in differs] == [("--machine_rank", "0", "1")]


def test_dry_run_writes_the_multi_node_run_dir(compose, workdir, capsys):
    cfg = compose(
        "+dataset=mychar",
        "dry_run=true",
        "launcher.gpus=all",
        "launcher.nodes=2",
        "launcher.node_rank=1",
        "launcher.main_address=10.0.0.1",
    )
    run = workdir / "runs" / "r"
    assert train(cfg, run, search_dirs=[workdir / "configs"], info=gpus(4)) == 0
    command = (run / "command.txt").read_text().split()
    for flag, value in (("--num_processes", "8"), ("--num_machines", "2"), ("--machine_rank", "1")):
        assert command[command.index(flag) + 1] == value
    assert command[command.index("--main_process_ip") + 1] == "10.0.0.1"
    written = yaml.safe_load((run / "accelerate.yaml").read_text())
    assert (written["num_processes"], written["machine_rank"], written["main_process_ip"]) == (8, 1, "10.0.0.1")


def test_consumer_cards_without_peer_to_peer_get_nccl_settings(compose, workdir, monkeypatch):
    for name in ("NCCL_P2P_DISABLE", "NCCL_IB_DISABLE"):
        monkeypatch.delenv(name, raising=False)
    rtx = gpus(2, name="NVIDIA GeForce RTX 4090", capability=(8, 9), family="ada")
    env = {}
    for n in (1, 2):
        run = workdir / "runs" / f"g{n}"
        cfg = compose("+dataset=mychar", "dry_run=true", f"launcher.gpus={n}")
        assert train(cfg, run, search_dirs=[workdir / "configs"], info=rtx) == 0
        env[n] = json.loads((run / "env.json").read_text())["env"]
    assert env[2]["NCCL_P2P_DISABLE"] == "1" and env[2]["NCCL_IB_DISABLE"] == "1"
    assert "NCCL_P2P_DISABLE" not in env[1]  # one GPU: no NCCL at all


def test_effective_batch(compose):
    cfg = compose(
        "+dataset=mychar",
        "train.batch_size=2",
        "train.gradient_accumulation_steps=4",
        "launcher.gpus=8",
        "launcher.nodes=2",
        "launcher.main_address=10.0.0.1",
    )
    processes = resolve_gpus(cfg, gpus(8)) * cfg.launcher.nodes
    assert effective_batch(cfg, processes) == 2 * 4 * 16 == 128
    line = effective_batch_line(cfg, processes)
    assert line.startswith("effective batch 128 images/step") and "16 processes" in line and "not scaled" in line
    one = compose("+dataset=mychar")
    assert effective_batch(one, 1) == one.train.batch_size * one.train.gradient_accumulation_steps
    assert "not scaled" not in effective_batch_line(one, 1) and "1 process" in effective_batch_line(one, 1)
