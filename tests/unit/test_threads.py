"""sd-scripts loads (and on an fp8 base casts) the base model on the CPU with this process's share of the cores
(threads.cpu_share), then the training setting comes back."""

from __future__ import annotations

import logging
import os
from types import SimpleNamespace

import pytest
import torch

from flux_trainer.sdscripts import runner
from flux_trainer.sdscripts import threads as start_threads


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield before
    torch.set_num_threads(before)


@pytest.mark.parametrize(("cores", "local", "want"), [(8, None, 8), (8, "2", 4), (16, "4", 4), (1, None, None)])
def test_the_share_is_the_cores_divided_among_the_nodes_processes(monkeypatch, threads, caplog, cores, local, want):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: cores)
    if local is None:
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", local)
    want = want or threads  # fewer cores than the setting: never lowered
    with (
        caplog.at_level(logging.INFO, logger="flux_trainer.runner"),
        start_threads.cpu_share("loading the base model") as share,
    ):
        assert share == want == torch.get_num_threads()
    assert torch.get_num_threads() == threads  # training's setting back
    assert (f"loading the base model with {want} CPU threads" in caplog.text) == (want > threads)


def test_the_setting_comes_back_when_loading_fails(monkeypatch, threads):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(threads + 3)), raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    with pytest.raises(OSError), start_threads.cpu_share("loading the base model"):
        assert torch.get_num_threads() == threads + 3
        raise OSError("the checkpoint is truncated")
    assert torch.get_num_threads() == threads


def test_the_runner_loads_sd_scripts_model_inside_it(monkeypatch, tmp_path, threads):
    """Through the runner's trainer class on sd-scripts' own FluxNetworkTrainer (its loader replaced by a recorder)."""
    from flux_trainer.sdscripts import checkout as sd_checkout

    try:
        mods = sd_checkout.import_sd_scripts(sd_checkout.locate(None).path)
    except Exception as e:  # noqa: BLE001 - not found, or not importable here
        pytest.skip(f"sd-scripts not importable: {e}")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(threads + 2)), raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    seen = []

    def load(self, args, weight_dtype, accelerator):
        seen.append(torch.get_num_threads())
        return "version", ["clip_l", "t5xxl"], "ae", "flux"

    monkeypatch.setattr(mods.flux_train_network.FluxNetworkTrainer, "load_target_model", load)
    spec = runner.RunnerSpec(sd_scripts="", train_toml="", dataset_toml="")
    trainer = runner.make_trainer_class(mods, spec, tmp_path)()
    assert trainer.load_target_model(SimpleNamespace(), torch.bfloat16, None)[3] == "flux"
    assert seen == [threads + 2] and torch.get_num_threads() == threads
