"""Synthetic runs written like sd-scripts + our texts/HParams, read back with TensorBoard's own reader."""

import pytest
from torch.utils.tensorboard import SummaryWriter

from flux_trainer.metrics.tensorboard import (
    flatten_config,
    list_runs,
    read_hparams,
    read_scalars,
    read_texts,
    summarize_run,
    write_hparams,
    write_run_text,
)

CONFIG_YAML = "# resolved config\nnetwork:\n  rank: 16\n"


def fake_sd_scripts_run(logdir, steps, loss0=1.0, step_s=0.5, peak=20.0, loss_tags=("loss/current", "loss/average")):
    """What accelerate's TensorBoard tracker writes for sd-scripts, plus our per-step tags."""
    with SummaryWriter(str(logdir)) as w:
        for s in range(1, steps + 1):
            for tag in loss_tags:
                w.add_scalar(tag, loss0 / s, s)
            w.add_scalar("lr/unet", 1e-4, s)
            w.add_scalar("time/step_s", step_s + 0.01 * (s % 3), s)
            w.add_scalar("vram/peak_gib", peak + (s == 2), s)
            w.add_scalar("throughput/tflops", 250.0, s)


def test_scalars_texts_hparams_round_trip(tmp_path):
    logdir = tmp_path / "logs" / "20261121" / "network_train"
    fake_sd_scripts_run(logdir, steps=4)
    write_run_text(logdir, {"config": CONFIG_YAML, "command": "accelerate launch \\\n  -m x", "gpu": "NVIDIA H200"})
    config = {"network": {"rank": 16, "alpha": 16.0, "args": ["train_blocks=all"]}, "bf16": True, "seed": None}
    write_hparams(logdir, config, {"loss/average": None, "summary/final_loss": 0.25})

    scalars = read_scalars(logdir)
    assert {"loss/current", "loss/average", "lr/unet", "time/step_s", "vram/peak_gib", "summary/final_loss"} <= set(
        scalars
    )
    assert scalars["loss/current"] == [(1, 1.0), (2, 0.5), (3, pytest.approx(1 / 3)), (4, 0.25)]
    assert [s for s, _ in scalars["vram/peak_gib"]] == [1, 2, 3, 4]
    assert scalars["vram/peak_gib"][1][1] == 21.0
    assert scalars["summary/final_loss"] == [(0, 0.25)]

    texts = read_texts(logdir)
    assert texts == {"run/config": CONFIG_YAML, "run/command": "accelerate launch \\\n  -m x", "run/gpu": "NVIDIA H200"}

    assert read_hparams(logdir) == {
        "network.rank": 16.0,
        "network.alpha": 16.0,
        "network.args": "['train_blocks=all']",
        "bf16": "True",
        "seed": "None",
    }


def test_flatten_config():
    assert flatten_config({"a": {"b": {"c": 1}}, "d": False, "e": (1, 2), "f": "x"}) == {
        "a.b.c": 1,
        "d": "False",
        "e": "(1, 2)",
        "f": "x",
    }


def test_summarize_run_nested_and_prefers_loss_current(tmp_path):
    run = tmp_path / "run"
    fake_sd_scripts_run(run / "logs" / "a" / "network_train", steps=5, loss0=2.0, peak=30.0)
    write_run_text(run / "logs" / "a" / "network_train", {"gpu": "NVIDIA GeForce RTX 4090"})
    s = summarize_run(run)
    assert s.path == str(run)
    assert (s.steps_done, s.loss_tag, s.last_loss) == (5, "loss/current", pytest.approx(0.4))
    assert s.median_step_s == pytest.approx(0.51)  # 0.51 0.52 0.5 0.51 0.52
    assert s.peak_vram_gib == 31.0
    assert s.median_tflops == 250.0
    assert s.gpu == "NVIDIA GeForce RTX 4090"
    assert s.started is not None and s.updated is not None and s.started <= s.updated
    assert s.startup_s is None  # a run from before the start-up line
    assert s.median_power_w is None and s.median_sm_clock_mhz is None  # no NVML readings (a CPU run)
    with SummaryWriter(str(run / "logs" / "a" / "network_train")) as w:  # a process, then its resume
        w.add_scalar("time/startup_s", 31.5, 1, walltime=1000.0)
        w.add_scalar("time/startup_s", 22.25, 6, walltime=2000.0)
        for step, (watts, mhz) in enumerate([(250.0, 1980.0), (690.0, 1755.0), (700.0, 1650.0)], 1):
            w.add_scalar("gpu/power_w", watts, step)
            w.add_scalar("gpu/sm_clock_mhz", mhz, step)
    s = summarize_run(run)
    assert (s.startup_s, s.median_power_w, s.median_sm_clock_mhz) == (22.25, 690.0, 1755.0)


def test_summarize_accepts_other_loss_tags_and_missing_run(tmp_path):
    fake_sd_scripts_run(tmp_path / "r", steps=3, loss_tags=("loss/epoch",))
    s = summarize_run(tmp_path / "r")
    assert (s.loss_tag, s.steps_done, s.gpu) == ("loss/epoch", 3, None)
    with pytest.raises(FileNotFoundError, match="no TensorBoard event files"):
        summarize_run(tmp_path / "empty")


def test_list_runs_over_two_runs(tmp_path):
    fake_sd_scripts_run(tmp_path / "outputs" / "mychar" / "logs" / "t1" / "network_train", steps=3, peak=10.0)
    fake_sd_scripts_run(tmp_path / "outputs" / "style" / "logs" / "t2" / "network_train", steps=7, peak=40.0)
    (tmp_path / "outputs" / "not_a_run").mkdir()
    runs = list_runs(tmp_path / "outputs")
    assert [r.path.split("/")[-4] for r in runs] == ["mychar", "style"]  # oldest first
    assert [(r.steps_done, r.peak_vram_gib) for r in runs] == [(3, 11.0), (7, 41.0)]
    assert all(r.loss_tag == "loss/current" for r in runs)
    assert list_runs(tmp_path / "outputs" / "not_a_run") == []


def test_flushes_are_throttled_and_every_event_still_reaches_the_file(tmp_path):
    from flux_trainer.metrics.tensorboard import read_scalars, throttle_flush

    now = [0.0]
    writer = SummaryWriter(log_dir=str(tmp_path))
    flushed = []
    real = writer.flush
    writer.flush = lambda: (flushed.append(now[0]), real())
    assert throttle_flush(writer, every_s=10.0, clock=lambda: now[0])
    assert not throttle_flush(writer, every_s=10.0, clock=lambda: now[0])  # once
    for step, t in enumerate((1.0, 5.0, 10.5, 12.0, 20.0, 21.0), start=1):
        now[0] = t
        writer.add_scalar("loss/current", float(step), step)
        writer.flush()  # what accelerate's tracker does after every log call
    assert flushed == [10.5, 21.0]  # at most one flush per 10 s
    writer.close()  # flushes everything, throttled or not
    assert [s for s, _ in read_scalars(str(tmp_path))["loss/current"]] == [1, 2, 3, 4, 5, 6]


def test_the_runner_throttles_sd_scripts_tracker_and_leaves_runs_without_one_alone(tmp_path):
    from accelerate import Accelerator

    from flux_trainer.sdscripts.hooks import throttle_tracker_flush

    accelerator = Accelerator(cpu=True, log_with="tensorboard", project_dir=str(tmp_path))
    accelerator.init_trackers("network_train")
    assert throttle_tracker_flush(accelerator)
    assert accelerator.get_tracker("tensorboard", unwrap=True).flush._flux_throttled
    accelerator.log({"loss/current": 1.0}, step=1)  # accelerate's log flushes: now a throttled no-op, no error
    accelerator.end_training()
    assert not throttle_tracker_flush(Accelerator(cpu=True))


def test_reading_events_is_quiet_under_a_root_logger_at_info(tmp_path, caplog):
    """Under Hydra's logging (a sweep's summary reads every member's events) tensorboard's reader said a line per
    event file it moved on to; reading must leave the terminal alone."""
    import logging

    from flux_trainer.metrics.tensorboard import summarize_run

    run = tmp_path / "run"
    fake_sd_scripts_run(run / "tb" / "a", steps=2)
    fake_sd_scripts_run(run / "tb" / "a", steps=3)  # a second event file in the same folder
    caplog.set_level(logging.INFO)
    assert summarize_run(run).steps_done == 3
    assert [r.getMessage() for r in caplog.records if r.name.startswith("tensorboard")] == []
