"""resume=auto: the newest complete saved state of the same output name, and finished runs say so."""

from __future__ import annotations

import json

from flux_trainer.sdscripts.resume import newest_state, resume_decision


def state(runs, run, name, step):
    d = runs / "mychar" / run / name
    d.mkdir(parents=True)
    (d / "train_state.json").write_text(json.dumps({"current_epoch": 1, "current_step": step}))
    return d


def test_newest_state_across_runs_by_step(tmp_path):
    state(tmp_path, "2026-01-01_10-00-00", "mychar-step00000250-state", 250)
    newest = state(tmp_path, "2026-01-02_10-00-00", "mychar-step00000500-state", 500)
    state(tmp_path, "2026-01-02_10-00-00", "mychar-step00000100-state", 100)
    broken = tmp_path / "mychar" / "2026-01-03_10-00-00" / "mychar-step00000750-state"
    broken.mkdir(parents=True)  # interrupted mid-save: no train_state.json
    state(tmp_path, "x", "other-step00009999-state", 9999).rename(tmp_path / "mychar" / "x" / "other-state")
    got = newest_state(tmp_path, "mychar")
    assert got.path == newest and got.step == 500 and not got.final


def test_decisions(tmp_path):
    d = resume_decision(tmp_path, "mychar", 1000)
    assert d.state is None and not d.finished and "starting fresh" in d.sentence
    state(tmp_path, "a", "mychar-step00000500-state", 500)
    d = resume_decision(tmp_path, "mychar", 1000)
    assert d.state.step == 500 and not d.finished and "from step 500" in d.sentence
    state(tmp_path, "b", "mychar-state", 1000)
    d = resume_decision(tmp_path, "mychar", 1000)
    assert d.state is None and d.finished and "already finished" in d.sentence and "train.max_steps" in d.sentence
    d = resume_decision(tmp_path, "mychar", 2000)
    assert d.state.step == 1000 and d.state.final
