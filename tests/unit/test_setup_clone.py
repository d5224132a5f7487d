"""`flux-train setup` fetches exactly the pinned commit with git, or says what to do without git."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from flux_trainer.commands import setup as setup_cmd
from flux_trainer.config import ConfigError
from flux_trainer.sdscripts import checkout

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="needs git")


def git(*args, cwd):
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture
def upstream(tmp_path, monkeypatch):
    """A local stand-in for the sd-scripts repository, pinned at its second commit."""
    repo = tmp_path / "upstream"
    repo.mkdir()
    git("init", "-q", cwd=repo)
    (repo / "flux_train_network.py").write_text("# v1\n")
    git("-c", "user.email=t@t", "-c", "user.name=t", "add", ".", cwd=repo)
    git("-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "one", cwd=repo)
    (repo / "flux_train_network.py").write_text("# v2\n")
    git("-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qam", "two", cwd=repo)
    pinned = git("rev-parse", "HEAD", cwd=repo)
    monkeypatch.setattr(setup_cmd, "REPO_URL", str(repo))
    monkeypatch.setattr(setup_cmd, "PINNED_COMMIT", pinned)
    monkeypatch.setattr(checkout, "PINNED_COMMIT", pinned)
    monkeypatch.delenv("FLUX_TRAIN_SD_SCRIPTS", raising=False)
    monkeypatch.setenv("FLUX_TRAIN_CACHE", str(tmp_path / "cache"))
    return repo, pinned


def test_clones_the_pinned_commit_into_the_cache(upstream, tmp_path):
    _, pinned = upstream
    dest = setup_cmd.setup_sd_scripts()
    assert dest == tmp_path / "cache" / "sd-scripts"
    assert (dest / "flux_train_network.py").read_text() == "# v2\n"
    found = checkout.locate()
    assert found.pinned and found.commit == pinned and found.source == "cache"
    assert setup_cmd.setup_sd_scripts() == dest.resolve()  # second call: used as is


def test_failed_fetch_leaves_nothing_and_says_what_to_do(upstream, tmp_path, monkeypatch):
    monkeypatch.setattr(setup_cmd, "REPO_URL", str(tmp_path / "no-such-repo"))
    with pytest.raises(ConfigError) as info:
        setup_cmd.setup_sd_scripts()
    assert "git clone" in str(info.value) and "FLUX_TRAIN_SD_SCRIPTS" in str(info.value)
    assert not (tmp_path / "cache" / "sd-scripts").exists()


def test_existing_env_checkout_is_used_as_is(upstream, tmp_path, monkeypatch, capsys):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "flux_train_network.py").write_text("# mine\n")
    monkeypatch.setenv("FLUX_TRAIN_SD_SCRIPTS", str(mine))
    assert setup_cmd.setup_sd_scripts() == mine.resolve()
    assert "from env" in capsys.readouterr().out
    assert not (tmp_path / "cache" / "sd-scripts").exists()


@pytest.mark.parametrize(
    ("overrides", "fetched"),
    [([], "sd-scripts"), (["model=chroma"], "sd-scripts"), (["model=flux2_klein_base_4b"], "musubi-tuner"),
     (["model=flux_kontext"], "musubi-tuner")],
)  # fmt: skip
def test_setup_fetches_the_configured_models_trainer_only(monkeypatch, overrides, fetched):
    """Plain `flux-train setup` (the default FLUX.1 model) gets sd-scripts alone: a machine that can reach only the
    one trainer it needs sets up; a FLUX.2 / Kontext model gets musubi-tuner alone."""
    from flux_trainer.commands import setup as setup_cmd

    got = []
    monkeypatch.setattr(setup_cmd, "setup_sd_scripts", lambda *a, **k: got.append("sd-scripts"))
    monkeypatch.setattr(setup_cmd, "setup_checkout", lambda repo, *a, **k: got.append(repo.name))
    assert setup_cmd.setup(overrides=overrides) == 0
    assert got == [fetched]
