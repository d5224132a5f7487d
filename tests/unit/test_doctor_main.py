"""`flux-train doctor` end to end on the CPU: the JSON shape, the table, exit codes (0 when nothing fails, 1 when
something does), option parsing, and a crashing check reported as a row instead of raised."""

from __future__ import annotations

import json

import pytest

from flux_trainer import doctor
from flux_trainer.config.errors import ConfigError
from flux_trainer.doctor import disk as doctor_disk
from flux_trainer.doctor import env as doctor_env
from flux_trainer.doctor.core import STATUSES, CheckResult, exit_code, worst
from flux_trainer.launch import device as launch_device
from flux_trainer.launch.device import DeviceInfo
from flux_trainer.sdscripts.checkout import COMMIT_FILE, ENV_VAR, PINNED_COMMIT

CPU = DeviceInfo.cpu(torch_version="2.7.0+cpu")
GOOD = {
    "transformers": "4.54.1", "diffusers": "0.32.1", "huggingface_hub": "0.34.3", "tokenizers": "0.21.4",
    "accelerate": "1.6.0", "safetensors": "0.4.5",
}  # fmt: skip


@pytest.fixture
def machine(workdir, monkeypatch, tmp_path):
    """A CPU machine with a pinned sd-scripts checkout, compatible dependencies and a clean environment."""
    checkout = tmp_path / "sd-scripts"
    checkout.mkdir()
    (checkout / "flux_train_network.py").write_text("")
    (checkout / COMMIT_FILE).write_text(PINNED_COMMIT)
    monkeypatch.setenv(ENV_VAR, str(checkout))
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "CUDA_LAUNCH_BLOCKING", "CUDA_VISIBLE_DEVICES"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(launch_device, "detect_device", lambda index=0: CPU)
    monkeypatch.setattr(doctor_env, "installed_version", lambda names: (names[0], GOOD.get(names[0], "1.0")))
    return workdir


def run(capsys, *argv):
    code = doctor.doctor_main(list(argv))
    return code, capsys.readouterr().out


def test_json_has_every_row_with_status_evidence_and_fix(machine, capsys, tmp_path):
    code, out = run(capsys, "--json", "+dataset=mychar", "model=random_tiny", f"model_cache={tmp_path / 'mc'}")
    doc = json.loads(out)
    assert set(doc) == {"ok", "exit_code", "counts", "device", "speed", "checks"}
    assert doc["device"]["family"] == "cpu" and doc["speed"] is False
    for row in doc["checks"]:
        assert set(row) == {"check", "status", "evidence", "fix", "group", "data"}
        assert row["status"] in STATUSES and row["evidence"]
        assert row["fix"] or row["status"] != "fail"
    assert sum(doc["counts"].values()) == len(doc["checks"])
    checks = [r["check"] for r in doc["checks"]]
    expected = "gpu|driver|torch build|bf16 matmul|fp8 matmul|power limit|kernels for card|attention|kernels|"
    expected += "sd-scripts|sd-scripts deps|"
    expected += "model: flux|model: ae|model: clip_l|model: t5xxl|disk|env: allocator|env: other|config"
    assert checks == expected.split("|")
    failed = [r for r in doc["checks"] if r["status"] == "fail"]
    assert code == 0 and doc["ok"] is True and doc["exit_code"] == 0, failed


def test_a_failing_check_exits_1(machine, capsys, tmp_path):
    code, out = run(capsys, "--json", f"model.flux={tmp_path / 'missing.safetensors'}")
    doc = json.loads(out)
    rows = {r["check"]: r for r in doc["checks"]}
    assert rows["model: flux"]["status"] == "fail"
    assert code == 1 and doc["exit_code"] == 1 and doc["ok"] is False


def test_warnings_alone_exit_0(machine, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("CUDA_LAUNCH_BLOCKING", "1")
    code, out = run(capsys, "--json", "model=random_tiny", f"model_cache={tmp_path / 'mc'}")
    rows = {r["check"]: r for r in json.loads(out)["checks"]}
    assert rows["env: other"]["status"] == "warn"
    assert code == 0


def test_the_table_shows_check_status_evidence_fix_and_a_summary(machine, capsys, tmp_path):
    code, out = run(capsys, f"model.flux={tmp_path / 'missing.safetensors'}")
    lines = out.splitlines()
    assert lines[0].startswith("flux-train doctor: no CUDA GPU")
    header = next(line for line in lines if line.startswith("check"))
    assert header.split() == ["check", "status", "evidence", "fix"]
    flux = next(line for line in lines if line.startswith("model: flux"))
    assert "FAIL" in flux and "does not exist" in out and "flux-train setup" in flux
    assert "4 fail" in lines[-1] and "something fails: exit 1" in lines[-1]
    assert code == 1


def test_speed_flag_adds_the_speed_rows(machine, capsys):
    code, out = run(capsys, "--json", "--speed")
    doc = json.loads(out)
    assert doc["speed"] is True
    assert [r["status"] for r in doc["checks"] if r["group"] == "speed"] == ["skip"]  # no GPU here


def test_help_and_unknown_options(machine, capsys):
    assert doctor.doctor_main(["--help"]) == 0
    assert "--speed" in capsys.readouterr().out
    with pytest.raises(ConfigError, match="unknown option --jsn"):
        doctor.doctor_main(["--jsn"])


def test_a_bad_override_is_bad_input(machine):
    with pytest.raises(ConfigError):
        doctor.doctor_main(["model=no_such_model"])


def test_a_check_that_crashes_is_a_warning_row_not_an_exception(compose, monkeypatch):
    def boom(cfg):
        raise ZeroDivisionError("doctor bug")

    monkeypatch.setattr(doctor_disk, "disk_check", boom)
    rows = {r.check: r for r in doctor.fast_checks(compose(), CPU, env={})}
    assert rows["disk"].status == "warn" and "ZeroDivisionError: doctor bug" in rows["disk"].evidence
    assert "model: flux" in rows  # the others still ran


def test_fast_checks_is_the_subset_training_runs(compose):
    rows = doctor.fast_checks(compose("model=random_tiny"), CPU, env={})
    groups = {r.group for r in rows}
    assert groups == {"gpu", "sd-scripts", "models", "disk", "env"}
    assert {r.check for r in rows} >= {"torch build", "sd-scripts", "sd-scripts deps", "model: flux", "env: allocator"}


def test_exit_code_and_worst():
    rows = [CheckResult("a", "pass", "x"), CheckResult("b", "warn", "y", "z"), CheckResult("c", "skip", "w")]
    assert exit_code(rows) == 0 and worst(r.status for r in rows) == "warn"
    rows.append(CheckResult("d", "fail", "v", "u"))
    assert exit_code(rows) == 1 and worst(r.status for r in rows) == "fail"
    with pytest.raises(ValueError):
        CheckResult("e", "ok", "no such status")


def test_json_is_valid_even_with_nan_numbers():
    rows = [CheckResult("attention: x", "fail", "wrong", "fix", "attention", {"max_rel_err": float("nan")})]
    doc = json.loads(doctor.render_json(rows, CPU))  # strict JSON has no NaN
    assert doc["checks"][0]["data"]["max_rel_err"] is None


def test_a_named_card_gets_a_row_with_its_tier_and_kernels(machine, capsys, tmp_path):
    """`flux-train doctor hardware=rtx4090` on a machine without it: this machine's rows, and one for the named card
    (the tier memory=auto would pick there, the kernels it gets, chosen by capability: a warning, not a failure)."""
    code, out = run(capsys, "--json", "model=random_tiny", "hardware=rtx4090", f"model_cache={tmp_path / 'mc'}")
    rows = {r["check"]: r for r in json.loads(out)["checks"]}
    row = rows["hardware=rtx4090"]
    assert row["status"] == "warn" and row["data"]["tier"] == "vram24" and "fp8_matmul" in row["data"]["kernels"]
    assert "NVIDIA GeForce RTX 4090 (sm_89)" in row["evidence"] and code == 0
    _, out = run(capsys, "--json", "model=random_tiny", f"model_cache={tmp_path / 'mc'}")
    assert not any(r["check"].startswith("hardware=") for r in json.loads(out)["checks"])
