"""`flux-train setup --models` against a local stand-in for the hub's file API (tests/fake_hub.py).

The command runs in a child process, as a user runs it: huggingface_hub reads HF_ENDPOINT when it is
imported, so pointing the real client at the fake hub means setting it before the child starts. Nothing
here touches the network; HF_HOME is a temporary folder, so no real login is seen.
"""

from __future__ import annotations

import fcntl
import os
import pty
import random
import re
import socket
import struct
import subprocess
import sys
import termios
import threading
from pathlib import Path

import pytest

from flux_trainer.config import ConfigError
from flux_trainer.config.compose import compose_run
from flux_trainer.sdscripts.checkout import COMMIT_FILE, PINNED_COMMIT
from tests.fake_hub import FakeHub, FakeRepo

REPO_ROOT = Path(__file__).resolve().parents[2]
GATED = "fake-bfl/FLUX.1-fake"
OPEN = "fake-org/text-encoders"
TOKEN = "hf_fake_accepted_licence"


def blob(seed: int, size: int) -> bytes:
    return random.Random(seed).randbytes(size)


CONTENT = {
    # over two of the hub client's 10 MiB read chunks: a break keeps only whole chunks, so a smaller file
    # broken off half-way would leave nothing to resume from
    "flux1-dev.safetensors": blob(1, 2 * 10 * 2**20 + 12_345),
    "ae.safetensors": blob(2, 40_000),
    "clip_l.safetensors": blob(3, 20_000),
    "t5/t5xxl_fp16.safetensors": blob(4, 60_000),  # in a subfolder of the repo, as hub layouts often are
}


@pytest.fixture
def hub():
    repos = {
        GATED: FakeRepo(
            {k: CONTENT[k] for k in ("flux1-dev.safetensors", "ae.safetensors")}, gated=True, tokens=frozenset({TOKEN})
        ),
        # small git files rather than LFS: the client's other way of reading size and ETag
        OPEN: FakeRepo({k: CONTENT[k] for k in ("clip_l.safetensors", "t5/t5xxl_fp16.safetensors")}, lfs=False),
    }
    with FakeHub(repos) as fake:
        yield fake


def targets(tmp_path: Path) -> dict[str, Path]:
    models = tmp_path / "models"
    return {
        "flux": models / "flux1-dev.safetensors",
        "ae": models / "ae.safetensors",
        "clip_l": models / "clip_l.safetensors",
        "t5xxl": tmp_path / "encoders" / "my-t5.safetensors",  # not the hub's name, not the hub's folder
    }


SERVED = {
    "flux": "flux1-dev.safetensors",
    "ae": "ae.safetensors",
    "clip_l": "clip_l.safetensors",
    "t5xxl": "t5/t5xxl_fp16.safetensors",
}


def overrides(tmp_path: Path) -> list[str]:
    paths = [f"model.{part}={path}" for part, path in targets(tmp_path).items()]
    return [
        "model=flux_dev",
        *paths,
        f"model.hub.flux.repo_id={GATED}",
        f"model.hub.ae.repo_id={GATED}",
        f"model.hub.clip_l.repo_id={OPEN}",
        f"model.hub.t5xxl.repo_id={OPEN}",
        "model.hub.t5xxl.filename=t5/t5xxl_fp16.safetensors",
    ]


def child_env(tmp_path: Path, endpoint: str, token: str | None) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("HF_", "HUGGING", "FLUX_TRAIN_", "TQDM_")) and "proxy" not in k.lower()
    }
    checkout = tmp_path / "sd-scripts"
    checkout.mkdir(exist_ok=True)
    (checkout / "flux_train_network.py").write_text("# stand-in checkout: setup only looks for this file\n")
    (checkout / COMMIT_FILE).write_text(PINNED_COMMIT)
    env.update(
        HF_ENDPOINT=endpoint,
        HF_HOME=str(tmp_path / "hf-home"),
        HF_HUB_DISABLE_TELEMETRY="1",
        NO_PROXY="127.0.0.1,localhost",
        FLUX_TRAIN_CACHE=str(tmp_path / "cache"),
        FLUX_TRAIN_SD_SCRIPTS=str(checkout),
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
    )
    if token:
        env["HF_TOKEN"] = token
    return env


def run_setup(tmp_path: Path, endpoint: str, token: str | None = None, terminal: bool = False):
    """`flux-train setup --models ...` in a child; with `terminal`, its stderr is a pseudo-terminal, as in a
    user's shell (tqdm draws no bar into a pipe). Returns (exit code, stdout, stderr)."""
    cmd = [sys.executable, "-m", "flux_trainer.cli", "setup", "--models", *overrides(tmp_path)]
    env = child_env(tmp_path, endpoint, token)
    if not terminal:
        r = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
        return r.returncode, r.stdout, r.stderr
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))  # a new pty is 0 columns wide
    chunks: list[bytes] = []

    def drain() -> None:
        while True:
            try:
                data = os.read(master, 4096)
            except OSError:  # EIO: the child closed its end
                return
            if not data:
                return
            chunks.append(data)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=slave)
    os.close(slave)
    out, _ = proc.communicate(timeout=120)
    reader.join(timeout=10)
    os.close(master)
    return proc.returncode, out.decode(), b"".join(chunks).decode(errors="replace")


def error_lines(stderr: str) -> list[str]:
    assert "Traceback" not in stderr, stderr
    return [line for line in stderr.splitlines() if line.startswith("flux-train: error:")]


def test_downloads_all_four_parts_to_exactly_the_configured_paths(tmp_path, hub):
    code, out, err = run_setup(tmp_path, hub.url, token=TOKEN, terminal=True)

    assert code == 0, out + err
    for part, path in targets(tmp_path).items():
        assert path.read_bytes() == CONTENT[SERVED[part]], part
    # only the files: no hub bookkeeping (.cache/huggingface), no staging folder, no repo subfolder (t5/)
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == [
        "ae.safetensors",
        "clip_l.safetensors",
        "flux1-dev.safetensors",
    ]
    assert [p.name for p in (tmp_path / "encoders").iterdir()] == ["my-t5.safetensors"]
    # the user's own login went with the requests to the gated repo
    gated = [s for s in hub.requests if s.path.startswith(f"/{GATED}/")]
    assert gated and all(s.authorization == f"Bearer {TOKEN}" for s in gated)
    # the large files came from the CDN address the hub redirected to, the small ones from resolve/
    assert any(s.method == "GET" and s.path.startswith("/cdn/") for s in hub.seen("flux1-dev.safetensors"))
    # the hub client's progress bar, drawn on the terminal
    assert re.search(r"flux1-dev\.safetensors.*100%", err), err
    assert "models ready: flux=" in out


@pytest.mark.parametrize(
    "token, status_words",
    [
        (None, ["not logged in", "Please log in."]),
        ("hf_someone_without_access", ["has no access", "you are not in the authorized list"]),
    ],
)
def test_gated_repo_says_what_to_do_in_one_line(tmp_path, hub, token, status_words):
    code, out, err = run_setup(tmp_path, hub.url, token=token)

    assert code == 2, out + err
    (line,) = error_lines(err)
    assert f"{GATED} is gated" in line
    assert f"accept its licence at {hub.url}/{GATED}" in line
    assert "huggingface-cli login" in line and "HF_TOKEN" in line
    for words in status_words:
        assert words in line, line
    # the other repository's files still came; the gated repo was asked once, not once per file
    paths = targets(tmp_path)
    assert paths["clip_l"].is_file() and paths["t5xxl"].is_file()
    assert not paths["flux"].exists() and not paths["ae"].exists()
    assert [s.method for s in hub.requests if s.path.startswith(f"/{GATED}/")] == ["HEAD"]


def test_a_broken_off_download_resumes_with_a_range_request(tmp_path, hub):
    data = CONTENT["flux1-dev.safetensors"]
    hub.truncate_once.add("flux1-dev.safetensors")

    code, out, err = run_setup(tmp_path, hub.url, token=TOKEN)

    assert code == 1, out + err
    (line,) = error_lines(err)
    assert "broke off" in line and "run the same command again to resume" in line
    flux = targets(tmp_path)["flux"]
    assert not flux.exists()  # never a half file at the configured path
    (partial,) = (flux.parent / ".flux-train-download").rglob("*.incomplete")
    kept = partial.stat().st_size
    assert 0 < kept < len(data)
    assert f"with {kept / 1e6:.1f} MB saved" in line

    first = len(hub.requests)
    code, out, err = run_setup(tmp_path, hub.url, token=TOKEN)

    assert code == 0, out + err
    assert "flux: resuming" in out
    assert flux.read_bytes() == data
    flux_requests = hub.seen("flux1-dev.safetensors")
    gets = [s for s in hub.requests[first:] if s.method == "GET" and s in flux_requests]
    assert [s.range for s in gets] == [f"bytes={kept}-"]  # continued, not started again


def test_files_already_present_are_skipped_without_asking_the_hub(tmp_path, hub):
    paths = targets(tmp_path)
    for part in ("flux", "t5xxl"):
        paths[part].parent.mkdir(parents=True, exist_ok=True)
        paths[part].write_bytes(b"the user's own copy")

    code, out, err = run_setup(tmp_path, hub.url, token=TOKEN)

    assert code == 0, out + err
    assert hub.seen("flux1-dev.safetensors") == [] and hub.seen("t5xxl_fp16.safetensors") == []
    assert paths["flux"].read_bytes() == paths["t5xxl"].read_bytes() == b"the user's own copy"
    assert paths["ae"].read_bytes() == CONTENT["ae.safetensors"]
    assert paths["clip_l"].read_bytes() == CONTENT["clip_l.safetensors"]
    assert f"flux: {paths['flux']} present, skipped" in out


def test_no_network_is_one_line_naming_the_hub_and_the_cause(tmp_path):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        endpoint = f"http://127.0.0.1:{s.getsockname()[1]}"

    code, out, err = run_setup(tmp_path, endpoint)

    assert code == 1, out + err
    (line,) = error_lines(err)
    assert f"cannot reach the hub at {endpoint} (Connection refused)" in line
    assert "HTTPS_PROXY or HF_ENDPOINT" in line


def test_random_presets_refuse_before_anything_else(tmp_path, monkeypatch):
    from flux_trainer.commands import setup as setup_cmd

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(setup_cmd, "setup_sd_scripts", lambda *a, **k: pytest.fail("cloned before refusing"))
    for preset in ("random", "random_tiny", "random_chroma", "random_chroma_tiny"):
        with pytest.raises(ConfigError, match=f"model={preset} is random weights .* nothing to download"):
            setup_cmd.setup(models=True, overrides=[f"model={preset}"])


def test_every_missing_hub_entry_is_reported_at_once(tmp_path, monkeypatch):
    from flux_trainer.commands.setup import plan_downloads

    monkeypatch.chdir(tmp_path)
    cfg = compose_run([*overrides(tmp_path), "model.hub.flux.repo_id=", "model.hub.clip_l.filename="], [])
    with pytest.raises(ConfigError) as info:
        plan_downloads(cfg)
    assert [p.split(":")[0] for p in info.value.problems] == ["model.flux", "model.clip_l"]
    assert "model.hub.flux.repo_id=OWNER/NAME" in info.value.problems[0]


def test_chroma_downloads_three_files_and_no_clip_l(tmp_path, monkeypatch):
    from flux_trainer.commands.setup import plan_downloads

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("FLUX_TRAIN_MODEL_DIR", str(tmp_path / "models"))
    todo, present = plan_downloads(compose_run(["model=chroma"], []))
    assert present == {}
    assert [(f.part, f.repo_id, f.target.name) for f in todo] == [
        ("flux", "lodestones/Chroma1-Base", "Chroma1-Base.safetensors"),
        ("ae", "black-forest-labs/FLUX.1-schnell", "ae.safetensors"),
        ("t5xxl", "comfyanonymous/flux_text_encoders", "t5xxl_fp16.safetensors"),
    ]
