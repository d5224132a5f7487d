"""`setup --models --captioner`'s download against the local stand-in hub (tests/fake_hub.py), in a child process as
in test_setup_models (huggingface_hub reads HF_ENDPOINT when imported): the listed files, the optional ones the
repository has, the shards its index names, each renamed into place whole; a second run asks for nothing."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from tests.fake_hub import FakeHub, FakeRepo
from tests.unit.test_setup_models import blob, child_env

REPO = "fake-org/tiny-captioner"
SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
INDEX = {"metadata": {}, "weight_map": {"a.weight": SHARDS[0], "b.weight": SHARDS[1], "c.weight": SHARDS[1]}}
FILES = {
    "config.json": b'{"model_type": "qwen2_5_vl"}',
    "tokenizer.json": b"{}",
    "model.safetensors.index.json": json.dumps(INDEX).encode(),
    SHARDS[0]: blob(11, 30_000),
    SHARDS[1]: blob(12, 20_000),
    "chat_template.json": b'{"chat_template": "{{ messages }}"}',
}

DRIVER = textwrap.dedent(
    """
    import sys
    from pathlib import Path

    from flux_trainer.caption.models import CaptionerSpec, missing_files
    from flux_trainer.commands.setup import download_captioner

    spec = CaptionerSpec("tiny-fake", "qwen2_5_vl", sys.argv[1], "main",
                         ("config.json", "tokenizer.json", "model.safetensors.index.json"),
                         ("chat_template.json", "chat_template.jinja"), 0.0, 0.0, 8, "test")
    folder = Path(sys.argv[2])
    download_captioner(spec, folder)
    print("missing:", missing_files(spec, folder))
    """
)


def download(tmp_path, url: str):
    env = child_env(tmp_path, url, None)
    cmd = [sys.executable, "-c", DRIVER, REPO, str(tmp_path / "captioner")]
    return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


def test_a_captioner_downloads_its_files_and_the_shards_its_index_names(tmp_path):
    with FakeHub({REPO: FakeRepo(FILES)}) as hub:
        first = download(tmp_path, hub.url)
        asked = len(hub.requests)
        second = download(tmp_path, hub.url)

    assert first.returncode == 0, first.stdout + first.stderr
    assert "missing: []" in first.stdout
    folder = tmp_path / "captioner"
    # every file whole, the optional one the repository lacks skipped, no staging folder left behind
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == FILES
    assert any(s.path.endswith("/chat_template.jinja") for s in hub.requests)  # asked for, not there: skipped
    assert second.returncode == 0 and "missing: []" in second.stdout
    # present files are not asked for again; only the optional file the repository lacks is
    assert all(s.path.endswith("/chat_template.jinja") for s in hub.requests[asked:]), hub.requests[asked:]


def test_a_missing_repository_is_one_line_naming_the_captioner(tmp_path):
    with FakeHub({}) as hub:
        result = download(tmp_path, hub.url)

    assert result.returncode != 0
    assert "captioner tiny-fake (repo_id fake-org/tiny-captioner): no such repository" in result.stderr
    assert not (tmp_path / "captioner" / "config.json").exists()
