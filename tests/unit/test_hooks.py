"""The runner's hook logic without sd-scripts: metrics per step, NaN guard, exit codes past accelerate."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch

from flux_trainer.metrics.health import LossGuard, SlowdownDetector
from flux_trainer.metrics.step import StepMetrics
from flux_trainer.sdscripts.hooks import NonFiniteLoss, RunHooks, pin_batches
from flux_trainer.sdscripts.runner import EXIT_FILE, RunnerSpec, child_exit_code


class FakeAccelerator:
    device = SimpleNamespace(type="cpu")
    is_main_process = True

    def get_tracker(self, *_a, **_k):
        raise ValueError("no tracker in this test")


def hooks(tmp_path, clock):
    spec = RunnerSpec(sd_scripts="", train_toml="", dataset_toml="")
    h = RunHooks(spec, tmp_path)
    h.metrics = StepMetrics("cpu", flops_per_step=2e12, images_per_step=1, clock=clock, nvml=None)
    h.metrics.start()
    h.loss_guard, h.slowdown = LossGuard(patience=3), SlowdownDetector(nvml=None)
    return h


def test_step_tags_come_from_the_clock(tmp_path):
    t = iter([0.0, 0.5, 2.0])
    h = hooks(tmp_path, lambda: next(t))
    h.step_start()  # batch arrived at 0.5
    tags = h.step_end(FakeAccelerator(), {"loss/current": 0.3}, 1)
    assert tags["time/step_s"] == pytest.approx(2.0) and tags["time/data_s"] == pytest.approx(0.5)
    assert tags["throughput/tflops"] == pytest.approx(1.0) and tags["vram/peak_gib"] == 0.0


def test_nan_loss_stops_after_patience(tmp_path):
    t = iter(float(i) for i in range(100))
    h = hooks(tmp_path, lambda: next(t))
    h.step_end(FakeAccelerator(), {"loss/current": 0.5}, 1)
    h.step_end(FakeAccelerator(), {"loss/current": math.nan}, 2)
    h.step_end(FakeAccelerator(), {"loss/current": math.inf}, 3)
    with pytest.raises(NonFiniteLoss) as info:
        h.step_end(FakeAccelerator(), {"loss/current": math.nan}, 4)
    assert "step" in str(info.value) and "resume=auto" in str(info.value)


def test_allocator_retries_warned_once_with_what_frees_memory(tmp_path, caplog, monkeypatch):
    t = iter(float(i) for i in range(100))
    h = hooks(tmp_path, lambda: next(t))
    retries = iter([0.0, 3.0, 1.0])
    real = h.metrics.on_step_end
    monkeypatch.setattr(h.metrics, "on_step_end", lambda step: {**real(step), "vram/alloc_retries": next(retries)})
    h.fit = SimpleNamespace(kept=12, total=57, note_peak=lambda: None)
    with caplog.at_level("WARNING", logger="flux_trainer.runner"):
        for step in (1, 2, 3):
            h.step_end(FakeAccelerator(), {"loss/current": 0.5}, step)
    warned = [r.getMessage() for r in caplog.records if "allocator" in r.getMessage()]
    assert len(warned) == 1 and warned[0].startswith("step 2:") and "3 time(s)" in warned[0]
    assert "memory.checkpoint_skip=0 (now 12 blocks" in warned[0]


def test_child_exit_code_survives_accelerate(tmp_path):
    assert child_exit_code(tmp_path, 1) == 1  # nothing recorded
    (tmp_path / EXIT_FILE).write_text(json.dumps({"code": 3, "reason": "nan"}))
    assert child_exit_code(tmp_path, 1) == 3
    assert child_exit_code(tmp_path, 0) == 0
    assert child_exit_code(tmp_path, 130) == 3


def test_max_vram_over_ranks_every_n_micro_steps(tmp_path, monkeypatch):
    import torch

    from flux_trainer.sdscripts import hooks as hooks_mod

    class TwoRanks(FakeAccelerator):
        num_processes = 2
        device = torch.device("cpu")

        def gather(self, t):
            return torch.cat([t, t + 5.0])  # the other rank peaks 5 GiB higher

    monkeypatch.setattr(hooks_mod, "RANK_REDUCE_EVERY", 2)
    monkeypatch.setattr(hooks_mod, "run_peak_gib", lambda device: 10.0)
    t = iter(float(i) for i in range(100))
    h = hooks(tmp_path, lambda: next(t))
    h.step_start(TwoRanks())
    assert "vram/peak_gib_max_over_ranks" not in h.step_end(TwoRanks(), {"loss/current": 1.0}, 1)
    h.step_start(TwoRanks())
    assert h.step_end(TwoRanks(), {"loss/current": 1.0}, 2)["vram/peak_gib_max_over_ranks"] == 15.0
    h.step_start(TwoRanks())
    assert "vram/peak_gib_max_over_ranks" not in h.step_end(TwoRanks(), {"loss/current": 1.0}, 3)


def test_a_failing_profile_close_does_not_mask_the_run_outcome(tmp_path, caplog):
    from types import SimpleNamespace

    from flux_trainer.sdscripts.hooks import RunHooks

    class Broken:
        def close(self):
            raise RuntimeError("CUDA error: an illegal memory access")

    hooks = RunHooks(SimpleNamespace(kernels={}, metrics={}), tmp_path)
    hooks.profiler = Broken()
    hooks.train_finished()  # logs, does not raise
    assert "profile not written: RuntimeError" in caplog.text


def test_a_profile_window_open_at_the_last_step_closes_before_the_final_save(tmp_path):
    """The window (steps 2-4) outlasts a 3-step run: it closes at the last step's end, so the final save (once 456
    device-to-host copies per profiled step) is not in it; train_finished then has nothing left to close."""
    import torch

    from flux_trainer.metrics.profile import StepProfiler

    t = iter(float(i) for i in range(100))
    h = hooks(tmp_path, lambda: next(t))
    h._max_steps = 3  # what before_prepare reads from sd-scripts' args.max_train_steps
    h.profiler = StepProfiler(tmp_path, at=2, steps=3)
    acc = FakeAccelerator()
    acc.device = torch.device("cpu")
    for step in (1, 2, 3):
        h.step_start(acc)
        torch.ones(8, 8).matmul(torch.ones(8, 8))
        h.step_end(acc, {"loss/current": 1.0}, step)
        assert (tmp_path / "profile" / "summary.json").is_file() == (step == 3)
    assert h.profiler.steps == 2 and h.profiler._prof is None
    assert not h.profiler.close()  # what train_finished calls: nothing open any more


def test_run_texts_name_the_attention_backend_chosen_at_the_runs_shape(tmp_path, fm):
    """TensorBoard's run/attention says what the attention probe chose at the first forward (written with the
    other run texts after the first step, when that forward has happened)."""
    import torch

    from flux_kernels.patches import patch
    from flux_trainer.metrics.tensorboard import read_texts
    from tests.conftest import flux_block_pair

    model = flux_block_pair(fm, 256, 2, 0.05)
    patch.install_block_op(model, "attention", cache_path=tmp_path / "attention.json", device="cpu")
    dispatch = model.double_blocks[0]._flux_kernels.attention
    name = dispatch.decide_run((1, 2, 24, 128), torch.float32, "cpu", False)

    class Tracked(FakeAccelerator):
        def get_tracker(self, *_a, **_k):
            return SimpleNamespace(log_dir=str(tmp_path / "tb"))

    h = RunHooks(RunnerSpec(sd_scripts="", train_toml="", dataset_toml=""), tmp_path)
    h.kernels_installed, h._unet = ["attention", "compile_blocks"], model
    h.write_run_texts(Tracked())
    texts = read_texts(tmp_path / "tb")
    assert texts["run/attention"] == f"{name} at (1, 2, 24, 128) float32 mask=False"
    assert texts["run/kernels"] == "attention, compile_blocks"
    assert "run/compile_cache" not in texts  # before the first step's report


def test_run_texts_carry_the_compile_cache_line_of_the_first_step(tmp_path, monkeypatch):
    """TensorBoard's run/compile_cache: the line the log has after the first step, torch's reasons included."""
    from torch._dynamo.utils import counters

    from flux_trainer.metrics.tensorboard import read_texts
    from flux_trainer.sdscripts import hooks

    for key, n in (("fxgraph_cache_hit", 6), ("fxgraph_cache_miss", 1), ("fxgraph_cache_bypass", 2)):
        monkeypatch.setitem(counters["inductor"], key, n)
    for key in ("autograd_cache_hit", "autograd_cache_miss", "autograd_cache_bypass"):
        monkeypatch.setitem(counters["aot_autograd"], key, 0)

    class Tracked(FakeAccelerator):
        def get_tracker(self, *_a, **_k):
            return SimpleNamespace(log_dir=str(tmp_path / "tb"))

    h = RunHooks(RunnerSpec(sd_scripts="", train_toml="", dataset_toml=""), tmp_path)
    h.spec.metrics = {"enabled": False}
    h.kernels_installed = ["compile_blocks"]
    h._bypass_reasons = SimpleNamespace(reasons={"inductor: Can't cache X": 2})
    h.step_end(Tracked(), {}, hooks.COMPILE_CHECKED_AT)
    h.write_run_texts(Tracked())
    line = read_texts(tmp_path / "tb")["run/compile_cache"]
    assert line.startswith("torch.compile cache: inductor 6 hit / 1 miss / 2 bypass, autograd 0 hit")
    assert line.endswith("(torch says: inductor: Can't cache X (2x))")


class PreparingAccelerator:
    """What pin_batches touches of accelerate's Accelerator: its device, its dataloader configuration (accelerate's
    own class) and `prepare`, which hands a DataLoader to accelerate's prepare_data_loader as Accelerator does."""

    def __init__(self, device_type: str):
        from accelerate.utils import DataLoaderConfiguration

        self.device = SimpleNamespace(type=device_type)
        self.dataloader_config = DataLoaderConfiguration()
        self.prepared = []

    def prepare(self, *objects):
        from accelerate.data_loader import prepare_data_loader

        out = [
            prepare_data_loader(o, non_blocking=self.dataloader_config.non_blocking, put_on_device=False)
            if isinstance(o, torch.utils.data.DataLoader)
            else o
            for o in objects
        ]
        self.prepared.append(out)
        return out if len(out) > 1 else out[0]


def test_pinned_batches_reach_accelerates_loader_and_the_wrap_goes_after_one_use():
    acc = PreparingAccelerator("cuda")
    assert "page-locked" in pin_batches(acc)
    unet = object()
    assert acc.prepare(unet) is unet  # sd-scripts prepares the model first: nothing to do yet
    assert "prepare" in vars(acc) and not acc.dataloader_config.non_blocking
    train = torch.utils.data.DataLoader([{"latents": torch.randn(2)}], batch_size=1)
    val = torch.utils.data.DataLoader([], batch_size=1)
    network, shard, val_shard = acc.prepare("network", train, val)
    assert train.pin_memory and val.pin_memory and acc.dataloader_config.non_blocking
    assert shard.pin_memory and shard._non_blocking  # accelerate carried both into the loader that is iterated
    assert "prepare" not in vars(acc)  # the class's own prepare from here on
    later = torch.utils.data.DataLoader([1], batch_size=1)
    acc.prepare(later)
    assert not later.pin_memory


def test_no_pinned_batches_off_cuda():
    acc = PreparingAccelerator("cpu")
    assert pin_batches(acc) is None
    assert "prepare" not in vars(acc)


def test_the_networks_grad_norms_are_patched_at_the_first_step_with_lora_grad_norms(tmp_path, monkeypatch):
    from flux_kernels.patches import lora_norms

    calls = []
    monkeypatch.setattr(lora_norms, "install_network", lambda net: calls.append(net) or True)
    h = RunHooks(RunnerSpec(sd_scripts="", train_toml="", dataset_toml=""), tmp_path)
    network = object()
    h.step_start(None, network)  # kernels without lora_grad_norms: nothing
    assert calls == []
    h = RunHooks(RunnerSpec(sd_scripts="", train_toml="", dataset_toml=""), tmp_path)
    h.kernels_installed = ["attention", "lora_grad_norms"]
    h.step_start(None, network)
    h.step_start(None, network)
    assert calls == [network]
