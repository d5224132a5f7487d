"""Shared fixtures: a user's working directory with a dataset config, and composition like the CLI does."""

from __future__ import annotations

from pathlib import Path

import pytest
from PIL import Image

from flux_trainer.config.compose import compose_run


def make_images(folder: Path, n: int = 3, captions: bool = True, size=(96, 64)) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        Image.new("RGB", size, (30 * i, 120, 200 - 20 * i)).save(folder / f"img{i}.png")
        if captions:
            (folder / f"img{i}.txt").write_text(f"a test image number {i}")
    return folder


def write_dataset(config_dir: Path, name: str, images: Path | str, **fields) -> Path:
    import json

    path = config_dir / "dataset" / f"{name}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    body = {"name": name, "images": str(images), **fields}
    path.write_text("\n".join(f"{k}: {json.dumps(v)}" for k, v in body.items()) + "\n")
    return path


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """A user's working directory: ./configs/dataset/mychar.yaml over 3 captioned images; cwd is there."""
    images = make_images(tmp_path / "pics" / "mychar")
    write_dataset(tmp_path / "configs", "mychar", images, trigger="ohwx", resolution=512)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("FLUX_TRAIN_CONFIG_DIR", raising=False)
    return tmp_path


@pytest.fixture
def compose(workdir):
    def _compose(*overrides: str):
        return compose_run(list(overrides), [workdir / "configs"])

    return _compose
