"""A pinned git checkout of a trainer, found and verified the same way for every backend.

Each backend (sd-scripts, musubi-tuner) describes its trainer once as a `PinnedRepo`: the commit, where it comes
from, the environment variable and config key that name a checkout, and a file only a checkout of it has. The order
is the same for all: the config key, then the environment variable, then `<cache>/<cache_name>`. A named folder that
is not a checkout is an error; another commit than the pinned one is a warning naming both. A checkout without
`.git` (an exported archive, `flux-train setup` where git could not fetch) names its commit in `COMMIT_FILE`.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from flux_trainer.config.errors import ConfigError
from flux_trainer.config.paths import cache_root

# Written by `flux-train setup` (and by anyone exporting a commit without .git) so the commit stays known.
COMMIT_FILE = ".flux-train-commit"


@dataclass(frozen=True)
class PinnedRepo:
    """One trainer's checkout: what flux-train is tested with and how a user names another one."""

    name: str  # as a user reads it: "sd-scripts", "musubi-tuner"
    commit: str  # the full pinned commit id
    url: str
    env_var: str
    config_key: str  # the run config's key (sd_scripts=PATH, musubi_tuner=PATH)
    cache_name: str  # the folder under flux-train's cache
    marker: str  # a file only a checkout of this repository has, relative to its root
    setup_command: str = "flux-train setup"  # what fetches it (setup gets the configured model's trainer)


@dataclass(frozen=True)
class Checkout:
    path: Path
    source: str  # "config" | "env" | "cache"
    commit: str | None
    pinned_commit: str = ""

    @property
    def pinned(self) -> bool:
        return self.commit == self.pinned_commit


def default_location(repo: PinnedRepo, env: Mapping[str, str] = os.environ) -> Path:
    return cache_root(env) / repo.cache_name


def candidates(repo: PinnedRepo, configured: str | None, env: Mapping[str, str] = os.environ) -> list[tuple[str, Path]]:
    found = []
    if configured:
        found.append(("config", Path(configured).expanduser()))
    if env.get(repo.env_var):
        found.append(("env", Path(env[repo.env_var]).expanduser()))
    found.append(("cache", default_location(repo, env)))
    return found


def checkout_commit(path: Path) -> str | None:
    """The commit of a checkout: `git rev-parse HEAD`, else the commit file an export left, else None."""
    path = Path(path)
    if (path / ".git").exists():
        try:
            out = subprocess.run(
                ["git", "-C", str(path), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10, check=True
            )
            return out.stdout.strip()
        except (OSError, subprocess.SubprocessError):
            pass
    marker = path / COMMIT_FILE
    if marker.is_file():
        return marker.read_text().strip() or None
    return None


def describe_source(repo: PinnedRepo, source: str) -> str:
    return {"config": f"the {repo.config_key} config key", "env": f"${repo.env_var}", "cache": "the cache folder"}[
        source
    ]


def locate(repo: PinnedRepo, configured: str | None = None, env: Mapping[str, str] = os.environ) -> Checkout:
    """The first candidate that exists. A named path (config or env) that is not a checkout is an error."""
    tried = []
    for source, path in candidates(repo, configured, env):
        if not path.exists():
            if source != "cache":
                raise ConfigError(
                    f"{repo.name}: {path} (from {describe_source(repo, source)}) does not exist; point it at a "
                    f"checkout of {repo.url} or run `{repo.setup_command}`"
                )
            tried.append(str(path))
            continue
        if not (path / repo.marker).is_file():
            raise ConfigError(
                f"{repo.name}: {path} (from {describe_source(repo, source)}) has no {repo.marker}, so it is not a "
                f"checkout of {repo.name}; check out {repo.url} at {repo.commit[:10]} there or run "
                f"`{repo.setup_command}`"
            )
        return Checkout(path=path.resolve(), source=source, commit=checkout_commit(path), pinned_commit=repo.commit)
    raise ConfigError(
        f"{repo.name} not found (looked at {', '.join(tried)}); run `{repo.setup_command}`, or set {repo.env_var} "
        f"or {repo.config_key}=PATH to a checkout of {repo.url} at {repo.commit[:10]}"
    )


def commit_warning(repo: PinnedRepo, checkout: Checkout) -> str | None:
    if checkout.commit == repo.commit:
        return None
    have = checkout.commit or f"an unknown commit (no .git and no {COMMIT_FILE})"
    return (
        f"{repo.name} at {checkout.path} is {have}, flux-train is tested with {repo.commit}; "
        f"flags may differ (`git -C {checkout.path} checkout {repo.commit[:10]}`)"
    )


def clone_commands(repo: PinnedRepo, dest: Path) -> list[list[str]]:
    """A shallow fetch of exactly the pinned commit (argument lists, never a shell)."""
    return [
        ["git", "init", "-q", str(dest)],
        ["git", "-C", str(dest), "fetch", "-q", "--depth", "1", repo.url, repo.commit],
        ["git", "-C", str(dest), "checkout", "-q", "FETCH_HEAD"],
    ]


def manual_steps(repo: PinnedRepo, dest: Path) -> str:
    return (
        f"get {repo.name} by hand, then point flux-train at it:\n"
        f"  git clone {repo.url} {dest}\n  git -C {dest} checkout {repo.commit}\n"
        f"or, on a machine without git, download the archive of commit {repo.commit[:10]}, unpack it to {dest} "
        f"and write the commit id into {dest / COMMIT_FILE};\n"
        f"elsewhere: export {repo.env_var}=/path/to/{repo.cache_name} (or {repo.config_key}=PATH)"
    )
