"""The launcher's check of our TOMLs by sd-scripts' own code: a verdict that passed is kept, so an identical pair of
TOMLs (another run of the same config) does not import sd-scripts again; anything the check reads invalidates it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from flux_trainer.sdscripts import live_check


@pytest.fixture
def setup(tmp_path, monkeypatch):
    checkout = tmp_path / "sd-scripts"
    for rel in ("train_network.py", "library/train_util.py", "networks/lora_flux.py", "venv/lib/site.py"):
        (checkout / rel).parent.mkdir(parents=True, exist_ok=True)
        (checkout / rel).write_text(f"# {rel}\n")
    calls = {"imports": 0, "checks": 0, "problems": []}

    def fake_check(mods, train_toml, dataset_toml):
        assert mods == "modules"
        calls["checks"] += 1
        return list(calls["problems"])

    monkeypatch.setattr(live_check, "live_check", fake_check)

    def modules():
        calls["imports"] += 1
        return "modules"

    def run(run_dir: Path, lr: str = "1e-4") -> list[str]:
        run_dir.mkdir(parents=True, exist_ok=True)
        train, dataset = run_dir / "sd_scripts.toml", run_dir / "dataset.toml"
        train.write_text(f'[a]\noutput_dir = "{run_dir}"\nlearning_rate = {lr}\n')
        dataset.write_text('[[datasets]]\nresolution = 512\n[[datasets.subsets]]\nimage_dir = "/data/x"\n')
        return live_check.checked(modules, checkout, train, dataset, run_dir, tmp_path / "cache" / "checks.json")

    return checkout, calls, run, tmp_path


def test_a_pair_that_passed_is_not_checked_again_in_a_later_run(setup):
    checkout, calls, run, tmp = setup
    assert run(tmp / "runs" / "first") == []
    assert (calls["imports"], calls["checks"]) == (1, 1)
    assert run(tmp / "runs" / "second") == []  # another run dir, the same config: its path is all that differs
    assert (calls["imports"], calls["checks"]) == (1, 1)
    assert run(tmp / "runs" / "third", lr="2e-4") == []  # another value: checked
    assert (calls["imports"], calls["checks"]) == (2, 2)


@pytest.mark.parametrize("changed", ["library/train_util.py", "networks/lora_flux.py", "train_network.py"])
def test_a_changed_checkout_file_is_checked_again_and_a_venv_beside_it_is_not_read(setup, changed):
    checkout, calls, run, tmp = setup
    run(tmp / "runs" / "first")
    venv_file = checkout / "venv" / "lib" / "site.py"
    venv_file.write_text("# changed, and not sd-scripts' code\n")
    run(tmp / "runs" / "second")
    assert calls["checks"] == 1
    f = checkout / changed
    f.write_text(f.read_text() + "# edited\n")
    st = f.stat()
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    run(tmp / "runs" / "third")
    assert calls["checks"] == 2


def test_problems_are_never_kept_and_a_broken_cache_is_an_empty_one(setup):
    checkout, calls, run, tmp = setup
    calls["problems"] = ["sd-scripts' parser refused sd_scripts.toml: ['unrecognized arguments: --x']"]
    assert run(tmp / "runs" / "first") == calls["problems"]
    assert run(tmp / "runs" / "second") == calls["problems"]  # found again, not remembered
    assert calls["checks"] == 2
    cache = tmp / "cache" / "checks.json"
    assert not cache.exists()
    calls["problems"] = []
    run(tmp / "runs" / "third")
    assert cache.is_file()
    cache.write_text("{not json")
    run(tmp / "runs" / "fourth")
    assert calls["checks"] == 4  # unreadable: checked again, and kept anew
    run(tmp / "runs" / "fifth")
    assert calls["checks"] == 4


def test_the_oldest_verdicts_go_first(setup, monkeypatch):
    checkout, calls, run, tmp = setup
    from flux_trainer.backend import verdicts

    monkeypatch.setattr(verdicts, "KEEP", 2)
    for lr in ("1e-4", "2e-4", "3e-4"):
        run(tmp / "runs" / lr, lr=lr)
    assert calls["checks"] == 3
    run(tmp / "runs" / "again-3", lr="3e-4")
    run(tmp / "runs" / "again-2", lr="2e-4")
    assert calls["checks"] == 3
    run(tmp / "runs" / "again-1", lr="1e-4")  # dropped when the third was kept
    assert calls["checks"] == 4


def test_a_second_dry_run_of_the_same_config_does_not_import_sd_scripts(workdir, monkeypatch):
    """Through the launcher with the real checkout: the first run's TOMLs are checked by sd-scripts' own parser
    and validator, the same config's next run is not; a TOML sd-scripts refuses is still refused."""
    from flux_trainer.cli import main
    from flux_trainer.sdscripts import checkout as sd_checkout

    try:
        found = sd_checkout.locate(None)
        real_import = sd_checkout.import_sd_scripts
        real_import(found.path)
    except Exception as e:  # noqa: BLE001 - not found, or not importable here
        pytest.skip(f"sd-scripts not importable: {e}")
    monkeypatch.setenv("FLUX_TRAIN_CACHE", str(workdir / "cache"))  # the verdicts kept here, not in the user's cache
    monkeypatch.setenv("FLUX_TRAIN_SD_SCRIPTS", str(found.path))  # the checkout found above, wherever it was
    imports = []
    monkeypatch.setattr(sd_checkout, "import_sd_scripts", lambda path: imports.append(path) or real_import(path))
    args = ["+dataset=mychar", "dry_run=true", "optimizer=adamw"]
    assert main([*args, "train.output_name=a"]) == 0
    assert len(imports) == 1 and (workdir / "cache" / live_check.CACHE_FILE).is_file()
    assert main([*args, "train.output_name=a"]) == 0
    assert len(imports) == 1
    assert main([*args, "train.output_name=b"]) == 0  # another value in the TOML: checked
    assert len(imports) == 2
    runs = sorted((workdir / "runs" / "a").glob("*/sd_scripts.toml"))
    train = runs[-1]
    train.write_text(train.read_text() + "\n[extra]\nnot_an_sd_scripts_flag = 1\n")
    problems = live_check.checked(
        lambda: real_import(found.path), found.path, train, train.with_name("dataset.toml"), train.parent,
        workdir / "cache" / live_check.CACHE_FILE,
    )  # fmt: skip
    assert problems and "not_an_sd_scripts_flag" in " ".join(problems)
