"""single_process_reduce: sd-scripts' per-parameter gradient all-reduce left out where there is one process."""

from __future__ import annotations

import importlib
import logging
from types import SimpleNamespace

import pytest
import torch

from flux_kernels.ops import single_process


class Trainer:
    """The method the kernel wraps, recording its calls (sd-scripts' NetworkTrainer has it as a method)."""

    def __init__(self) -> None:
        self.calls = []

    def all_reduce_network(self, accelerator, network):
        self.calls.append((accelerator, network))


def test_one_process_skips_the_reduce_more_processes_run_it_and_uninstall_restores_it():
    trainer = Trainer()
    line = single_process.install(trainer)
    assert line.startswith("single_process_reduce:")
    one, two, network = SimpleNamespace(num_processes=1), SimpleNamespace(num_processes=2), object()
    trainer.all_reduce_network(one, network)
    assert trainer.calls == []
    trainer.all_reduce_network(two, network)
    assert trainer.calls == [(two, network)]
    assert single_process.install(trainer) == "single_process_reduce: already installed"
    assert single_process.uninstall(trainer) and not single_process.uninstall(trainer)
    trainer.all_reduce_network(one, network)
    assert trainer.calls == [(two, network), (one, network)]
    assert "all_reduce_network" not in trainer.__dict__  # the class's method again, not a leftover wrapper


def test_sd_scripts_reduce_on_one_process_is_an_identity_that_the_kernel_skips(fm):
    """With sd-scripts' own all_reduce_network and accelerate's reduce on one (CPU) process: the gradients it
    produces equal the ones it was given, bit for bit, but are copies; installed, the same tensors stay."""
    from accelerate import Accelerator

    train_network = importlib.import_module("train_network")
    trainer = train_network.NetworkTrainer()
    accelerator = Accelerator(cpu=True)
    net = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Linear(5, 3)).to(torch.bfloat16)
    net(torch.randn(4, 7, dtype=torch.bfloat16)).float().square().sum().backward()
    grads = [p.grad for p in net.parameters()]
    trainer.all_reduce_network(accelerator, net)
    after = [p.grad for p in net.parameters()]
    assert all(torch.equal(a, g) and a is not g for a, g in zip(after, grads, strict=True))
    single_process.install(trainer)
    trainer.all_reduce_network(accelerator, net)
    assert all(p.grad is a for p, a in zip(net.parameters(), after, strict=True))


def test_the_probe_passes_here_and_fails_where_dividing_by_one_is_not_exact(monkeypatch):
    from flux_kernels.runtime import registry

    spec = registry.REGISTRY["single_process_reduce"]
    assert spec.target == "trainer"
    result = registry.probe(spec, "cpu")
    assert result.ok and "bit for bit" in result.reason
    real = torch.Tensor.__itruediv__

    def flushing(self, other):  # a device that flushes subnormals to zero in the division
        out = real(self, other)
        tiny = torch.finfo(out.dtype).smallest_normal
        return out.masked_fill_(out.abs() < tiny, 0)

    monkeypatch.setattr(torch.Tensor, "__itruediv__", flushing)
    result = registry.probe(spec, "cpu")
    assert not result.ok and "dividing by one process changes the gradient" in result.reason


def test_runner_installs_it_under_auto_and_not_when_left_out(caplog):
    from flux_kernels.runtime.errors import KernelError
    from flux_trainer.sdscripts.hooks import install_trainer_kernels

    trainer = Trainer()
    with caplog.at_level(logging.INFO, logger="flux_trainer.runner"):
        assert install_trainer_kernels(trainer, {"set": "auto"}) == ["single_process_reduce"]
    assert "flux_kernels installed single_process_reduce" in caplog.text
    assert install_trainer_kernels(Trainer(), {"set": "auto,-single_process_reduce"}) == []
    assert install_trainer_kernels(Trainer(), {"set": "off"}) == []
    assert install_trainer_kernels(Trainer(), {"set": "prodigy_step"}) == []  # not a trainer kernel
    with pytest.raises(KernelError, match="has no all_reduce_network; remove single_process_reduce from kernels="):
        install_trainer_kernels(object(), {"set": "single_process_reduce"})
