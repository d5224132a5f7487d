"""musubi-tuner's checkout is found and verified like sd-scripts' (config key, environment, cache; commit file)."""

from __future__ import annotations

import pytest

from flux_trainer.backend.checkout import COMMIT_FILE
from flux_trainer.config import ConfigError
from flux_trainer.musubi import checkout


def fake_checkout(root, commit=None):
    (root / "src" / "musubi_tuner").mkdir(parents=True)
    (root / "src" / "musubi_tuner" / "flux_2_train_network.py").write_text("")
    if commit:
        (root / COMMIT_FILE).write_text(commit + "\n")
    return root


def test_the_pinned_commit_is_the_full_id():
    assert len(checkout.PINNED_COMMIT) == 40 and checkout.PINNED_COMMIT.startswith("30c658c")


def test_order_config_then_env_then_cache(tmp_path):
    conf = fake_checkout(tmp_path / "conf", checkout.PINNED_COMMIT)
    envd = fake_checkout(tmp_path / "envd")
    cache = fake_checkout(tmp_path / "cache" / "musubi-tuner")
    env = {"FLUX_TRAIN_MUSUBI_TUNER": str(envd), "FLUX_TRAIN_CACHE": str(tmp_path / "cache")}
    found = checkout.locate(str(conf), env)
    assert (found.path, found.source, found.pinned) == (conf.resolve(), "config", True)
    assert checkout.commit_warning(found) is None
    found = checkout.locate(None, env)
    assert (found.path, found.source, found.commit) == (envd.resolve(), "env", None)
    assert "unknown commit" in checkout.commit_warning(found)
    found = checkout.locate(None, {"FLUX_TRAIN_CACHE": str(tmp_path / "cache")})
    assert (found.path, found.source) == (cache.resolve(), "cache")


def test_another_commit_is_a_warning_naming_both(tmp_path):
    found = checkout.locate(str(fake_checkout(tmp_path / "m", "0" * 40)), {})
    msg = checkout.commit_warning(found)
    assert "0" * 40 in msg and checkout.PINNED_COMMIT in msg


def test_a_folder_that_is_not_a_checkout_is_refused(tmp_path):
    (tmp_path / "other").mkdir()
    with pytest.raises(ConfigError, match="musubi-tuner: .* has no src/musubi_tuner/flux_2_train_network.py"):
        checkout.locate(str(tmp_path / "other"), {})
    with pytest.raises(ConfigError, match=r"FLUX_TRAIN_MUSUBI_TUNER.*does not exist"):
        checkout.locate(None, {"FLUX_TRAIN_MUSUBI_TUNER": str(tmp_path / "nope")})
    with pytest.raises(ConfigError, match="musubi-tuner not found .*`flux-train setup model=flux2_klein_base_4b`"):
        checkout.locate(None, {"FLUX_TRAIN_CACHE": str(tmp_path / "empty")})


def test_setup_fetches_the_pinned_commit_when_absent(tmp_path, monkeypatch):
    from flux_trainer.commands import setup as setup_cmd

    ran = []
    monkeypatch.setenv("FLUX_TRAIN_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("FLUX_TRAIN_MUSUBI_TUNER", raising=False)
    monkeypatch.setattr(
        setup_cmd.subprocess, "run", lambda cmd, **k: ran.append(cmd) or type("R", (), {"returncode": 0})()
    )
    dest = setup_cmd.setup_checkout(checkout.repo())
    assert dest == tmp_path / "cache" / "musubi-tuner"
    assert ["git", "-C", str(dest), "fetch", "-q", "--depth", "1", checkout.REPO_URL, checkout.PINNED_COMMIT] in ran
