"""`flux-train bench` end to end on CPU with the tiny random model: real sd-scripts steps, table and JSON."""

from __future__ import annotations

import json

import pytest

from flux_trainer.config import ConfigError
from flux_trainer.sdscripts.checkout import locate

pytestmark = pytest.mark.sd_scripts


def test_bench_runs_cases_and_writes_json(tmp_path, monkeypatch, capsys):
    try:
        locate()
    except ConfigError as exc:
        pytest.skip(f"needs an sd-scripts checkout: {exc}")
    from flux_trainer.commands.bench import bench_main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    out = tmp_path / "bench.json"
    code = bench_main(
        [
            "--model",
            "random_tiny",
            "--cases",
            "memory=cpu",
            "network.rank=4+memory=cpu",
            "--kernels",
            "off",
            "auto",
            "--resolution",
            "256",
            "--warmup",
            "1",
            "--steps",
            "2",
            "--root",
            str(tmp_path / "b"),
            "--json",
            str(out),
            "train.data_loader_workers=0",
        ]
    )
    assert code == 0
    results = json.loads(out.read_text())["results"]
    assert [r["case"] for r in results] == ["cpu_k-off_256", "cpu_k-auto_256", "4_cpu_k-off_256", "4_cpu_k-auto_256"]
    for r in results:
        assert r["exit_code"] == 0 and r["steps"] == 3
        assert r["s_per_step"] > 0 and r["s_min"] <= r["s_per_step"] <= r["s_max"]
        assert r["first_step_s"] > 0 and r["step1_extra_s"] is not None
    # auto installs nothing on a CPU, so the same seed gives the same losses and LoRA: the comparison says so
    auto = {r["case"]: r for r in results}["4_cpu_k-auto_256"]
    assert auto["compared_to"] == "4_cpu_k-off_256"
    assert auto["loss_rel_diff"] == pytest.approx(0.0, abs=1e-6)
    assert auto["lora_cosine"] == pytest.approx(1.0) and auto["lora_up_cosine"] == pytest.approx(1.0)
    text = capsys.readouterr().out
    assert "cpu_k-off_256" in text and "s/step" in text and "numerics against kernels=off" in text


def test_cases_expand_the_product():
    from flux_trainer.commands.bench import cases

    got = cases(["memory=vram24+precision=fp8_base", "memory=vram80"], ["off", "auto"], [512, 1024])
    assert len(got) == 8
    name, overrides, res = got[0]
    assert overrides == ["memory=vram24", "precision=fp8_base", "kernels=off"] and res == 512
    assert name == "vram24_fp8_base_k-off_512"
    ((name, overrides, _),) = cases(["optimizer=prodigy+kernels.set='compile_blocks,prodigy_step'"], ["auto"], [1024])
    assert overrides[-2:] == ["kernels.set='compile_blocks,prodigy_step'", "kernels=auto"]
    assert name == "prodigy_compile_blocks-prodigy_step_k-auto_1024"  # a case name is a folder and file name
    ((name, overrides, _),) = cases(["memory=vram48"], ["fp8+kernels.cuda_graphs=true"], [1024])
    assert overrides == ["memory=vram48", "kernels=fp8", "kernels.cuda_graphs=true"]  # the set's own, after it
    assert name == "vram48_k-fp8_true_1024"


def test_abba_runs_the_second_pass_in_reverse_and_compares_the_means(tmp_path, monkeypatch, capsys):
    """A drift that slows every later run by 10% makes the later case look slower in one pass; over A B B A, cases
    of the same speed come out equal. The baseline runs in the first pass only."""
    from flux_trainer.commands import bench

    order, baselines = [], []

    def fake_case(name, overrides, res, ns, root):
        order.append(name)
        speed = 2.0 if "vram24" in name else 1.0  # vram24 is twice as slow, whatever the drift
        return bench.BenchResult(case=name, overrides=overrides, exit_code=0, s_per_step=speed * (1 + 0.1 * len(order)),
                                 run_dir=str(tmp_path / name))  # fmt: skip

    def fake_baseline(ours, ns):
        baselines.append(ours.case)
        return bench.BenchResult(case=f"{ours.case}_sd", overrides=[], exit_code=0)

    monkeypatch.setattr(bench, "run_case", fake_case)
    monkeypatch.setattr(bench, "run_baseline", fake_baseline)
    out = tmp_path / "b.json"
    argv = ["--cases", "memory=vram80", "memory=vram48", "memory=vram24", "--json", str(out), "--baseline"]
    assert bench.bench_main([*argv, "--abba"]) == 0
    names = ["vram80_k-off_1024", "vram48_k-off_1024", "vram24_k-off_1024"]
    assert order == [*names, *(f"{n}_2" for n in reversed(names))]
    assert baselines == names
    rows = {r["case"]: r for r in json.loads(out.read_text())["abba"]}
    assert list(rows) == names
    assert rows["vram48_k-off_1024"]["s_per_step_1"] == pytest.approx(1.2)  # alone, 1.2 / 1.1: "9% slower"
    assert rows["vram48_k-off_1024"]["s_per_step_2"] == pytest.approx(1.5)
    assert rows["vram48_k-off_1024"]["vs_first"] == pytest.approx(1.0)
    assert rows["vram24_k-off_1024"]["vs_first"] == pytest.approx(2.0)
    assert "A B B A" in capsys.readouterr().out
    order.clear()
    assert bench.bench_main(argv) == 0
    assert order == names and "abba" not in json.loads(out.read_text())


def test_case_cap():
    from flux_trainer.commands.bench import case_cap

    assert case_cap("tier", ["memory=vram24", "precision=fp8_base"]) == 23.5  # a display takes 0.5 GiB
    assert case_cap("30", ["memory=vram24"]) == 30.0
    assert case_cap(None, ["memory=vram24"]) is None and case_cap("tier", ["memory=cpu"]) is None


def _fake_run(folder, losses, tensors):
    """A run dir as bench leaves it: TensorBoard loss events under tb/ and a LoRA file."""
    from safetensors.torch import save_file
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(folder / "tb" / "network_train"))
    for step, loss in enumerate(losses, start=1):
        writer.add_scalar("loss/current", loss, step)
    writer.close()
    save_file(tensors, str(folder / "out.safetensors"))
    return folder


def test_step_stats_time_steps_and_the_first_two_steps_extra(tmp_path):
    """s/step from the loss events' wall times after the warm-up; the first and second steps' compute (data wait
    excluded) beyond the median: compiling, and selective checkpointing's retrace at the second step."""
    from torch.utils.tensorboard import SummaryWriter

    from flux_trainer.commands.bench import BenchResult, step_stats, table

    writer = SummaryWriter(str(tmp_path / "tb" / "network_train"))
    walls = {1: 100.0, 2: 111.0, 3: 111.5, 4: 112.0, 5: 112.6, 6: 113.0}
    compute = {1: 30.5, 2: 10.5, 3: 0.5, 4: 0.5, 5: 0.6, 6: 0.4}
    for step, wall in walls.items():
        writer.add_scalar("loss/current", 1.0, step, walltime=wall)
        writer.add_scalar("time/step_s", compute[step] + 2.0, step, walltime=wall)
        writer.add_scalar("time/data_s", 2.0, step, walltime=wall)
    writer.close()
    stats = step_stats(tmp_path / "tb", warmup=2)
    assert stats["s_per_step"] == pytest.approx(0.5) and stats["s_max"] == pytest.approx(0.6)
    assert stats["step1_extra_s"] == pytest.approx(30.0) and stats["step2_extra_s"] == pytest.approx(10.0)
    assert stats.pop("window") == pytest.approx((111.0, 113.0))  # the measured steps: from the warm-up's end
    stats.pop("first_wall")
    assert "30.0/10.0" in table([BenchResult(case="c", overrides=[], exit_code=0, **stats)])


def test_step_stats_images_per_second_of_all_processes_where_logged(tmp_path):
    """The run's images/s: every process's where the run logged it (several GPUs), else the one process's."""
    from torch.utils.tensorboard import SummaryWriter

    from flux_trainer.commands.bench import BenchResult, step_stats, table

    for name, all_ranks in (("two", True), ("one", False)):
        writer = SummaryWriter(str(tmp_path / name / "tb"))
        for step in range(1, 6):
            writer.add_scalar("loss/current", 1.0, step, walltime=100.0 + step)
            writer.add_scalar("throughput/images_per_s", 3.0 if step > 2 else 0.1, step)
            if all_ranks:
                writer.add_scalar("throughput/images_per_s_all_ranks", 6.0 if step > 2 else 0.2, step)
        writer.close()
    two, one = (step_stats(tmp_path / n / "tb", warmup=2) for n in ("two", "one"))
    assert two["images_per_s"] == 6.0 and one["images_per_s"] == 3.0  # after the warm-up only
    for s in (two, one):
        s.pop("window"), s.pop("first_wall")
    out = table([BenchResult(case="c", overrides=[], exit_code=0, **two)])
    assert "img/s" in out and " 6.00 " in out


def test_step_stats_peaks_are_the_largest_of_any_logged_step(tmp_path):
    """torch's and the allocator's reserved peaks: the largest logged (each step logs its own since the last)."""
    from torch.utils.tensorboard import SummaryWriter

    from flux_trainer.commands.bench import BenchResult, step_stats, table

    writer = SummaryWriter(str(tmp_path / "tb"))
    for step, (peak, reserved) in enumerate([(5.0, 6.5), (7.25, 7.5), (6.0, 9.75)], start=1):
        writer.add_scalar("loss/current", 1.0, step, walltime=100.0 + step)
        writer.add_scalar("vram/peak_gib", peak, step)
        writer.add_scalar("vram/reserved_peak_gib", reserved, step)
    writer.close()
    stats = step_stats(tmp_path / "tb", warmup=1)
    assert (stats["torch_peak_gib"], stats["reserved_peak_gib"]) == (7.25, 9.75)
    writer = SummaryWriter(str(tmp_path / "tb"))  # several processes: another's torch peak, every 25 steps
    writer.add_scalar("vram/peak_gib_max_over_ranks", 8.5, 3)
    writer.close()
    assert step_stats(tmp_path / "tb", warmup=1)["torch_peak_gib"] == 8.5
    stats.pop("window"), stats.pop("first_wall")
    out = table([BenchResult(case="c", overrides=[], exit_code=0, **stats)])
    assert "rsv pk" in out and "     7.2    9.8 " in out


def test_case_cards_are_the_first_n_visible_gpus_of_the_case():
    from flux_trainer.commands.bench import case_cards

    assert case_cards(["memory=vram80"], visible="") == [0]
    assert case_cards(["launcher.gpus=2"], visible="") == [0, 1]
    assert case_cards(["launcher.gpus=2"], visible="3,1,0") == [3, 1]  # accelerate's ranks take them in this order
    assert case_cards(["launcher.gpus=1", "launcher.gpus=2"], visible="5") == [5]  # the last override wins; one card
    assert case_cards(["launcher.gpus=all"], visible="2,3") == [2, 3]
    assert case_cards(["launcher.gpus=all"], visible="") is None  # every card
    assert case_cards(["launcher.gpus=2"], visible="GPU-aa,GPU-bb") == [0, 1]  # named by UUID: by position


def test_card_poller_samples_memory_power_and_clock_and_takes_medians_over_the_measured_steps():
    """The poller reads used memory, power and SM clock through NVML (a stand-in here) on its thread; a board that
    refuses a reading leaves it None, and the medians count only the samples inside the measured steps' window."""
    import time
    from types import SimpleNamespace

    from flux_trainer.commands.bench import BenchResult, CardPoller, table

    class Nvml:
        NVML_CLOCK_SM = 1

        def __init__(self):
            self.used = iter(range(1, 10**6))

        def nvmlInit(self):
            pass

        def nvmlDeviceGetHandleByIndex(self, index):
            return index

        def nvmlDeviceGetMemoryInfo(self, handle):
            return SimpleNamespace(used=next(self.used) * 2**30)

        def nvmlDeviceGetPowerUsage(self, handle):
            return 690_500  # milliwatts

        def nvmlDeviceGetClockInfo(self, handle, clock):
            raise RuntimeError("NotSupported")

    with CardPoller(period_s=0.005, nvml=Nvml()) as poller:
        time.sleep(0.1)
    assert len(poller.samples) >= 2 and poller.peak_gib == len(poller.samples)

    class TwoCards(Nvml):  # the second card fuller: its memory is the peak; power and clock are the first card's
        def nvmlDeviceGetCount(self):
            return 2

        def nvmlDeviceGetMemoryInfo(self, handle):
            return SimpleNamespace(used=(1 + 2 * handle) * 2**30)

        def nvmlDeviceGetPowerUsage(self, handle):
            return 100_000 * (handle + 1)

    for indices in ([0, 1], None):
        with CardPoller(indices, period_s=0.005, nvml=TwoCards()) as two:
            time.sleep(0.05)
        assert two.peak_gib == 3.0 and {w for _, w, _ in two.samples} == {100.0}
    with CardPoller([0], period_s=0.005, nvml=TwoCards()) as first:
        time.sleep(0.05)
    assert first.peak_gib == 1.0
    assert {(w, c) for _, w, c in poller.samples} == {(690.5, None)}
    assert poller.during((0.0, time.time())) == {"power_w": 690.5}  # no clock reading: no clock median
    poller.samples = [(1.0, 300.0, 1980.0), (2.0, 690.0, 1700.0), (3.0, 700.0, None), (4.0, 695.0, 1755.0)]
    assert poller.during((2.0, 4.0)) == {"power_w": 695.0, "sm_clock_mhz": pytest.approx(1727.5)}
    assert poller.during(None) == {} and CardPoller(nvml=object()).during((0.0, 5.0)) == {}
    row = BenchResult(case="c", overrides=[], exit_code=0, s_per_step=0.33, **poller.during((2.0, 4.0)))
    assert " 695   1728 " in table([row])


def test_energy_a_step_is_the_counters_joules_over_the_window_times_the_mean_step(tmp_path):
    """NVML's energy counter (millijoules since the driver loaded), read on the poller's thread: the mean power is
    the counter's rise between its first and last reading inside the measured window over the seconds between them
    (readings outside the window left out), and a step's energy that times the window's mean step; a board without
    the counter gives no figure, not a zero."""
    from types import SimpleNamespace

    from flux_trainer.commands.bench import BenchResult, CardPoller, _measured, table

    class Nvml:
        NVML_CLOCK_SM = 1

        def __init__(self):
            self.mj = iter(range(0, 10**9, 7_000))

        def nvmlInit(self):
            pass

        def nvmlDeviceGetHandleByIndex(self, index):
            return index

        def nvmlDeviceGetMemoryInfo(self, handle):
            return SimpleNamespace(used=2**30)

        def nvmlDeviceGetPowerUsage(self, handle):
            return 690_000

        def nvmlDeviceGetClockInfo(self, handle, clock):
            return 1700

        def nvmlDeviceGetTotalEnergyConsumption(self, handle):
            return next(self.mj)

    import time

    with CardPoller(period_s=0.005, nvml=Nvml()) as poller:
        time.sleep(0.05)
    joules = [j for _, j in poller.energy]
    assert len(joules) >= 2 and joules[:2] == [0.0, 7.0]  # one counter reading per sample, in joules
    poller.energy = [(1.0, 100.0), (2.0, 790.0), (3.0, 1480.0), (4.0, 2180.0), (5.0, 9999.0)]
    assert poller.during((1.5, 4.0))["mean_power_w"] == pytest.approx((2180.0 - 790.0) / 2.0)
    assert "mean_power_w" not in poller.during((1.5, 2.5))  # one reading: no interval to divide by

    class NoCounter(Nvml):
        def nvmlDeviceGetTotalEnergyConsumption(self, handle):
            raise RuntimeError("NotSupported")

    with CardPoller(period_s=0.005, nvml=NoCounter()) as bare:
        time.sleep(0.03)
    assert bare.energy == [] and "mean_power_w" not in bare.during((0.0, time.time()))

    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(tmp_path / "tb" / "network_train"))
    for step, wall in {1: 0.0, 2: 1.0, 3: 1.5, 4: 2.0, 5: 2.5}.items():
        writer.add_scalar("loss/current", 1.0, step, walltime=wall)
    writer.close()
    poller.energy = [(1.0, 0.0), (2.5, 1050.0)]  # 700 W over the measured steps (1.0 to 2.5 s, three of 0.5 s)
    row = BenchResult(case="c", overrides=[], exit_code=0)
    _measured(row, tmp_path / "tb", 2, 0.0, poller)
    assert row.s_mean == pytest.approx(0.5) and row.energy_j == pytest.approx(350.0)
    assert " 350 " in table([row])
    _measured(no_energy := BenchResult(case="c", overrides=[], exit_code=0), tmp_path / "tb", 2, 0.0, bare)
    assert no_energy.energy_j is None


def test_step_stats_mean_is_the_windows_throughput_where_intervals_bunch(tmp_path):
    """Loss events logged late for one step and early for the next (sync-free steps) make the intervals uneven: the
    median and the range follow the bunching, the mean is the measured window's wall time over its steps."""
    from torch.utils.tensorboard import SummaryWriter

    from flux_trainer.commands.bench import BenchResult, step_stats, table

    writer = SummaryWriter(str(tmp_path / "tb" / "network_train"))
    for step, wall in {1: 0.0, 2: 1.0, 3: 1.1, 4: 1.2, 5: 2.1, 6: 3.0}.items():
        writer.add_scalar("loss/current", 1.0, step, walltime=wall)
    writer.close()
    stats = step_stats(tmp_path / "tb", warmup=1)
    assert stats["s_per_step"] == pytest.approx(0.9) and stats["s_min"] == pytest.approx(0.1)
    assert stats["s_mean"] == pytest.approx(3.0 / 5)
    stats.pop("first_wall"), stats.pop("window")
    assert " 0.600 " in table([BenchResult(case="c", overrides=[], exit_code=0, **stats)])


def test_compare_runs_loss_difference_and_lora_cosines(tmp_path):
    import torch

    from flux_trainer.commands.bench import compare_runs

    up, down = torch.randn(8, 4), torch.randn(4, 8)
    ref = _fake_run(tmp_path / "ref", [1.0, 0.5, 0.25], {"a.lora_up.weight": up, "a.lora_down.weight": down})
    same = _fake_run(tmp_path / "same", [1.0, 0.5, 0.25], {"a.lora_up.weight": up, "a.lora_down.weight": down})
    other = _fake_run(tmp_path / "other", [1.1, 0.45, 0.25], {"a.lora_up.weight": -up, "a.lora_down.weight": down})
    assert compare_runs(ref, same) == {"loss_rel_diff": 0.0, "loss_rel_bias": 0.0, "lora_cosine": pytest.approx(1.0),
                                       "lora_up_cosine": pytest.approx(1.0), "lora_up_min_cosine": pytest.approx(1.0),
                                       "lora_up_min_group": "a"}  # fmt: skip
    got = compare_runs(ref, other)
    assert got["loss_rel_diff"] == pytest.approx((0.1 + 0.1) / 3, rel=1e-5)
    assert got["loss_rel_bias"] == pytest.approx((0.1 - 0.1) / 3, abs=1e-6)  # one step above, one below: no drift
    assert got["lora_up_cosine"] == pytest.approx(-1.0)  # the learned half points the other way
    n_up, n_down = up.double().square().sum(), down.double().square().sum()
    # absolute tolerance: n_down - n_up can be near zero for some draws, and float32 sums differ in the 7th digit
    assert got["lora_cosine"] == pytest.approx(float((n_down - n_up) / (n_down + n_up)), abs=1e-5)
    # a run whose loss is the lower at every step: the signed mean is minus the absolute one
    lower = _fake_run(tmp_path / "lower", [0.9, 0.45, 0.25], {"a.lora_up.weight": up, "a.lora_down.weight": down})
    drift = compare_runs(ref, lower)
    assert drift["loss_rel_bias"] == pytest.approx(-drift["loss_rel_diff"]) and drift["loss_rel_diff"] > 0.06
    from flux_trainer.commands.bench import BenchResult, numerics_table

    row = BenchResult(case="k-auto", overrides=[], exit_code=0, compared_to="k-off", **drift)
    assert f" {drift['loss_rel_diff']:.4f}  {drift['loss_rel_bias']:+.4f} " in numerics_table([row])


def test_compare_runs_names_the_kind_of_module_whose_lora_up_agrees_least(tmp_path):
    """One kind of module (txt qkv, in every block) learned something else; the whole lora_up stays close. Module
    kinds that both runs left at zero count as equal, not as a cosine of 0."""
    import torch

    from flux_trainer.commands.bench import compare_runs, module_group

    gen = torch.Generator().manual_seed(0)
    ref, got = {}, {}
    for block in range(3):
        for kind, width in (("img_mlp_0", 64), ("img_mlp_2", 64), ("txt_attn_qkv", 8), ("img_mod_lin", 8)):
            key = f"lora_unet_double_blocks_{block}_{kind}.lora_up.weight"
            up = torch.randn(width, 4, generator=gen)
            noise = torch.randn(width, 4, generator=gen)
            if kind == "img_mod_lin":  # untouched in both runs
                up, noise = torch.zeros(width, 4), torch.zeros(width, 4)
            ref[key], got[key] = up, up + (1.5 if kind == "txt_attn_qkv" else 0.01) * noise
    out = compare_runs(_fake_run(tmp_path / "ref", [1.0], ref), _fake_run(tmp_path / "got", [1.0], got))
    assert out["lora_up_cosine"] > 0.9  # the wide modules dominate the whole
    assert out["lora_up_min_group"] == "double_blocks_N_txt_attn_qkv"
    assert 0.3 < out["lora_up_min_cosine"] < 0.8  # ~1 / sqrt(1 + 1.5^2)
    assert module_group("lora_unet_single_blocks_12_linear1.lora_up.weight") == "single_blocks_N_linear1"
    assert module_group("lora_unet_double_blocks_0_img_mlp_2.lora_up.weight") == "double_blocks_N_img_mlp_2"
    from flux_trainer.commands.bench import BenchResult, numerics_table

    row = BenchResult(case="k-auto", overrides=[], exit_code=0, compared_to="k-off", **out)
    assert f"{out['lora_up_min_cosine']:.4f} (double_blocks_N_txt_attn_qkv)" in numerics_table([row])


def test_compare_kernel_sets_pairs_each_case_with_the_first_sets_run(tmp_path):
    from flux_trainer.commands.bench import BenchResult, cases, compare_kernel_sets

    plan = cases(["memory=vram24", "memory=vram80"], ["off", "auto"], [1024])
    runs = {}
    for name, _, _ in plan:
        loss = 2.0 if name.startswith("vram80_k-auto") else 1.0
        runs[name] = _fake_run(tmp_path / name, [loss, loss], {"x.lora_up.weight": __import__("torch").ones(3)})
    results = [BenchResult(case=n, overrides=o, exit_code=0, run_dir=str(runs[n])) for n, o, _ in plan]
    compare_kernel_sets(results, plan, "off")
    by = {r.case: r for r in results}
    assert by["vram24_k-auto_1024"].compared_to == "vram24_k-off_1024"
    assert by["vram24_k-auto_1024"].loss_rel_diff == 0.0
    assert by["vram80_k-auto_1024"].compared_to == "vram80_k-off_1024"
    assert by["vram80_k-auto_1024"].loss_rel_diff == pytest.approx(1.0)
    assert by["vram24_k-off_1024"].compared_to is None


def test_compare_kernel_sets_with_overrides_of_one_set(tmp_path):
    """A kernel set with its own overrides ('fp8+kernels.cuda_graphs=true') pairs with the first set's run of the
    same case; two sets that differ only in such overrides are told apart."""
    from flux_trainer.commands.bench import BenchResult, cases, compare_kernel_sets

    kernels = ["auto", "auto+kernels.cuda_graphs=true", "fp8+kernels.cuda_graphs=true"]
    plan = cases(["memory=vram48", "memory=vram80"], kernels, [1024])
    runs = {}
    for name, _, _ in plan:
        loss = 2.0 if "vram80" in name and "fp8" in name else 1.0
        runs[name] = _fake_run(tmp_path / name, [loss, loss], {"x.lora_up.weight": __import__("torch").ones(3)})
    results = [BenchResult(case=n, overrides=o, exit_code=0, run_dir=str(runs[n])) for n, o, _ in plan]
    compare_kernel_sets(results, plan, "auto")
    by = {r.case: r for r in results}
    assert by["vram48_k-auto_true_1024"].compared_to == "vram48_k-auto_1024"
    assert by["vram80_k-fp8_true_1024"].compared_to == "vram80_k-auto_1024"
    assert by["vram80_k-fp8_true_1024"].loss_rel_diff == pytest.approx(1.0)
    assert by["vram48_k-fp8_true_1024"].loss_rel_diff == 0.0
    assert by["vram48_k-auto_1024"].compared_to is None and by["vram80_k-auto_1024"].compared_to is None
    plan = cases(["memory=vram48"], kernels[1::-1], [1024])  # the reference has an override of its own
    results = [BenchResult(case=n, overrides=o, exit_code=0, run_dir=str(runs[n])) for n, o, _ in plan]
    compare_kernel_sets(results, plan, kernels[1])
    by = {r.case: r for r in results}
    assert by["vram48_k-auto_1024"].compared_to == "vram48_k-auto_true_1024"
    assert by["vram48_k-auto_true_1024"].compared_to is None


def test_tiers_with_one_kernel_set_compare_each_tier_with_plain_sd_scripts_within_its_precisions_tolerance(
    tmp_path, monkeypatch, capsys
):
    """`bench --tiers` (one kernel set) puts each tier's numerics against plain sd-scripts' run of the same TOMLs in
    the table; 3% apart in mean per-step loss passes with an fp8 base (fp8 matmuls: 4%), fails with bf16 (2%)."""
    import torch

    from flux_trainer.commands import bench
    from flux_trainer.commands.bench import BenchResult

    lora = {"x.lora_up.weight": torch.ones(4), "x.lora_down.weight": torch.arange(4.0)}

    def run_case(name, overrides, res, ns, root):
        tier = overrides[0].removeprefix("memory=")
        run = _fake_run(tmp_path / name, [1.03, 1.03, 1.03], lora)
        (run / "sd_scripts.toml").write_text(f"fp8_base = {'true' if tier == 'vram24' else 'false'}\n")
        return BenchResult(case=name, overrides=overrides, exit_code=0, run_dir=str(run), s_per_step=0.3,
                           card_peak_gib=1.0)  # fmt: skip

    def run_baseline(r, ns):
        run = _fake_run(tmp_path / f"{r.case}-plain", [1.0, 1.0, 1.0], lora)
        return BenchResult(case=f"{r.case} (plain sd-scripts)", overrides=[], exit_code=0, run_dir=str(run),
                           s_per_step=0.9, card_peak_gib=1.0)  # fmt: skip

    monkeypatch.setattr(bench, "run_case", run_case)
    monkeypatch.setattr(bench, "run_baseline", run_baseline)
    out = tmp_path / "b.json"
    # plain sd-scripts' run is a folder inside ours (baseline/), its LoRA written later: ours is still our own
    lora_up_other = {**lora, "x.lora_up.weight": -torch.ones(4)}
    from flux_trainer.commands.bench import compare_runs

    ref = _fake_run(tmp_path / "ref", [1.0], lora)
    nested = _fake_run(tmp_path / "nested", [1.0], lora_up_other)
    _fake_run(nested / "baseline", [1.0], lora)
    assert compare_runs(ref, nested)["lora_up_cosine"] == pytest.approx(-1.0)
    assert bench.bench_main(["--tiers", "vram12", "vram24", "--json", str(out), "--root", str(tmp_path)]) == 0
    rows = {t["tier"]: t for t in json.loads(out.read_text())["tiers"]}
    assert rows["vram24"]["compared_to"] == "vram24_k-auto_1024 (plain sd-scripts)"
    assert rows["vram24"]["loss_rel_diff"] == pytest.approx(0.03, rel=1e-4)
    assert rows["vram24"]["numerics_met"] and rows["vram24"]["met"]  # fp8 base: within 4%
    assert rows["vram12"]["numerics_met"] is False and not rows["vram12"]["met"]  # bf16: over 2%
    text = capsys.readouterr().out
    assert "numerics against plain sd-scripts" in text and "3.00% / 1.0000 (plain)" in text
