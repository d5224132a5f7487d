"""The `flux-train` command as a user runs it: dry runs, bad input, help, dataset init, the installed wheel."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tomli

from flux_trainer.cli import main
from flux_trainer.sdscripts.runner import RunnerSpec
from tests.conftest import make_images, write_dataset


def run_dirs(workdir: Path) -> list[Path]:
    return sorted(p for p in (workdir / "runs").glob("*/*") if p.is_dir()) if (workdir / "runs").exists() else []


def test_dry_run_writes_the_run_dir(workdir, capsys):
    assert main(["+dataset=mychar", "dry_run=true", "network.rank=32", "optimizer=adamw", "train.max_steps=2000"]) == 0
    (run,) = run_dirs(workdir)
    assert run.parent.name == "mychar"
    for name in ("config.yaml", "sd_scripts.toml", "dataset.toml", "command.txt", "env.json", "accelerate.yaml"):
        assert (run / name).is_file(), name
    flat = {k: v for t in tomli.loads((run / "sd_scripts.toml").read_text()).values() for k, v in t.items()}
    assert (flat["network_dim"], flat["optimizer_type"], flat["max_train_steps"]) == (32, "AdamW", 2000)
    assert flat["output_dir"] == str(run)
    assert RunnerSpec.read(run).pin_memory is True  # train.pin_memory's default reaches the training process
    assert Path(flat["pretrained_model_name_or_path"]).is_absolute()
    command = (run / "command.txt").read_text()
    assert "accelerate.commands.launch" in command and "flux_trainer.sdscripts.runner" in command
    assert str(run / "accelerate.yaml") in command
    dataset = tomli.loads((run / "dataset.toml").read_text())
    staged = Path(dataset["datasets"][0]["subsets"][0]["image_dir"])  # the folder's staged copy in the cache
    assert staged.parent == workdir / "cache" / "datasets" and staged.name.startswith("mychar-")
    assert sorted(p.resolve() for p in staged.glob("*.png")) == sorted((workdir / "pics" / "mychar").glob("*.png"))
    out = capsys.readouterr().out
    assert "dry_run=true" in out and str(run) in out


def test_pin_memory_off_reaches_the_runner(workdir):
    assert main(["+dataset=mychar", "dry_run=true", "train.pin_memory=false"]) == 0
    (run,) = run_dirs(workdir)
    assert RunnerSpec.read(run).pin_memory is False
    assert RunnerSpec.read(run).staged_copy is True  # train.staged_copy's default


def test_staged_copy_off_reaches_the_runner(workdir):
    assert main(["+dataset=mychar", "dry_run=true", "train.staged_copy=false"]) == 0
    (run,) = run_dirs(workdir)
    assert RunnerSpec.read(run).staged_copy is False


@pytest.mark.parametrize("key", ["kernels.combo_kernels", "kernels.offload_views"])
def test_a_removed_key_is_accepted_with_one_line_and_ignored(workdir, capsys, key):
    """Keys removed for a nil measured effect keep working for one release: one warning naming the key, why and what
    to do; the run goes on as without it (nothing of it reaches the training process)."""
    assert main(["+dataset=mychar", "dry_run=true", f"{key}=true"]) == 0
    said = [ln for ln in capsys.readouterr().out.splitlines() if key in ln]
    assert len(said) == 1 and "is removed and ignored" in said[0] and "drop it" in said[0], said
    (run,) = run_dirs(workdir)
    kernels = RunnerSpec.read(run).kernels
    assert set(kernels) == {"set", "cuda_graphs", "cuda_graphs_asked", "fp8_keep_transposed"}
    assert main(["+dataset=mychar", "dry_run=true", "train.output_name=b"]) == 0
    assert "is removed" not in capsys.readouterr().out  # unset: no word of it


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (
            ["memory=vram48", "hardware=l40s"],
            {"checkpoint_skip": "auto", "tier_gib": 48.0, "blocked": None, "max_image_tokens": 512 * 512 // 256},
        ),
        (
            ["memory=vram32", "memory.checkpoint_skip=12", "dataset.resolution=1024", "hardware=rtx5090"],
            {"checkpoint_skip": "12", "tier_gib": 32.0, "blocked": None, "max_image_tokens": 4096},
        ),
        (
            ["memory=vram24", "hardware.family=ada"],
            {"checkpoint_skip": "auto", "tier_gib": 24.0, "blocked": None, "max_image_tokens": 1024},  # fp8 base too
        ),
        (
            ["memory=vram12", "hardware.family=ada"],
            {"checkpoint_skip": "0", "tier_gib": 12.0, "blocked": "memory.blocks_to_swap", "max_image_tokens": 1024},
        ),
        (["memory=vram80"], {"checkpoint_skip": "0"}),  # no gradient checkpointing: nothing to skip
    ],
)
def test_checkpoint_skip_reaches_the_runner(workdir, args, expected):
    assert main(["+dataset=mychar", "dry_run=true", *args]) == 0
    (run,) = run_dirs(workdir)
    got = RunnerSpec.read(run).memory
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        assert got[key] == value if key != "blocked" or value is None else value in got[key], (key, got)


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["memory.checkpoint_skip=half"], "choose auto or a number of blocks"),
        (["memory=vram16", "memory.checkpoint_skip=4"], "memory.checkpoint_skip=4 keeps activations on the GPU"),
    ],
)
def test_checkpoint_skip_bad_values_stop_before_a_run_dir(workdir, capsys, args, needle):
    assert main(["+dataset=mychar", "dry_run=true", *args]) == 2
    assert needle in capsys.readouterr().err and not run_dirs(workdir)


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["dry_run=true"], "+dataset=NAME"),
        (["+dataset=nope", "dry_run=true"], "mychar"),
        (["+dataset=mychar", "dataset.resolution=1000", "dry_run=true"], "multiple of 16"),
        (["+dataset=mychar", "network.rank=0", "dry_run=true"], "network.rank=0"),
        (["+dataset=mychar", "optimizer=sgdx", "dry_run=true"], "prodigy"),
        (["+dataset=mychar", "network.rnk=3", "dry_run=true"], "rnk"),
        (["+dataset=mychar", "precision=fp8_base", "hardware.family=older", "dry_run=true"], "fp8"),
        (["+dataset=mychar", "memory.blocks_to_swap=2", "memory.cpu_offload_checkpointing=true"], "cannot be combined"),
        (["+dataset=mychar"], "does not exist"),  # model files missing outside dry_run
    ],
)
def test_bad_input_exit_2_one_line_no_run_dir(args, needle, workdir, capsys):
    assert main(args) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err
    assert err.startswith("flux-train: error:")
    assert run_dirs(workdir) == []


def test_missing_or_empty_dataset_folder(workdir, capsys):
    write_dataset(workdir / "configs", "gone", workdir / "nothing-here")
    assert main(["+dataset=gone", "dry_run=true"]) == 2
    assert "does not exist" in capsys.readouterr().err
    (workdir / "blank").mkdir()
    write_dataset(workdir / "configs", "blank", workdir / "blank")
    assert main(["+dataset=blank", "dry_run=true"]) == 2
    assert "has no images" in capsys.readouterr().err
    assert run_dirs(workdir) == []


def test_verbose_shows_the_traceback(workdir, capsys, monkeypatch):
    monkeypatch.delenv("FLUX_TRAIN_VERBOSE", raising=False)
    assert main(["-v", "+dataset=mychar", "network.rank=0", "dry_run=true"]) == 2
    assert "Traceback" in capsys.readouterr().err
    monkeypatch.delenv("FLUX_TRAIN_VERBOSE", raising=False)


def test_help_names_groups_and_examples(workdir, capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for word in ("model", "optimizer", "memory", "prodigy", "adamw8bit", "+dataset=mychar", "mychar"):
        assert word in out


def test_dataset_init_writes_a_config_that_trains(workdir, capsys):
    pics = make_images(workdir / "newpics", n=4)
    (pics / "broken.png").write_bytes(b"not an image")
    assert main(["dataset", "init", "newset", "--images", str(pics)]) == 2
    err = capsys.readouterr().err
    assert f"{pics / 'broken.png'}: not an image" in err and "fix or remove" in err
    (pics / "broken.png").unlink()
    assert main(["dataset", "init", "newset", "--images", str(pics), "--trigger", "zxq", "--resolution", "768"]) == 0
    out = capsys.readouterr().out
    assert "4 images (4 png)" in out and "4 found, 0 missing" in out and "96x64" in out
    cfg_file = workdir / "configs" / "dataset" / "newset.yaml"
    assert cfg_file.is_file()
    assert main(["dataset", "init", "newset", "--images", str(pics)]) == 2
    assert "--force" in capsys.readouterr().err
    assert main(["+dataset=newset", "dry_run=true"]) == 0
    (run,) = run_dirs(workdir)
    assert tomli.loads((run / "dataset.toml").read_text())["datasets"][0]["resolution"] == 768


@pytest.mark.parametrize("case", ["missing", "empty", "uncaptioned"])
def test_dataset_init_refuses(case, workdir, capsys):
    folder = workdir / case
    if case == "empty":
        folder.mkdir()
    if case == "uncaptioned":
        make_images(folder, captions=False)
    assert main(["dataset", "init", case, "--images", str(folder)]) == 2
    err = capsys.readouterr().err
    assert {"missing": "no such folder", "empty": "no images", "uncaptioned": "--trigger"}[case] in err
    assert not (workdir / "configs" / "dataset" / f"{case}.yaml").exists()


@pytest.mark.skipif(shutil.which("flux-train") is None, reason="needs the installed `flux-train` console script")
def test_installed_console_script_finds_user_dataset_outside_checkout(workdir):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        ["flux-train", "+dataset=mychar", "dry_run=true"],
        cwd=workdir,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert len(run_dirs(workdir)) == 1
    # the package that ran is the installed one, not this checkout's source (unless installed editable)
    where = subprocess.run(
        [sys.executable, "-c", "import flux_trainer.config.paths as p; print(p.shipped_config_dir())"],
        cwd=workdir,
        env=env,
        capture_output=True,
        text=True,
    )
    assert (Path(where.stdout.strip()) / "config.yaml").is_file()


def test_memory_auto_keeps_the_users_memory_keys(compose):
    from flux_trainer.config.tiers import resolve_memory
    from tests.cards import H200

    h200 = H200
    cfg = compose("+dataset=mychar")
    resolve_memory(cfg, h200)
    assert (cfg.memory.tier, cfg.memory.gradient_checkpointing) == ("vram80", False)
    cfg = compose("+dataset=mychar", "memory.blocks_to_swap=4")
    resolve_memory(cfg, h200)
    assert (cfg.memory.tier, cfg.memory.blocks_to_swap, cfg.memory.gradient_checkpointing) == ("vram80", 4, False)
