"""launcher.direct: a single-process run started with the environment accelerate's own launcher would give it."""

from __future__ import annotations

import io
import json
import os
import sys

import pytest

from flux_trainer.launch.command import accelerate_config
from flux_trainer.launch.direct import direct_command
from flux_trainer.launch.supervise import run_supervised
from tests.unit.test_launch_command import build, h100, run_cfg, stand_in_command

RECORDER = """
import json, os, sys
print("RECORD " + json.dumps({"argv": sys.argv, "env": dict(os.environ)}), flush=True)
sys.exit(int(os.environ.get("FLUX_TEST_EXIT", "0")))
"""


def record(log) -> dict:
    return json.loads(next(x for x in log.read_text().splitlines() if x.startswith("RECORD "))[7:])


@pytest.mark.parametrize("mixed", ["no", "bf16"])
def test_the_child_gets_what_accelerate_launch_gives_it(tmp_path, mixed):
    """The same command both ways, a stand-in runner module recording its argv and whole environment: accelerate's
    own launcher process, then direct_command's. The child sees the same."""
    cmd = stand_in_command(tmp_path, RECORDER, ["--run-dir", "x y"], mixed=mixed)
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "FLUX_TEST_MARK": "m", "OMP_NUM_THREADS": "7"}
    via_accelerate, direct = tmp_path / "a.log", tmp_path / "d.log"
    assert run_supervised(cmd, env, via_accelerate, cwd=tmp_path, echo=io.StringIO()) == 0
    child = direct_command(cmd, env)
    assert child is not None
    child_cmd, child_env = child
    assert child_cmd == [sys.executable, "-m", "fake_runner", "--run-dir", "x y"]
    assert run_supervised(child_cmd, child_env, direct, cwd=tmp_path, echo=io.StringIO()) == 0
    want, got = record(via_accelerate), record(direct)
    assert got["argv"][1:] == want["argv"][1:] == ["--run-dir", "x y"]
    assert got["env"] == want["env"]
    assert got["env"]["ACCELERATE_MIXED_PRECISION"] == mixed and got["env"]["OMP_NUM_THREADS"] == "3"
    assert os.environ.get("FLUX_TEST_MARK") is None  # the launcher's own environment is left as it was
    # the training process's own exit code now reaches the launcher (accelerate's simple launcher turned it into 1)
    assert run_supervised(child_cmd, {**child_env, "FLUX_TEST_EXIT": "3"}, direct, echo=io.StringIO()) == 3


def test_several_processes_keep_accelerate_launch():
    cmd = build(run_cfg(gpus=2), h100(2))
    assert "--multi_gpu" in cmd and direct_command(cmd, dict(os.environ)) is None


def test_one_gpu_is_direct_and_anything_else_is_not(tmp_path):
    cfg = run_cfg()
    (tmp_path / "accelerate.json").write_text(json.dumps(accelerate_config(cfg, h100(1))))
    cmd = build(cfg, h100(1), config_path=tmp_path / "accelerate.json")
    child_cmd, child_env = direct_command(cmd, {"PATH": "/usr/bin"})
    assert child_cmd[:3] == ["/venv/bin/python", "-m", "flux_trainer.sdscripts.runner"]
    assert child_env["ACCELERATE_MIXED_PRECISION"] == "bf16" and child_env["PATH"] == "/usr/bin"
    assert direct_command(["python", "-m", "flux_trainer.sdscripts.runner", "--run-dir", "r"], {}) is None
    # a command accelerate itself refuses stays accelerate's, which then says why
    bad = [*cmd[:3], "--config_file", str(tmp_path / "missing.yaml"), *cmd[5:]]
    assert direct_command(bad, dict(os.environ)) is None
