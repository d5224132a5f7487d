"""The hydra/launcher presets for hydra-submitit-launcher: they compose, SLURM gets the sbatch lines we mean, and
a local submitit executor runs dry-run members in their own processes. Needs `pip install 'flux-trainer[slurm]'`
(hydra-submitit-launcher); skipped without it, except the message that says to install it."""

from __future__ import annotations

import importlib.util
import json
import os
import stat
from pathlib import Path

import pytest
import tomli

from flux_trainer.cli import main
from flux_trainer.commands import sweep

needs_plugin = pytest.mark.skipif(
    importlib.util.find_spec("hydra_plugins.hydra_submitit_launcher") is None,
    reason="needs hydra-submitit-launcher: pip install 'flux-trainer[slurm]'",
)


def hydra_node(workdir: Path, *overrides: str):
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from flux_trainer.config.compose import hydra_overrides, register
    from flux_trainer.config.paths import shipped_config_dir

    register()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(shipped_config_dir()), version_base="1.3"):
        extra = hydra_overrides([workdir / "configs"])
        return compose("config", overrides=["+dataset=mychar", *overrides, *extra], return_hydra_config=True).hydra


def executor_parameters(launcher) -> tuple[dict, dict]:
    """(init, update) parameters for submitit's AutoExecutor, derived as BaseSubmititLauncher.launch derives them."""
    from hydra.utils import instantiate
    from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf
    from omegaconf import OmegaConf

    instance = instantiate(launcher)  # the plugin's own class takes our keys
    params = dict(instance.params)
    executor = instance._EXECUTOR
    init = {"folder": params.pop("submitit_folder"), f"{executor}_max_num_timeout": params.pop("max_num_timeout", 0)}
    base = set(OmegaConf.structured(BaseQueueConf).keys())
    return init, {k if k in base else f"{executor}_{k}": v for k, v in params.items()}


@needs_plugin
def test_slurm_preset_composes_into_the_sbatch_script_we_mean(workdir, tmp_path, monkeypatch):
    hydra = hydra_node(
        workdir, "hydra/launcher=slurm", "hydra.launcher.partition=gpu", "hydra.launcher.gpus_per_node=2"
    )
    launcher = hydra.launcher
    assert launcher._target_.endswith("SlurmLauncher")
    assert (launcher.partition, launcher.gpus_per_node, launcher.tasks_per_node) == ("gpu", 2, 1)
    assert (launcher.timeout_min, launcher.mem_gb, launcher.cpus_per_task, launcher.nodes) == (240, 64, 8, 1)

    import submitit

    fake = tmp_path / "bin"  # submitit's SLURM executor insists on finding srun; nothing is submitted here
    fake.mkdir()
    (fake / "srun").write_text("#!/bin/sh\nexit 1\n")
    (fake / "srun").chmod(stat.S_IRWXU)
    monkeypatch.setenv("PATH", f"{fake}{os.pathsep}{os.environ.get('PATH', '')}")
    init, update = executor_parameters(launcher)
    init["folder"] = str(tmp_path / "submitit")
    executor = submitit.AutoExecutor(cluster="slurm", **init)
    executor.update_parameters(**update)  # rejects any key submitit does not know
    script = executor._executor._make_submission_file_text("python -u -m submitit.core._submit x", "uid")
    for line in (
        "--partition=gpu",
        "--gpus-per-node=2",
        "--ntasks-per-node=1",
        "--cpus-per-task=8",
        "--time=240",
        "--mem=64GB",
        "--nodes=1",
        "--job-name=flux-train",
    ):
        assert f"#SBATCH {line}\n" in script, line


@needs_plugin
def test_local_submitit_preset_composes(workdir):
    launcher = hydra_node(workdir, "hydra/launcher=local_submitit").launcher
    assert launcher._target_.endswith("submitit_launcher.LocalLauncher")
    assert (launcher.gpus_per_node, launcher.tasks_per_node, launcher.nodes) == (1, 1, 1)


@needs_plugin
def test_a_misspelt_launcher_key_is_bad_input(workdir, capsys):
    assert main(["-m", "+dataset=mychar", "hydra/launcher=slurm", "hydra.launcher.partion=gpu", "dry_run=true"]) == 2
    assert "hydra.launcher.partion" in capsys.readouterr().err
    assert not (workdir / "runs").exists()


def test_without_the_plugin_the_error_says_what_to_install(workdir, capsys, monkeypatch):
    monkeypatch.setattr(sweep, "SUBMITIT_PLUGIN", "hydra_plugins.not_installed_here")
    assert main(["-m", "+dataset=mychar", "hydra/launcher=slurm", "dry_run=true"]) == 2
    err = capsys.readouterr().err
    assert "hydra-submitit-launcher" in err and "pip install 'flux-trainer[slurm]'" in err
    assert not (workdir / "runs").exists()


@needs_plugin
def test_local_submitit_executor_runs_dry_run_members(workdir, capsys, monkeypatch):
    """Two members as submitit jobs (own processes): one bad value, one dry run; the summary joins both."""
    monkeypatch.setenv("FLUX_TRAIN_VERBOSE", "0")
    argv = ["-m", "+dataset=mychar", "hydra/launcher=local_submitit", "hydra.launcher.gpus_per_node=0"]
    assert main([*argv, "hydra.launcher.timeout_min=5", "network.rank=0,8", "dry_run=true"]) == 2
    (sweep_dir,) = (workdir / "runs" / "sweeps").iterdir()
    summary = json.loads((sweep_dir / "summary.json").read_text())
    assert [(r["member"], r["status"], r["exit_code"]) for r in summary["rows"]] == [(0, "bad input", 2), (1, "ok", 0)]
    assert "network.rank=0" in summary["rows"][0]["error"]
    run = sweep_dir / "1_mychar"
    assert summary["rows"][1]["run_dir"] == str(run) and (run / "command.txt").is_file()
    flat = {k: v for t in tomli.loads((run / "sd_scripts.toml").read_text()).values() for k, v in t.items()}
    assert (flat["network_dim"], flat["output_dir"]) == (8, str(run))
    # they ran as submitit jobs: one result pickle and one log per member
    assert len(list((sweep_dir / ".submitit").glob("*/*_result.pkl"))) == 2
    logs = "".join(p.read_text() for p in (sweep_dir / ".submitit").glob("*/*_log.*"))
    assert "dry_run=true" in logs and "sweep member #0: network.rank=0" in logs and "Traceback" not in logs
    assert "2 members, 1 ok, 1 failed" in capsys.readouterr().out
