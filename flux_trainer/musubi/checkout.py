"""Find, verify and import a musubi-tuner checkout (FLUX.2 klein / dev and FLUX.1 Kontext train there).

Order: the `musubi_tuner` config key, then $FLUX_TRAIN_MUSUBI_TUNER, then <cache>/musubi-tuner, as for sd-scripts
(flux_trainer.backend.checkout). A folder without `src/musubi_tuner/flux_2_train_network.py` is an error; another
commit than the pinned one is a warning naming both. musubi-tuner is a package under `src/`: the checkout's `src`
goes first on sys.path (this process) or PYTHONPATH (its caching scripts), never an installed copy.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
import types
from collections.abc import Iterator, Mapping
from pathlib import Path

from flux_trainer.backend import checkout as pinned
from flux_trainer.backend.checkout import Checkout
from flux_trainer.config.errors import ConfigError

# v0.3.4, 2026-06-24 (Merge pull request #982): the commit flux-train's schema and runner are made against
PINNED_COMMIT = "30c658c4f4b0bf05038b3346eff9670259b10fc7"
REPO_URL = "https://github.com/kohya-ss/musubi-tuner"
ENV_VAR = "FLUX_TRAIN_MUSUBI_TUNER"
PACKAGE_DIR = "src"  # musubi-tuner's package lives in <checkout>/src/musubi_tuner


def repo() -> pinned.PinnedRepo:
    return pinned.PinnedRepo(
        name="musubi-tuner",
        commit=PINNED_COMMIT,
        url=REPO_URL,
        env_var=ENV_VAR,
        config_key="musubi_tuner",
        cache_name="musubi-tuner",
        marker=f"{PACKAGE_DIR}/musubi_tuner/flux_2_train_network.py",
        setup_command="flux-train setup model=flux2_klein_base_4b",
    )


def locate(configured: str | None = None, env: Mapping[str, str] = os.environ) -> Checkout:
    """The first candidate that exists; a named path that is not a musubi-tuner checkout is an error."""
    return pinned.locate(repo(), configured, env)


def commit_warning(checkout: Checkout) -> str | None:
    return pinned.commit_warning(repo(), checkout)


def source_dir(path: Path | str) -> Path:
    """The folder that must be on sys.path for `import musubi_tuner`."""
    return Path(path).resolve() / PACKAGE_DIR


def import_module(path: Path | str, name: str) -> types.ModuleType:
    """`musubi_tuner.<name>` from the checkout at `path` (its src first on sys.path; once per process). Another
    checkout already imported in this process is an error rather than a silent mix of two commits."""
    src = source_dir(path)
    if str(src) not in sys.path:
        sys.path.insert(0, str(src))
    module = importlib.import_module(f"musubi_tuner.{name}")
    package = sys.modules["musubi_tuner"]
    loaded_from = Path(package.__file__).resolve().parent.parent
    if loaded_from != src:
        raise ConfigError(f"musubi-tuner was already imported from {loaded_from}, not {src}; one checkout per process")
    return module


@contextlib.contextmanager
def argv(script: str, args: list[str]) -> Iterator[None]:
    """musubi-tuner's scripts parse `sys.argv` in their `main()`: make it what their own command line would be."""
    saved = sys.argv
    sys.argv = [script, *args]
    try:
        yield
    finally:
        sys.argv = saved
