"""network=lokr | network=loha (LyCORIS through sd-scripts' trainer): the network_args LyCORIS reads, the refusals,
and that flux-train's LoRA kernels leave a LyCORIS network alone."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import tomli

from flux_trainer.cli import main
from flux_trainer.config import ConfigError
from flux_trainer.config import validate as validate_module
from flux_trainer.config.validate import LYCORIS, validate
from flux_trainer.sdscripts.parser_schema import check_training_keys, load_schema
from flux_trainer.sdscripts.translate import RunPaths, translate

HAVE_LYCORIS = importlib.util.find_spec("lycoris") is not None


def _train_keys(cfg) -> dict:
    return translate(cfg, RunPaths(Path("/runs/x")))[0].flat()


@pytest.mark.parametrize(
    ("network", "args", "dim"),
    [("lokr", ["algo=lokr", "factor=16", "conv_dim=0"], 16), ("loha", ["algo=loha", "conv_dim=0"], 8)],
)
def test_lycoris_networks_translate_to_lycoris_kohya(network, args, dim, compose):
    flat = _train_keys(compose("+dataset=mychar", f"network={network}"))
    assert flat["network_module"] == "lycoris.kohya" and flat["network_dim"] == dim
    # sd-scripts splits each string on the first '=' and passes the pair to create_network as a keyword
    assert flat["network_args"] == args
    assert check_training_keys(flat, load_schema()["flags"]) == []


def test_lora_flux_args_unchanged_by_the_new_keys(compose):
    assert _train_keys(compose("+dataset=mychar"))["network_args"] == ["train_blocks=all"]


def test_lokr_factor_override_reaches_the_args(compose):
    assert "factor=8" in _train_keys(compose("+dataset=mychar", "network=lokr", "network.factor=8"))["network_args"]


def _problems(cfg) -> list[str]:
    with pytest.raises(ConfigError) as info:
        validate(cfg)
    return info.value.problems


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (
            ["network=lokr", "network.train_blocks=single"],
            "network.train_blocks=single: not supported with network=lokr",
        ),
        (["network=loha", "network.split_qkv=true"], "network.split_qkv=True: not supported with network=loha"),
        (["network=lokr", "network.loraplus_lr_ratio=4"], "network.loraplus_lr_ratio=4.0: not supported"),
        (["network=loha", "network.factor=8"], "network.factor=8: a LoKr setting; network=loha has none"),
        (["network.factor=8"], "network.factor=8: a LoKr setting; use network=lokr"),
        (["network=lokr", "network.algo=locon"], "network.algo=locon: choose network=lokr or network=loha"),
        (["network=lokr", "network.module=networks.lora_flux"], "needs network.module=lycoris.kohya"),
    ],
)
def test_lycoris_options_it_does_not_have_are_refused(overrides, needle, compose):
    problems = _problems(compose("+dataset=mychar", "model=random_tiny", *overrides))
    assert any(needle in p for p in problems), problems


@pytest.mark.parametrize("network", ["lokr", "loha"])
def test_without_lycoris_refused_in_one_line_naming_the_install(network, workdir, capsys, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        validate_module.importlib.util, "find_spec", lambda name, *a: None if name == "lycoris" else real(name, *a)
    )
    assert main(["+dataset=mychar", f"network={network}", "dry_run=true"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert f"network={network} needs LyCORIS" in err and f"pip install {LYCORIS}" in err, err
    assert not (workdir / "runs").exists()


@pytest.mark.skipif(not HAVE_LYCORIS, reason=f"needs LyCORIS: pip install {LYCORIS}")
@pytest.mark.parametrize("network", ["lokr", "loha"])
def test_with_lycoris_the_network_validates(network, compose):
    validate(compose("+dataset=mychar", "model=random_tiny", f"network={network}"))


def test_the_extra_pins_the_release_the_refusal_names():
    pyproject = tomli.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    assert pyproject["project"]["optional-dependencies"]["lycoris"] == [LYCORIS]


@pytest.mark.skipif(not HAVE_LYCORIS, reason=f"needs LyCORIS: pip install {LYCORIS}")
@pytest.mark.parametrize("algo", ["lokr", "loha"])
def test_lora_kernels_skip_a_lycoris_network(algo):
    """lora_grad_norms and lora_fold read lora_flux's lora_up/lora_down; on LyCORIS modules `auto` must skip them."""
    import torch
    from lycoris.kohya import create_network

    from flux_kernels.patches import lora_norms
    from flux_kernels.runtime.applies import has_lora, has_wide_lora

    class DoubleStreamBlock(torch.nn.Module):  # LyCORIS matches FLUX's blocks by class name
        def __init__(self):
            super().__init__()
            self.qkv, self.mlp = torch.nn.Linear(64, 192), torch.nn.Linear(64, 512)  # mlp: wide, lora_fold's kind

    model = torch.nn.Sequential(DoubleStreamBlock())
    net = create_network(1.0, 4, 4.0, None, [], model, algo=algo, factor="8", conv_dim="0")
    net.apply_to([], model, apply_text_encoder=False, apply_unet=True)
    wrapped = [lora_norms.wrapper_of(m) for m in (model[0].qkv, model[0].mlp)]
    assert all(w is not None and type(w).__module__.startswith("lycoris") for w in wrapped)  # the network is on
    assert has_lora(model) == (False, "no LoRA module is applied to the model")
    assert has_wide_lora(model)[0] is False
