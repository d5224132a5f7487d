"""`flux-train setup`: get the pinned sd-scripts checkout, and with --models the model files the config names."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from flux_trainer.config import ConfigError
from flux_trainer.sdscripts.checkout import COMMIT_FILE, ENV_VAR, PINNED_COMMIT, REPO_URL, default_location, locate


def clone_commands(dest: Path) -> list[list[str]]:
    """A shallow fetch of exactly the pinned commit (argument lists, never a shell)."""
    return [
        ["git", "init", "-q", str(dest)],
        ["git", "-C", str(dest), "fetch", "-q", "--depth", "1", REPO_URL, PINNED_COMMIT],
        ["git", "-C", str(dest), "checkout", "-q", "FETCH_HEAD"],
    ]


def manual_steps(dest: Path) -> str:
    return (
        f"get sd-scripts by hand, then point flux-train at it:\n"
        f"  git clone {REPO_URL} {dest}\n  git -C {dest} checkout {PINNED_COMMIT}\n"
        f"or, on a machine without git, download the archive of commit {PINNED_COMMIT[:10]}, unpack it to {dest} "
        f"and write the commit id into {dest / COMMIT_FILE};\n"
        f"elsewhere: export FLUX_TRAIN_SD_SCRIPTS=/path/to/sd-scripts (or sd_scripts=PATH)"
    )


def setup_sd_scripts(dest: Path | None = None, configured: str | None = None) -> Path:
    """An existing checkout (sd_scripts key, $FLUX_TRAIN_SD_SCRIPTS, the cache folder) is used as is."""
    if dest is None:
        try:
            found = locate(configured)
        except ConfigError:
            if configured or os.environ.get(ENV_VAR):
                raise
        else:
            state = (
                "the pinned commit" if found.pinned else f"commit {found.commit or 'unknown'}, not {PINNED_COMMIT[:10]}"
            )
            print(f"sd-scripts: using {found.path} ({state}, from {found.source})")
            return found.path
    dest = dest or default_location()
    if shutil.which("git") is None:
        raise ConfigError("git is not installed; " + manual_steps(dest))
    dest.parent.mkdir(parents=True, exist_ok=True)
    print(f"fetching sd-scripts {PINNED_COMMIT[:10]} into {dest} ...")
    for cmd in clone_commands(dest):
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            shutil.rmtree(dest, ignore_errors=True)
            raise ConfigError(f"`{' '.join(cmd)}` failed ({result.stderr.strip()[-200:]}); " + manual_steps(dest))
    print(f"sd-scripts ready at {dest}")
    return dest


def download_models(cfg) -> dict[str, Path]:
    """Each model file the config names, from its hub repo into the configured path (resumable)."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    got = {}
    for part in ("flux", "ae", "clip_l", "t5xxl"):
        target = Path(str(cfg.model[part])).expanduser()
        hub = cfg.model.hub.get(part)
        if target.is_file():
            print(f"{part}: {target} present")
            got[part] = target
            continue
        if not hub or not hub.repo_id:
            raise ConfigError(f"model.{part}: {target} is missing and model.hub.{part} names no repository")
        print(f"{part}: {hub.repo_id}/{hub.filename} -> {target}")
        try:
            path = hf_hub_download(repo_id=hub.repo_id, filename=hub.filename, local_dir=target.parent)
        except GatedRepoError as exc:
            raise ConfigError(
                f"{hub.repo_id} is gated: accept its licence on its hub page while logged in, then "
                f"`huggingface-cli login` here. The hub said: {str(exc).splitlines()[0]}"
            ) from exc
        except RepositoryNotFoundError as exc:
            raise ConfigError(f"{hub.repo_id}: not found or not visible to your hub login ({exc})") from exc
        path = Path(path)
        if path.resolve() != target.resolve():
            path.replace(target)
        got[part] = target
    return got


def setup(models: bool = False, overrides: list[str] | None = None) -> int:
    setup_sd_scripts()
    if models:
        from flux_trainer.config.compose import compose_run

        cfg = compose_run(list(overrides or []))
        if cfg.model.get("random_preset"):
            raise ConfigError(f"model={cfg.model.name} is generated at run time; nothing to download")
        download_models(cfg)
    return 0
