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


class Moved:
    """A model stand-in that records where sd-scripts moves it."""

    def __init__(self, moves: list, name: str):
        self.moves, self.name, self.device, self.dtype = moves, name, "cpu", "bf16"

    def to(self, *args, **kwargs):
        self.moves.append((self.name, args, kwargs))
        return self


@pytest.mark.parametrize("on_disk", [True, False])
def test_the_runner_moves_no_model_when_all_is_on_disk_and_meets_the_same_barriers(monkeypatch, tmp_path, on_disk):
    """Through the runner's trainer class on sd-scripts' own FluxNetworkTrainer: with every output on disk nothing is
    moved; otherwise sd-scripts' path moves the text encoders as before. Both pass the same number of barriers (ranks
    taking different paths would otherwise wait on each other forever)."""
    import contextlib

    from flux_trainer.sdscripts import checkout as sd_checkout
    from flux_trainer.sdscripts.runner import RunnerSpec, make_trainer_class

    try:
        mods = sd_checkout.import_sd_scripts(sd_checkout.locate(None).path)
    except Exception as e:  # noqa: BLE001 - not found, or not importable here
        pytest.skip(f"sd-scripts not importable: {e}")
    strategy = Strategy(ALL if on_disk else ALL - {"/d/b_te.npz"})
    monkeypatch.setattr(
        mods.train_util.TextEncoderOutputsCachingStrategy, "get_strategy", staticmethod(lambda: strategy)
    )
    barriers, moves, checked = [], [], []
    accelerator = SimpleNamespace(
        device="cpu",
        num_processes=1,
        process_index=0,
        wait_for_everyone=lambda: barriers.append(1),
        autocast=contextlib.nullcontext,
    )
    dataset = group(["/d/a.png", "/d/b.png"], ["/e/c.png"])
    dataset.new_cache_text_encoder_outputs = lambda models, acc: checked.append(models) or acc.wait_for_everyone()
    trainer = make_trainer_class(mods, RunnerSpec(sd_scripts="", train_toml="", dataset_toml=""), tmp_path)()
    encoders = [Moved(moves, "clip_l"), Moved(moves, "t5xxl")]
    args = SimpleNamespace(**ARGS, lowram=False, seed=None, train_text_encoder=False, network_train_unet_only=True)
    trainer.cache_text_encoder_outputs_if_needed(
        args, accelerator, Moved(moves, "flux"), Moved(moves, "ae"), encoders, dataset, "bf16"
    )
    assert checked == [encoders]  # the dataset's own check ran either way (it records the files training reads)
    assert len(barriers) == 2
    if on_disk:
        assert moves == []
    else:  # sd-scripts' own path: T5 to the device and back, the FLUX model out of the way and back
        names = [name for name, *_ in moves]
        assert names.count("t5xxl") >= 2 and names.count("flux") == 2 and moves[-1][0] in ("flux", "ae")
