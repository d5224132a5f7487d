"""When every text-encoder output is on disk, the runner lets sd-scripts' dataset check its files without moving the
models there and back (te_cache.all_on_disk decides, with sd-scripts' caching strategy)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from flux_trainer.sdscripts.te_cache import all_on_disk


class Strategy:
    """sd-scripts' TextEncoderOutputsCachingStrategy's two questions, over a set of files said to exist."""

    def __init__(self, on_disk: set[str], cache_to_disk: bool = True):
        self.on_disk, self.cache_to_disk, self.asked = on_disk, cache_to_disk, []

    def get_outputs_npz_path(self, image_path: str) -> str:
        return image_path.rsplit(".", 1)[0] + "_te.npz"

    def is_disk_cached_outputs_expected(self, npz: str) -> bool:
        self.asked.append(npz)
        return npz in self.on_disk


def group(*datasets: list[str]) -> SimpleNamespace:
    members = [SimpleNamespace(image_data={p: SimpleNamespace(absolute_path=p) for p in paths}) for paths in datasets]
    return SimpleNamespace(datasets=members)


ARGS = dict(cache_text_encoder_outputs=True, cache_text_encoder_outputs_to_disk=True, sample_prompts=None)
ALL = {"/d/a_te.npz", "/d/b_te.npz", "/e/c_te.npz"}


def test_every_image_of_every_dataset_must_have_its_file():
    dataset = group(["/d/a.png", "/d/b.png"], ["/e/c.png"])
    strategy = Strategy(ALL)
    assert all_on_disk(SimpleNamespace(**ARGS), dataset, strategy)
    assert sorted(strategy.asked) == sorted(ALL)  # each image asked about, in both datasets
    assert not all_on_disk(SimpleNamespace(**ARGS), dataset, Strategy(ALL - {"/e/c_te.npz"}))  # the second's missing


@pytest.mark.parametrize(
    "change",
    [
        {"cache_text_encoder_outputs": False},  # encoded at every step: the encoders go to the GPU
        {"cache_text_encoder_outputs_to_disk": False},  # cached in memory: encoded at every start
        {"sample_prompts": "/run/sample_prompts.txt"},  # sd-scripts encodes the sample prompts there too
    ],
)
def test_anything_left_to_encode_keeps_sd_scripts_own_path(change):
    dataset = group(["/d/a.png", "/d/b.png"], ["/e/c.png"])
    assert not all_on_disk(SimpleNamespace(**{**ARGS, **change}), dataset, Strategy(ALL))


def test_no_dataset_or_no_disk_strategy_keeps_sd_scripts_own_path():
    dataset = group(["/d/a.png"])
    assert not all_on_disk(SimpleNamespace(**ARGS), None, Strategy(ALL))
    assert not all_on_disk(SimpleNamespace(**ARGS), dataset, None)
    assert not all_on_disk(SimpleNamespace(**ARGS), dataset, Strategy(ALL, cache_to_disk=False))
