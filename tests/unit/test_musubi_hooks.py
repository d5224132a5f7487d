"""The musubi runner's hooks: our tags once per optimizer step (a micro-batch of gradient accumulation gets none),
the progress line, and a script's parser taken from its main() without running it."""

from __future__ import annotations

import argparse
import io
import json
from types import SimpleNamespace

import pytest

from flux_trainer.backend.parser_schema import describe_parser, parser_of
from flux_trainer.metrics import progress
from flux_trainer.musubi.hooks import MusubiHooks


class FakeAccelerator:
    device = "cpu"
    is_main_process = True
    num_processes = 1
    trackers = ["tensorboard"]

    def get_tracker(self, name, unwrap=True):
        raise ValueError("no tracker here")


def test_tags_once_per_optimizer_step_and_a_progress_line(tmp_path, monkeypatch):
    lines = io.StringIO()
    monkeypatch.setattr(progress, "_channel", lines)
    hooks = MusubiHooks({"enabled": True, "images_per_step": 1}, tmp_path, max_steps=2)
    acc = FakeAccelerator()
    hooks.train_start(SimpleNamespace(gradient_accumulation_steps=2), acc)
    seen = []
    for micro in range(4):  # two optimizer steps of two micro-batches
        hooks.batch_arrived()
        sync = micro % 2 == 1
        hooks.step_done(acc, sync, micro // 2)  # musubi-tuner's global_step before it counts this step
        seen.append(hooks.step_logs(acc, {"loss/current": 0.5 + micro}))
    assert [bool(t) for t in seen] == [False, True, False, True]
    assert {"time/step_s", "vram/peak_gib", "throughput/images_per_s"} <= set(seen[1]) | set(seen[3])
    records = [json.loads(x.removeprefix(progress.PROGRESS)) for x in lines.getvalue().splitlines()]
    steps = [r for r in records if "step" in r]
    assert [(r["step"], r["total"], r["loss"]) for r in steps] == [(1, 2, 1.5), (2, 2, 3.5)]
    assert records[0] == {"phase": "training"}


def test_parser_of_takes_the_parser_main_builds_and_runs_nothing_else():
    ran, original = [], argparse.ArgumentParser.parse_args

    def main():
        p = argparse.ArgumentParser()
        p.add_argument("--vae", type=str)
        p.add_argument("--skip_existing", action="store_true")
        p.parse_args()
        ran.append("past parse_args")

    flags = describe_parser(parser_of(main))
    assert flags["vae"]["kind"] == "str" and flags["skip_existing"]["kind"] == "bool" and not ran
    assert argparse.ArgumentParser.parse_args is original  # put back
    with pytest.raises(RuntimeError, match="built no parser"):
        parser_of(lambda: None)
