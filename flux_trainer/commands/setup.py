"""`flux-train setup`: get the pinned sd-scripts checkout, and with --models the model files the config names."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from flux_trainer.backend import MUSUBI, backend_for
from flux_trainer.backend import checkout as pinned
from flux_trainer.config import ConfigError
from flux_trainer.config.random_specs import parts_for
from flux_trainer.musubi import checkout as musubi_checkout
from flux_trainer.sdscripts.checkout import PINNED_COMMIT, REPO_URL
from flux_trainer.sdscripts.checkout import repo as sd_repo


def _sd_scripts_repo() -> pinned.PinnedRepo:
    """sd-scripts with this module's URL and commit (tests point them at a local stand-in repository)."""
    return dataclasses.replace(sd_repo(), url=REPO_URL, commit=PINNED_COMMIT)


def clone_commands(dest: Path) -> list[list[str]]:
    """A shallow fetch of exactly the pinned sd-scripts commit (argument lists, never a shell)."""
    return pinned.clone_commands(_sd_scripts_repo(), dest)


def manual_steps(dest: Path) -> str:
    return pinned.manual_steps(_sd_scripts_repo(), dest)


def setup_sd_scripts(dest: Path | None = None, configured: str | None = None) -> Path:
    """An existing checkout (sd_scripts key, $FLUX_TRAIN_SD_SCRIPTS, the cache folder) is used as is."""
    return setup_checkout(_sd_scripts_repo(), dest, configured)


def setup_checkout(repo: pinned.PinnedRepo, dest: Path | None = None, configured: str | None = None) -> Path:
    """A trainer's pinned checkout: an existing one (its config key, its environment variable, the cache folder) is
    used as is; else exactly the pinned commit is fetched into the cache folder, or the manual steps are named."""
    if dest is None:
        try:
            found = pinned.locate(repo, configured)
        except ConfigError:
            if configured or os.environ.get(repo.env_var):
                raise
        else:
            other = f"commit {found.commit or 'unknown'}, not {repo.commit[:10]}"
            state = "the pinned commit" if found.pinned else other
            print(f"{repo.name}: using {found.path} ({state}, from {found.source})")
            return found.path
    dest = dest or pinned.default_location(repo)
    if shutil.which("git") is None:
        raise ConfigError("git is not installed; " + pinned.manual_steps(repo, dest))
    dest.parent.mkdir(parents=True, exist_ok=True)
    print(f"fetching {repo.name} {repo.commit[:10]} into {dest} ...")
    for cmd in pinned.clone_commands(repo, dest):
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            shutil.rmtree(dest, ignore_errors=True)
            raise ConfigError(
                f"`{' '.join(cmd)}` failed ({result.stderr.strip()[-200:]}); " + pinned.manual_steps(repo, dest)
            )
    print(f"{repo.name} ready at {dest}")
    return dest


# Beside each target, so the finished file is renamed into place (never copied) and a partial download
# survives for the next run to resume. The hub client's own bookkeeping (.cache/huggingface, the
# `.incomplete` file, repo subfolders) stays in here and is removed once the file is in place.
STAGING_DIR = ".flux-train-download"


class DownloadError(ConfigError):
    """The network or the hub failed, not the user's input: exit code 1, still one line."""

    exit_code = 1


@dataclass(frozen=True)
class ModelFile:
    part: str
    target: Path
    repo_id: str
    filename: str
    revision: str | None = None  # None: the hub's default branch
    source: str = ""  # what named this file, for messages; "" : the config's model.hub.<part>

    @property
    def staging(self) -> Path:
        return self.target.parent / STAGING_DIR / self.target.name

    def setting(self, key: str) -> str:
        """The setting behind `key` ("repo_id", "filename") and its value, as a message names it."""
        value = getattr(self, key)
        return f"{self.source} ({key} {value})" if self.source else f"model.hub.{self.part}.{key}={value}"


def plan_downloads(cfg) -> tuple[list[ModelFile], dict[str, Path]]:
    """What to fetch and what is already there; every config problem found at once, before any request."""
    if cfg.model.get("random_preset"):
        raise ConfigError(
            f"model={cfg.model.name} is random weights generated at run time; nothing to download "
            "(for real weights: model=flux_dev, model=flux_schnell or model=chroma)"
        )
    todo, present, problems = [], {}, []
    claimed: dict[Path, ModelFile] = {}
    for part in parts_for(cfg.model.get("model_type", "flux")):
        target = Path(str(cfg.model[part])).expanduser().absolute()
        if target.is_file():
            present[part] = target
            continue
        hub = cfg.model.hub.get(part)
        if not hub or not hub.repo_id or not hub.filename:
            problems.append(
                f"model.{part}: {target} is missing and model.hub.{part} names no repository and file; "
                f"set model.hub.{part}.repo_id=OWNER/NAME model.hub.{part}.filename=FILE, or put the file there"
            )
            continue
        wanted = ModelFile(part, target, hub.repo_id, hub.filename)
        other = claimed.get(target)
        if other is None:
            claimed[target] = wanted
            todo.append(wanted)
        elif (other.repo_id, other.filename) != (wanted.repo_id, wanted.filename):
            problems.append(
                f"model.{part} and model.{other.part} are both {target} but name different hub files "
                f"({wanted.repo_id}/{wanted.filename}, {other.repo_id}/{other.filename}); give each its own path"
            )
    if problems:
        raise ConfigError(problems)
    return todo, present


def download_models(cfg) -> dict[str, Path]:
    """Each model file the config names, from its hub repository to exactly the configured path.

    Through `hf_hub_download` with the user's own hub login (HF_TOKEN or the saved token) and the hub's
    progress bar. A broken-off download resumes from its `.incomplete` file on the next run (an HTTP
    Range request; for repos on the hub's Xet storage, hf_xet's chunk cache does that job instead).
    A repository that fails (gated, not found) is reported and the other files are still fetched; a
    network failure stops at once. Either way every problem is raised together, one line each.
    """
    todo, present = plan_downloads(cfg)
    for part, target in present.items():
        print(f"{part}: {target} present, skipped")
    problems: list[str] = []
    failed_repos: set[str] = set()
    for f in todo:
        if f.repo_id in failed_repos:
            continue
        try:
            download_one(f)
        except DownloadError as exc:
            raise DownloadError([*problems, *exc.problems]) from exc
        except ConfigError as exc:
            problems.extend(exc.problems)
            if repo_wide(exc.__cause__):
                failed_repos.add(f.repo_id)  # its other files would fail the same way
    if problems:
        raise ConfigError(problems)
    parts = parts_for(cfg.model.get("model_type", "flux"))
    return {part: Path(str(cfg.model[part])).expanduser().absolute() for part in parts}


def download_one(f: ModelFile) -> Path:
    from huggingface_hub import constants, hf_hub_download

    print(f"{f.part}: {f.repo_id}/{f.filename} -> {f.target}", flush=True)
    partial = partial_bytes(f.staging)
    if partial:
        note = " (HF_HUB_ENABLE_HF_TRANSFER is set: the hub client restarts it from zero)"
        print(
            f"{f.part}: resuming, {human(partial)} already here" + (note if constants.HF_HUB_ENABLE_HF_TRANSFER else "")
        )
    try:
        fetched = Path(
            hf_hub_download(repo_id=f.repo_id, filename=f.filename, revision=f.revision, local_dir=f.staging)
        )
    except KeyboardInterrupt:
        print(f"{f.part}: interrupted; run the same command again to resume", file=sys.stderr)
        raise
    except Exception as exc:
        error = explain_hub_error(exc, f)
        if error is None:
            raise
        raise error from exc
    fetched.replace(f.target)  # same folder tree, so a rename: the target only ever appears complete
    shutil.rmtree(f.staging, ignore_errors=True)
    with contextlib.suppress(OSError):
        f.staging.parent.rmdir()  # only when no other file is still part-way
    return f.target


def explain_hub_error(exc: BaseException, f: ModelFile) -> ConfigError | None:
    """One line naming what failed and what to do, for what `hf_hub_download` raises; None: not ours to explain."""
    import requests
    from huggingface_hub import constants, get_token
    from huggingface_hub.errors import (
        EntryNotFoundError,
        FileMetadataError,
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
    )

    what = f"{f.part}: {f.repo_id}/{f.filename}"
    page = f"{constants.ENDPOINT}/{f.repo_id}"
    login = "`hf auth login` or `huggingface-cli login` (or HF_TOKEN in the environment)"
    if isinstance(exc, GatedRepoError):
        said = one_line(exc.server_message or str(exc).splitlines()[-1])
        if get_token() is None:
            return ConfigError(
                f"{f.repo_id} is gated and you are not logged in to the hub: accept its licence at {page} while "
                f"logged in, log in here with {login}, and run this again. The hub said: {said}"
            )
        return ConfigError(
            f"{f.repo_id} is gated and your hub login has no access to it: accept its licence at {page} with that "
            f"account, or log in as one that has with {login}, and run this again. The hub said: {said}"
        )
    if isinstance(exc, RepositoryNotFoundError):
        return ConfigError(
            f"{f.setting('repo_id')}: no such repository on {constants.ENDPOINT}, or it is private "
            f"and your hub login cannot see it; check the name, or log in with {login}"
        )
    if isinstance(exc, LocalEntryNotFoundError):  # the first request failed, before any byte moved
        cause = exc.__cause__
        if constants.HF_HUB_OFFLINE:
            return DownloadError(f"{what}: HF_HUB_OFFLINE is set; unset it to download, or put the file at {f.target}")
        if isinstance(cause, HfHubHTTPError) and cause.response is not None:
            return DownloadError(
                f"{what}: the hub at {constants.ENDPOINT} answered {cause.response.status_code}; "
                "try again later (its status page says whether it is down)"
            )
        if isinstance(cause, FileMetadataError):
            return DownloadError(
                f"{what}: {constants.ENDPOINT} does not answer like the hub ({one_line(str(cause))}); "
                "check HF_ENDPOINT and any proxy in between"
            )
        return DownloadError(
            f"{what}: cannot reach the hub at {constants.ENDPOINT} ({reason(cause)}); check the network, "
            f"HTTPS_PROXY or HF_ENDPOINT and run this again, or put the file at {f.target} yourself"
        )
    if isinstance(exc, EntryNotFoundError):
        return ConfigError(f"{f.setting('filename')}: {f.repo_id} has no such file (see {page})")
    if isinstance(exc, HfHubHTTPError) and exc.response is not None:
        status = exc.response.status_code
        if status == 401:
            return ConfigError(f"{what}: the hub refused your token (401); log in again with {login}")
        return DownloadError(f"{what}: the hub answered {status} {saved(f)}; run the same command again to resume")
    if isinstance(exc, requests.RequestException):
        return DownloadError(
            f"{what}: the download broke off ({reason(exc)}) {saved(f)}; run the same command again to resume"
        )
    if isinstance(exc, OSError) and "Consistency check failed" in str(exc):
        shutil.rmtree(f.staging, ignore_errors=True)
        return DownloadError(
            f"{what}: the file arrived with the wrong size, so the partial download was removed; run this again"
        )
    return None


def repo_wide(exc: BaseException | None) -> bool:
    """Gated, missing or refused: true of every file in that repository."""
    from huggingface_hub.errors import EntryNotFoundError, HfHubHTTPError, RepositoryNotFoundError

    if isinstance(exc, RepositoryNotFoundError):
        return True
    return (
        isinstance(exc, HfHubHTTPError)
        and not isinstance(exc, EntryNotFoundError)
        and exc.response is not None
        and exc.response.status_code in (401, 403)
    )


def partial_bytes(staging: Path) -> int:
    """Bytes of a broken-off download the hub client will resume from (its `.incomplete` file)."""
    return max((p.stat().st_size for p in staging.rglob("*.incomplete")), default=0) if staging.is_dir() else 0


def saved(f: ModelFile) -> str:
    n = partial_bytes(f.staging)
    return f"with {human(n)} saved" if n else "before any byte was saved"


def human(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n} B"


def one_line(text: str) -> str:
    return " ".join(text.split())


def reason(exc: BaseException | None) -> str:
    """The useful end of a requests error chain: "Connection refused", not three lines of pool internals."""
    if exc is None:
        return "no answer"
    text = str(exc)
    if "IncompleteRead" in text or "Connection broken" in text:
        return "the connection dropped"
    m = re.search(r"\[Errno -?\d+\] ([^'\")\]]+)", text) or re.search(r"(Read timed out)", text)
    return one_line(m.group(1)) if m else type(exc).__name__


def setup(models: bool = False, overrides: list[str] | None = None) -> int:
    """The pinned checkout of the trainer the configured model trains on (sd-scripts for FLUX.1 and Chroma, the
    default; musubi-tuner for FLUX.2 and Kontext: `flux-train setup model=flux2_klein_base_4b`); with `models`, also
    the model files the composed config names. One trainer, not both: a FLUX.1 user is never made to fetch the
    other (and a machine that can reach only one of them sets up)."""
    from flux_trainer.config.compose import compose_run

    cfg = compose_run(list(overrides or []))
    if models:
        plan_downloads(cfg)  # bad model config or a random preset: fail before cloning anything
    if backend_for(str(cfg.model.get("model_type", "flux"))) == MUSUBI:
        setup_checkout(musubi_checkout.repo())
    else:
        setup_sd_scripts()
    if models:
        got = download_models(cfg)
        print("models ready: " + ", ".join(f"{part}={path}" for part, path in got.items()))
    return 0


def download_captioner(spec, folder: Path) -> Path:
    """A captioner's files into `folder`, each through `download_one` (resumable, renamed into place whole): its
    listed files, those of its optional ones the repository has, then the weight shards its index names."""
    from huggingface_hub.errors import EntryNotFoundError

    from flux_trainer.caption.models import INDEX, missing_files, shard_names

    def fetch(filename: str, optional: bool = False) -> None:
        f = ModelFile(spec.name, folder / filename, spec.repo_id, filename, spec.revision, f"captioner {spec.name}")
        if f.target.is_file():
            return
        f.target.parent.mkdir(parents=True, exist_ok=True)
        try:
            download_one(f)
        except ConfigError as exc:
            if not (optional and isinstance(exc.__cause__, EntryNotFoundError)):
                raise
            shutil.rmtree(f.staging, ignore_errors=True)  # not in this repository: nothing to keep
            with contextlib.suppress(OSError):
                f.staging.parent.rmdir()

    for name in spec.files:
        fetch(name)
    for name in spec.optional:
        fetch(name, optional=True)
    for name in shard_names(folder / INDEX):
        fetch(name)
    missing = missing_files(spec, folder)
    if missing:
        raise DownloadError(f"captioner {spec.name}: {', '.join(missing)} still missing in {folder}; run this again")
    return folder


def setup_captioner(name: str | None, overrides: list[str] | None = None) -> int:
    """`setup --models --captioner [NAME]`: that captioner only (random_tiny: built here, nothing downloaded)."""
    from flux_trainer.caption.models import captioner_dir, resolve

    if overrides:
        raise ConfigError(f"setup --captioner takes no config overrides (got {' '.join(overrides)}); run them apart")
    spec = resolve(name)
    folder = captioner_dir(spec)
    if not spec.downloads:
        from flux_trainer.caption.tiny import ensure_random_tiny

        ensure_random_tiny(folder)
        print(f"{spec.name}: built at {folder} (random weights, nothing to download)")
        return 0
    print(f"captioner {spec.name}: {spec.repo_id} (about {spec.bf16_gb:g} GB) -> {folder}")
    download_captioner(spec, folder)
    print(f"captioner ready: {spec.name} at {folder}")
    return 0
