"""scripts/bench_energy.py: the step's FLOPs it charges to projections and attention, the floor arithmetic, and what
it says where it cannot run (the measurement itself needs a CUDA GPU with NVML's energy counter)."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import load_script


@pytest.fixture(scope="module")
def energy():
    return load_script("bench_energy")


def test_the_steps_projections_are_the_block_linears_forward_and_input_gradients(energy):
    """At FLUX.1-dev, 1024², batch 1 (flops.py: forward block linears 59.5 TFLOP, attention 14.9): the projections
    twice the forward's token linears (the backward takes their input gradients only), attention 3.5x its forward."""
    t = energy.step_tflop()
    assert t["projections"] == pytest.approx(119.0, abs=0.1)
    assert t["attention"] == pytest.approx(3.5 * 4 * 4608**2 * 3072 * 57 / 1e12, rel=1e-9)
    assert energy.step_tflop(img_tokens=1024)["attention"] < t["attention"] / 3  # fewer tokens, quadratically less


def test_the_floor_is_joules_at_the_measured_rates_and_the_power_limit_turns_it_into_seconds(energy):
    fl = energy.floor({"projections": 120.0, "attention": 50.0}, {"projections": 0.96, "attention": 0.8}, 700.0, 0.30)
    assert fl["joules"] == {"projections": pytest.approx(125.0), "attention": pytest.approx(62.5)}
    assert fl["floor_j"] == pytest.approx(187.5) and fl["floor_s"] == pytest.approx(187.5 / 700)
    assert fl["target_j"] == pytest.approx(210.0) and fl["left_j"] == pytest.approx(22.5)
    below = energy.floor({"projections": 120.0, "attention": 50.0}, {"projections": 0.5, "attention": 0.5}, 700.0, 0.2)
    assert below["left_j"] == pytest.approx(140.0 - 340.0)  # a target under the floor leaves a negative budget
    assert "left_j" not in energy.floor({"attention": 1.0}, {"attention": 1.0}, 700.0, None)


def test_without_a_gpu_it_says_what_is_missing_and_exits_2(energy, capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: the benchmark would run for real")
    assert energy.main([]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
