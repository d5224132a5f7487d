"""Every refusal of bad input: one line naming what and the fix, exit 2, no traceback, and nothing made (no run dir,
no runs root, no folder outside it). Run dirs are one run's each, and an output name has one live run."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from flux_trainer.cli import main
from flux_trainer.config import ConfigError
from flux_trainer.launch import rundir
from tests.conftest import undoing

CASES = {
    "override syntax": (['train.output_name=a"b'], ["cannot read the override", "quoting"]),
    "unknown key": (["network.rnak=8"], ["network.rnak: no such key; did you mean network.rank?"]),
    "unknown added key": (["+network.rnak=8"], ["network.rnak: no such key; did you mean network.rank?"]),
    "unknown top key": (["foo=1"], ["foo: no such key", "top-level keys"]),
    "typo in a section": (["netwrk.rank=3"], ["did you mean network.rank?"]),
    "add an existing key": (["+network.rank=3"], ["set it without the '+'"]),
    "wrong type": (["network.rank=abc"], ["network.rank=abc: must be an integer"]),
    "unknown option": (["memory=vram99"], ["memory=vram99: no such memory config", "vram24"]),
    "path in output_name": (["train.output_name=../../x"], ["a plain name is needed", "no '..'"]),
    "slash in output_name": (["train.output_name=a/b"], ["a plain name is needed"]),
    "control char in output_name": (["train.output_name=a\tb"], ["a plain name is needed"]),
    "bad value": (["network.rank=-1"], ["network.rank=-1: must be a positive integer"]),
    "batch over the dataset": (["train.batch_size=100000"], ["larger than dataset 'mychar' (3 images)"]),
    "interpolation to no key": (["train.output_name=${oops}"], ["train.output_name: Interpolation key 'oops'"]),
    "unset environment variable": (
        ["network.rank=${oc.env:FLUX_TRAIN_NO_SUCH_VAR}"],
        ["network.rank:", "FLUX_TRAIN_NO_SUCH_VAR"],
    ),
    "unknown resolver": (["train.output_name=${nope:1}"], ["train.output_name:", "nope"]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_refused_in_one_line_with_nothing_made(name, workdir, capsys):
    overrides, wanted = CASES[name]
    before = set(os.listdir(workdir.parent))
    code = main(["+dataset=mychar", *overrides, "dry_run=true"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("flux-train: error: ") and len(err.strip().splitlines()) == 1, err
    assert "Traceback" not in err and all(w in err for w in wanted), err
    assert not (workdir / "runs").exists()
    assert set(os.listdir(workdir.parent)) == before  # nothing beside the working dir either ('../../x')


def test_empty_and_unknown_datasets_list_the_ones_there_are(workdir, capsys):
    assert main(["+dataset=", "dry_run=true"]) == 2
    err = capsys.readouterr().err
    assert "dataset=: no option named; choose one of: mychar" in err and "dataset init" in err
    assert main(["+dataset=mychr", "dry_run=true"]) == 2
    assert "dataset=mychr: no such dataset config; choose one of: mychar" in capsys.readouterr().err
    assert not (workdir / "runs").exists()


def test_dataset_yaml_syntax_errors_name_the_file_and_line(workdir, capsys):
    path = workdir / "configs" / "dataset" / "broken.yaml"
    path.write_text("name: broken\nimages: [unclosed\ntrigger: x\n")
    assert main(["+dataset=broken", "dry_run=true"]) == 2
    err = capsys.readouterr().err
    assert f"{path}:3: YAML syntax error" in err and "Traceback" not in err
    assert not (workdir / "runs").exists()


def test_a_dataset_yaml_without_images_names_the_file_and_key(workdir, capsys):
    path = workdir / "configs" / "dataset" / "noimg.yaml"
    path.write_text("name: noimg\ntrigger: x\n")
    assert main(["+dataset=noimg", "dry_run=true"]) == 2
    err = capsys.readouterr().err
    assert f"the dataset file is missing images in {path}: add images:" in err
    assert not (workdir / "runs").exists()


def test_a_refusal_after_the_run_dir_was_made_leaves_nothing(workdir, capsys, monkeypatch):
    """A check that fails once the run dir exists (here sd-scripts' own parser, faked): the dir, its output_name
    folder and the runs root go, as when nothing was made."""
    from flux_trainer import app

    def refuse(*a, **k):
        raise ConfigError("refused late")

    monkeypatch.setattr(app, "translate", refuse)
    assert main(["+dataset=mychar", "dry_run=true"]) == 2
    assert "refused late" in capsys.readouterr().err
    assert not (workdir / "runs").exists()


def test_two_runs_in_the_same_second_get_their_own_run_dirs(tmp_path):
    first = rundir.claim_run_dir(tmp_path / "runs" / "mine" / "2026-11-28_10-00-00")
    second = rundir.claim_run_dir(tmp_path / "runs" / "mine" / "2026-11-28_10-00-00")
    assert first.name == "2026-11-28_10-00-00" and second.name == "2026-11-28_10-00-00-2"
    assert (first / rundir.RUN_RECORD).is_file() and (second / rundir.RUN_RECORD).is_file()


def test_a_second_live_run_of_a_name_is_told_which_run_holds_it(tmp_path):
    folder = tmp_path / "runs" / "mine"
    run = rundir.claim_run_dir(folder / "2026-11-28_10-00-00")
    lock = rundir.lock_output(folder)
    with undoing(lock.release):
        assert rundir.is_locked(folder)
        with pytest.raises(ConfigError) as info:
            rundir.lock_output(folder)
        text = str(info.value)
        assert "is being trained by a live run" in text and str(run) in text and f"pid {os.getpid()}" in text
        assert "train.output_name=mine_2" in text
    assert not rundir.is_locked(folder)
    rundir.lock_output(folder).release()


def test_the_lock_outlives_a_killed_parent_while_its_child_runs(tmp_path):
    """The training child holds the name's lock too (passed to it): a parent killed with SIGKILL does not free the
    name while the child still trains."""
    folder = tmp_path / "mine"
    script = textwrap.dedent(
        f"""
        import subprocess, sys, time
        from pathlib import Path
        from flux_trainer.launch import rundir
        lock = rundir.lock_output(Path({str(folder)!r}))
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], pass_fds=(lock.fd,))
        print(child.pid, flush=True)
        time.sleep(30)
        """
    )
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    child_pid = int(parent.stdout.readline())
    parent.kill()
    parent.wait()
    assert rundir.is_locked(folder)
    os.kill(child_pid, 9)
    for _ in range(100):
        try:
            os.waitpid(child_pid, os.WNOHANG)
        except ChildProcessError:
            pass
        if not rundir.is_locked(folder):
            break
        import time

        time.sleep(0.05)
    assert not rundir.is_locked(folder)


@pytest.mark.parametrize(
    ("flag", "overrides", "wanted"),
    [
        (["--cfg", "job"], ["foo=1"], "foo: no such key"),
        (["--info"], ["network.rnak=3"], "did you mean network.rank?"),
        (["--cfg", "job", "--resolve"], ["train.output_name=${oops}"], "Interpolation key 'oops'"),
        (["-c", "job"], ["+dataset=nope"], "dataset=nope: no such dataset config"),
    ],
)
def test_hydras_flags_refuse_bad_overrides_in_one_line(workdir, capsys, flag, overrides, wanted):
    assert main(["+dataset=mychar", *overrides, *flag]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and wanted in err and "Traceback" not in err, err


def test_hydra_help_and_version_ignore_the_runs_overrides(workdir, capsys):
    """--hydra-help shows Hydra's help whatever else is on the line (Hydra alone would fail to compose group
    overrides against its own defaults list)."""
    assert main(["+dataset=mychar", "model=random_tiny", "train.max_steps=2", "--hydra-help"]) == 0
    assert "Hydra" in capsys.readouterr().out
    assert main(["model=random_tiny", "--version"]) == 0
    assert "Hydra" in capsys.readouterr().out
