"""The accelerate config and launch command, checked against accelerate's own config loader and argument parser."""

from __future__ import annotations

import io
import json
import os
import sys
from pathlib import Path

import pytest
import yaml
from accelerate.commands.config.config_args import ClusterConfig
from accelerate.commands.launch import launch_command_parser
from omegaconf import OmegaConf

from flux_trainer.config import ConfigError, RunConfig
from flux_trainer.launch.command import RUNNER_MODULE, accelerate_config, launch_command, resolve_gpus
from flux_trainer.launch.device import DeviceInfo
from flux_trainer.launch.supervise import run_supervised

RUN = Path("/runs/r1")
ARGS = ["--config", "/runs/r1/sd_scripts.toml", "--flag with space"]


def h100(count: int) -> DeviceInfo:
    return DeviceInfo(
        name="NVIDIA H100 80GB HBM3",
        index=0,
        capability=(9, 0),
        family="hopper",
        vram_gib=79.2,
        count=count,
        bf16=True,
        fp8=True,
        torch_version="2.8.0",
        torch_cuda="12.8",
    )


def run_cfg(**launcher):
    cfg = OmegaConf.structured(RunConfig)
    for key, value in launcher.items():
        cfg.launcher[key] = value
    return cfg


def build(cfg, info, config_path=RUN / "accelerate.json"):
    return launch_command(
        cfg, run_dir=RUN, accelerate_config_path=config_path, runner_args=ARGS, info=info, python="/venv/bin/python"
    )


def parsed(cmd: list[str]):
    """accelerate's own parser over our arguments: every flag must exist and the runner must be a module."""
    assert cmd[:3] == ["/venv/bin/python", "-m", "accelerate.commands.launch"]
    args = launch_command_parser().parse_args(cmd[3:])
    assert args.module and args.training_script == RUNNER_MODULE and args.training_script_args == ARGS
    return args


def loads_in_accelerate(config: dict, tmp_path: Path) -> ClusterConfig:
    (tmp_path / "a.json").write_text(json.dumps(config))
    (tmp_path / "a.yaml").write_text(yaml.safe_dump(config))
    from_yaml = ClusterConfig.from_yaml_file(str(tmp_path / "a.yaml"))  # rejects unknown keys
    assert ClusterConfig.from_json_file(str(tmp_path / "a.json")).to_dict() == from_yaml.to_dict()
    return from_yaml


def test_one_gpu(tmp_path):
    cfg, info = run_cfg(gpus=1), h100(1)
    config = accelerate_config(cfg, info)
    assert config["distributed_type"] == "NO" and config["num_processes"] == 1 and config["num_machines"] == 1
    assert config["mixed_precision"] == "bf16" and config["use_cpu"] is False and config["gpu_ids"] == "all"
    assert config["compute_environment"] == "LOCAL_MACHINE" and config["dynamo_config"] == {"dynamo_backend": "NO"}
    assert "main_process_ip" not in config
    assert loads_in_accelerate(config, tmp_path).num_processes == 1
    cmd = build(cfg, info)
    args = parsed(cmd)
    assert args.config_file == str(RUN / "accelerate.json") and args.num_cpu_threads_per_process == 2
    assert args.quiet and not args.multi_gpu and args.num_processes == 1
    assert cmd[-len(ARGS) - 2 :] == ["-m", RUNNER_MODULE, *ARGS]


def test_four_gpus(tmp_path):
    cfg, info = run_cfg(gpus=4, main_port=29555), h100(8)
    config = accelerate_config(cfg, info)
    assert config["distributed_type"] == "MULTI_GPU" and config["num_processes"] == 4
    assert config["main_process_port"] == 29555 and config["num_machines"] == 1
    loads_in_accelerate(config, tmp_path)
    args = parsed(build(cfg, info))
    assert args.multi_gpu and args.num_processes == 4 and args.main_process_port == 29555
    assert args.log_dir == str(RUN / "torchrun") and not args.quiet


def test_two_nodes_of_eight(tmp_path):
    cfg, info = run_cfg(gpus=8, nodes=2, node_rank=1, main_address="10.0.0.1"), h100(8)
    config = accelerate_config(cfg, info)
    assert config["num_processes"] == 16 and config["num_machines"] == 2 and config["machine_rank"] == 1
    assert config["main_process_ip"] == "10.0.0.1" and config["distributed_type"] == "MULTI_GPU"
    loaded = loads_in_accelerate(config, tmp_path)
    assert loaded.num_machines == 2 and loaded.main_process_ip == "10.0.0.1"
    args = parsed(build(cfg, info))
    assert (args.num_processes, args.num_machines, args.machine_rank) == (16, 2, 1)
    assert args.main_process_ip == "10.0.0.1" and args.multi_gpu


def test_cpu(tmp_path):
    cfg, info = run_cfg(), DeviceInfo.cpu(torch_version="2.13.0+cpu")
    cfg.precision.mixed = "no"
    config = accelerate_config(cfg, info)
    assert config["use_cpu"] is True and config["distributed_type"] == "NO" and config["num_processes"] == 1
    assert config["mixed_precision"] == "no"
    loads_in_accelerate(config, tmp_path)
    args = parsed(build(cfg, info))
    assert args.cpu and not args.multi_gpu


def test_gpus_all_is_every_visible_gpu():
    assert resolve_gpus(run_cfg(gpus="all"), h100(4)) == 4
    assert resolve_gpus(run_cfg(gpus="all"), DeviceInfo.cpu()) == 1


def test_more_gpus_than_visible_is_a_config_error():
    with pytest.raises(ConfigError, match=r"launcher.gpus=4 but only 2 GPUs visible.*launcher.gpus=2"):
        accelerate_config(run_cfg(gpus=4), h100(2))
    with pytest.raises(ConfigError, match="no CUDA GPU"):
        build(run_cfg(gpus=2), DeviceInfo.cpu())


def test_every_launcher_problem_is_reported_at_once():
    with pytest.raises(ConfigError) as err:
        accelerate_config(run_cfg(gpus=0, nodes=2, node_rank=5, main_port=70000), h100(1))
    problems = err.value.problems
    assert any("launcher.gpus=0" in p for p in problems)
    assert any("launcher.node_rank=5" in p for p in problems)
    assert any("launcher.main_address=127.0.0.1" in p for p in problems)  # multi-node needs a reachable address
    assert any("launcher.main_port=70000" in p for p in problems)


def test_bf16_on_a_card_without_it_is_a_config_error():
    t4 = DeviceInfo(
        name="Tesla T4", index=0, capability=(7, 5), family="older", vram_gib=14.6, count=1, bf16=False, fp8=False
    )
    with pytest.raises(ConfigError, match="precision.mixed=fp16"):
        accelerate_config(run_cfg(), t4)


def test_cpu_threads_override_reaches_the_command():
    cmd = launch_command(
        run_cfg(), run_dir=RUN, accelerate_config_path=RUN / "a.json", runner_args=[], info=h100(1), cpu_threads=7
    )
    assert cmd[cmd.index("--num_cpu_threads_per_process") + 1] == "7"
    assert cmd[0] == sys.executable


RECORDER = """
import json, os, sys
keys = ("ACCELERATE_USE_CPU", "ACCELERATE_MIXED_PRECISION", "OMP_NUM_THREADS", "FLUX_TEST_MARK")
print("RECORD " + json.dumps({"argv": sys.argv[1:], "env": {k: os.environ.get(k) for k in keys}}), flush=True)
sys.exit(int(os.environ.get("FLUX_TEST_EXIT", "0")))
"""


def stand_in_command(tmp_path, recorder: str, runner_args: list[str], mixed: str = "no") -> list[str]:
    """Our config and `accelerate launch` command for a CPU run (3 threads) of `fake_runner`, a stand-in runner
    module written into tmp_path with `recorder` as its code."""
    (tmp_path / "fake_runner.py").write_text(recorder)
    cfg = run_cfg(cpu_threads_per_process=3)
    cfg.precision.mixed = mixed
    info = DeviceInfo.cpu()
    (tmp_path / "accelerate.json").write_text(json.dumps(accelerate_config(cfg, info)))
    return launch_command(
        cfg,
        run_dir=tmp_path,
        accelerate_config_path=tmp_path / "accelerate.json",
        runner_args=runner_args,
        info=info,
        module="fake_runner",
    )


def test_the_command_really_launches_a_module_through_accelerate(tmp_path):
    """End to end on CPU: our config + command, accelerate 1.6 itself, a stand-in runner module."""
    cmd = stand_in_command(tmp_path, RECORDER, ["--a", "x; touch PWNED"])
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "FLUX_TEST_MARK": "m"}
    log = tmp_path / "train.log"
    assert run_supervised(cmd, env, log, cwd=tmp_path, echo=io.StringIO()) == 0
    record = json.loads(next(x for x in log.read_text().splitlines() if x.startswith("RECORD "))[7:])
    assert record["argv"] == ["--a", "x; touch PWNED"]
    assert record["env"] == {
        "ACCELERATE_USE_CPU": "True",
        "ACCELERATE_MIXED_PRECISION": "no",
        "OMP_NUM_THREADS": "3",
        "FLUX_TEST_MARK": "m",
    }
    # Known accelerate behaviour (simple launcher): a failing child's exit code becomes 1.
    env["FLUX_TEST_EXIT"] = "3"
    assert run_supervised(cmd, env, log, cwd=tmp_path, echo=io.StringIO()) == 1
    assert not (tmp_path / "PWNED").exists()
