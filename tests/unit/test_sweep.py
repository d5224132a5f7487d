"""`flux-train -m`: every member in its own run dir under one sweep dir, failed members reported without stopping
the others, a summary table and summary.json at the end. On CPU with dry_run=true, through `main()`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import tomli

import flux_trainer.app
from flux_trainer.cli import main
from flux_trainer.commands import sweep
from flux_trainer.commands import train as train_command


@pytest.fixture(autouse=True)
def quiet(monkeypatch):
    """No tracebacks unless a test asks (-v sets FLUX_TRAIN_VERBOSE for the process; this restores it)."""
    monkeypatch.setenv("FLUX_TRAIN_VERBOSE", "0")


def sweep_dirs(workdir: Path) -> list[Path]:
    root = workdir / "runs" / "sweeps"
    return sorted(p for p in root.iterdir() if p.is_dir()) if root.is_dir() else []


def the_summary(workdir: Path) -> tuple[Path, dict]:
    (sweep_dir,) = sweep_dirs(workdir)
    return sweep_dir, json.loads((sweep_dir / "summary.json").read_text())


def statuses(summary: dict) -> list[tuple[int, str, int | None]]:
    return [(r["member"], r["status"], r["exit_code"]) for r in summary["rows"]]


def network_dim(run_dir: Path) -> int:
    doc = tomli.loads((run_dir / "sd_scripts.toml").read_text())
    flat = {k: v for table in doc.values() for k, v in table.items()}
    assert flat["output_dir"] == str(run_dir)  # train() wrote into the run dir Hydra made for this member
    return flat["network_dim"]


def test_two_member_sweep_writes_two_run_dirs(workdir, capsys):
    assert main(["-m", "+dataset=mychar", "network.rank=8,16", "dry_run=true"]) == 0
    sweep_dir, summary = the_summary(workdir)
    runs = sorted(p for p in sweep_dir.iterdir() if p.is_dir() and not p.name.startswith("."))
    assert [p.name for p in runs] == ["0_mychar", "1_mychar"]
    assert [network_dim(run) for run in runs] == [8, 16]
    assert statuses(summary) == [(0, "ok", 0), (1, "ok", 0)]
    assert [r["overrides"] for r in summary["rows"]] == [["network.rank=8"], ["network.rank=16"]]
    assert [r["run_dir"] for r in summary["rows"]] == [str(run) for run in runs]
    out = capsys.readouterr().out
    assert "2 members, 2 ok, 0 failed" in out and "network.rank=16  ok" in out
    assert f"tensorboard --logdir {sweep_dir}" in out


def write_events(run_dir: Path, losses: list[float], step_s: float) -> None:
    from torch.utils.tensorboard import SummaryWriter

    with SummaryWriter(str(run_dir / "tb" / "network_train")) as writer:
        for step, loss in enumerate(losses, 1):
            writer.add_scalar("loss/current", loss, step)
            writer.add_scalar("time/step_s", step_s, step)


def test_failed_members_do_not_stop_the_others(workdir, capsys, monkeypatch):
    """rank 0: bad input (real validation); 8: training crashes; 16: training exits 3; 32: trains (events)."""
    real_train = flux_trainer.app.train
    calls = []

    def fake_train(cfg, run_dir, **kwargs):
        calls.append(cfg.network.rank)
        if cfg.network.rank == 8:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        code = real_train(cfg, run_dir, **kwargs)
        if cfg.network.rank == 16:
            return 3
        write_events(run_dir, [0.5, 0.25, 0.125], step_s=1.5)
        return code

    monkeypatch.setattr(flux_trainer.app, "train", fake_train)
    assert main(["-m", "+dataset=mychar", "network.rank=0,8,16,32", "dry_run=true"]) == 1
    assert calls == [0, 8, 16, 32]
    sweep_dir, summary = the_summary(workdir)
    assert statuses(summary) == [(0, "bad input", 2), (1, "failed", 1), (2, "failed", 3), (3, "ok", 0)]
    rows = summary["rows"]
    assert rows[0]["run_dir"] is None and not (sweep_dir / "0_mychar").exists()  # no run dir for bad input
    assert rows[1]["run_dir"] is None and "illegal memory access" in rows[1]["error"]
    assert rows[2]["run_dir"] == str(sweep_dir / "2_mychar") and "exited with 3" in rows[2]["error"]
    assert (rows[3]["last_loss"], rows[3]["median_step_s"], rows[3]["steps"]) == (0.125, 1.5, 3)
    assert summary["exit_code"] == 1 and (summary["ok"], summary["failed"]) == (1, 3)

    captured = capsys.readouterr()
    errors = [line for line in captured.err.splitlines() if line.startswith("flux-train: error:")]
    assert errors == [
        "flux-train: error: sweep member #0: network.rank=0: must be a positive integer (16 is a good start)",
        "flux-train: error: sweep member #1: CUDA error: an illegal memory access was encountered",
    ]
    assert "Traceback" not in captured.err
    table = captured.out[captured.out.index("4 members, 1 ok, 3 failed") :]
    assert "network.rank=32  ok" in table and "0.1250" in table and "1.500" in table
    assert "network.rank=0   bad input" in table and "#1: RuntimeError: CUDA error" in table


def test_only_bad_input_failures_exit_2_and_verbose_shows_the_traceback(workdir, capsys):
    assert main(["-v", "-m", "+dataset=mychar", "network.rank=0", "dry_run=true"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and "sweep member #0: network.rank=0" in err


def test_values_that_do_not_compose_stop_the_sweep_before_it_starts(workdir, capsys):
    assert main(["-m", "+dataset=mychar", "optimizer=adamw,sgdx", "network.rank=8,16", "dry_run=true"]) == 2
    err = capsys.readouterr().err
    assert "sweep member #2 (optimizer=sgdx network.rank=8): optimizer=sgdx: no such optimizer config" in err
    assert "adamw" in err and "Traceback" not in err and "#0" not in err
    assert main(["-m", "network.rank=8,16", "dry_run=true"]) == 2  # the same problem everywhere: said once
    err = capsys.readouterr().err
    assert err.count("+dataset=NAME") == 1 and "sweep member" not in err
    assert main(["-m", "+dataset=mychar", "network.rank=abc,16", "dry_run=true"]) == 2
    assert "network.rank=abc: must be an integer" in capsys.readouterr().err
    assert not (workdir / "runs").exists()


def test_ctrl_c_stops_the_sweep_and_still_summarises(workdir, capsys, monkeypatch):
    calls = []

    def interrupted(cfg, run_dir, **kwargs):
        calls.append(cfg.network.rank)
        raise KeyboardInterrupt

    monkeypatch.setattr(flux_trainer.app, "train", interrupted)
    assert main(["-m", "+dataset=mychar", "network.rank=8,16", "dry_run=true"]) == 130
    assert calls == [8]
    _, summary = the_summary(workdir)
    assert statuses(summary) == [(0, "interrupted", 130), (1, "not run", None)]


def test_a_launcher_that_dies_still_leaves_a_summary(workdir, capsys, monkeypatch):
    """A submitit job that dies (killed, out of memory) makes Hydra exit; its member has no record."""

    def dying_launcher(overrides, search_dirs):
        pinned = next(a for a in overrides if a.startswith("hydra.sweep.dir="))
        sweep_dir = Path(pinned.partition("=")[2].strip("'"))
        sweep.record_member(sweep_dir, 0, overrides=["network.rank=8"], run_dir=sweep_dir / "0_mychar", code=0)
        raise SystemExit(1)

    monkeypatch.setattr(train_command, "hydra_run", dying_launcher)
    assert main(["-m", "+dataset=mychar", "network.rank=8,16", "dry_run=true"]) == 1
    _, summary = the_summary(workdir)
    assert statuses(summary) == [(0, "ok", 0), (1, "no result", None)]
    assert ".submitit" in summary["rows"][1]["error"]
    assert "sweep launcher stopped" in capsys.readouterr().err


def test_a_launcher_preset_needs_a_sweep(workdir, capsys):
    assert main(["+dataset=mychar", "hydra/launcher=slurm", "dry_run=true"]) == 2
    assert "add -m" in capsys.readouterr().err
    assert main(["-m", "+dataset=mychar", "hydra/launcher=slurmm", "dry_run=true"]) == 2
    err = capsys.readouterr().err
    assert "hydra/launcher=slurmm: no such hydra/launcher config" in err and "basic" in err and "slurm" in err


def test_members_are_numbered_like_hydra():
    members, hydra_args = sweep.parse(["+dataset=mychar", "network.rank=8,16", "optimizer=adamw,prodigy", "hydra.a=1"])
    assert [m.varying for m in members] == [
        ("network.rank=8", "optimizer=adamw"),
        ("network.rank=8", "optimizer=prodigy"),
        ("network.rank=16", "optimizer=adamw"),
        ("network.rank=16", "optimizer=prodigy"),
    ]
    assert members[3].overrides == ("+dataset=mychar", "network.rank=16", "optimizer=prodigy")
    assert hydra_args == ["hydra.a=1"]
    assert [m.num for m in sweep.covering(members)] == [0, 1, 2]  # every swept value composed once


@pytest.mark.parametrize(
    "path", ["/tmp/plain/2026-01-01_10-00-00", "/tmp/with space, comma=and 'quote'", "C:\\runs\\x\\", "a\\'b"]
)
def test_the_pinned_sweep_dir_is_one_override_value(path):
    from hydra.core.override_parser.overrides_parser import OverridesParser

    override = OverridesParser.create().parse_override(f"hydra.sweep.dir={sweep.quote_override(path)}")
    assert not override.is_sweep_override() and override.value() == path


def test_a_sweep_over_a_musubi_tuner_model_writes_its_toml_per_member(workdir, capsys):
    """FLUX.2 klein trains on musubi-tuner (issue 61: sweeps on every model): each member's run dir holds
    musubi_tuner.toml with that member's value, and the summary is the same."""
    assert main(["-m", "+dataset=mychar", "model=flux2_klein_base_4b", "network.rank=8,16", "dry_run=true"]) == 0
    sweep_dir, summary = the_summary(workdir)
    runs = sorted(p for p in sweep_dir.iterdir() if p.is_dir() and not p.name.startswith("."))
    dims = []
    for run in runs:
        assert not (run / "sd_scripts.toml").exists()
        doc = tomli.loads((run / "musubi_tuner.toml").read_text())
        flat = {k: v for table in doc.values() for k, v in table.items()}
        assert flat["output_dir"] == str(run)
        dims.append(flat["network_dim"])
    assert dims == [8, 16]
    assert statuses(summary) == [(0, "ok", 0), (1, "ok", 0)]
