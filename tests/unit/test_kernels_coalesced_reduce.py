"""coalesced_reduce: the LoRA gradients averaged over processes by one all-reduce per dtype, not one per tensor."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from flux_kernels.ops import coalesced_reduce, single_process
from flux_kernels.runtime import registry
from tests.conftest import check_two_process_reduce


def _params(seed: int, shapes=((8, 12), (12, 8), (5,), (8, 3, 1, 1)), dtypes=None, without_grad=(2,)):
    gen = torch.Generator().manual_seed(seed)
    dtypes = dtypes or [torch.float32] * len(shapes)
    out = []
    for i, (shape, dtype) in enumerate(zip(shapes, dtypes, strict=True)):
        p = nn.Parameter(torch.randn(shape, generator=gen).to(dtype))
        if i not in without_grad:
            p.grad = (torch.randn(shape, generator=gen) + 0.5).to(dtype)
        out.append(p)
    return out


class Accelerator:
    """Two processes' mean, as an elementwise stand-in: this process's values and a fixed other's."""

    num_processes = 2

    def __init__(self) -> None:
        self.reduced = []

    def reduce(self, t, reduction="mean"):
        assert reduction == "mean"
        self.reduced.append(t.numel())
        return (t + (t * 0.25 + 1)) / 2


def test_one_reduce_per_dtype_gives_each_gradient_its_per_tensor_reduce_as_a_view_of_one_buffer():
    dtypes = [torch.float32, torch.bfloat16, torch.float32, torch.float32]
    params = _params(0, dtypes=dtypes)
    acc = Accelerator()
    expected = [None if p.grad is None else acc.reduce(p.grad) for p in params]
    acc.reduced.clear()
    assert coalesced_reduce.reduce_grads(acc.reduce, params) == 2
    assert acc.reduced == [8 * 12 + 8 * 3, 12 * 8]  # the fp32 tensors with gradients, then the bf16 one
    for p, e in zip(params, expected, strict=True):
        if e is None:
            assert p.grad is None
            continue
        assert p.grad.shape == p.shape and p.grad.dtype == p.dtype and torch.equal(p.grad, e)
    fp32 = [p.grad for p in params if p.grad is not None and p.dtype == torch.float32]
    assert fp32[0].untyped_storage().data_ptr() == fp32[1].untyped_storage().data_ptr()  # one buffer per dtype


def test_installed_it_reduces_once_per_dtype_with_several_processes_and_leaves_one_process_to_the_method_it_wraps():
    class Trainer:
        def __init__(self) -> None:
            self.calls = 0

        def all_reduce_network(self, accelerator, network):
            self.calls += 1

    trainer = Trainer()
    single_process.install(trainer)
    line = coalesced_reduce.install(trainer)
    assert line.startswith("coalesced_reduce: with more than one process")
    network = nn.Sequential(nn.Linear(6, 4), nn.Linear(4, 3))
    network(torch.randn(2, 6)).square().sum().backward()
    before = [p.grad.clone() for p in network.parameters()]
    acc = Accelerator()
    trainer.all_reduce_network(acc, network)
    assert trainer.calls == 0 and acc.reduced == [sum(g.numel() for g in before)]
    assert all(torch.equal(p.grad, acc.reduce(g)) for p, g in zip(network.parameters(), before, strict=True))
    one = SimpleNamespace(num_processes=1)
    grads = [p.grad for p in network.parameters()]
    trainer.all_reduce_network(one, network)  # single_process_reduce's: nothing to do on one process
    assert trainer.calls == 0 and all(p.grad is g for p, g in zip(network.parameters(), grads, strict=True))
    assert coalesced_reduce.install(trainer) == "coalesced_reduce: already installed"
    assert coalesced_reduce.uninstall(trainer) and not coalesced_reduce.uninstall(trainer)
    assert single_process.uninstall(trainer) and "all_reduce_network" not in trainer.__dict__
    trainer.all_reduce_network(acc, network)
    assert trainer.calls == 1


def test_sparse_gradients_go_to_the_method_it_wraps():
    class Trainer:
        calls = 0

        def all_reduce_network(self, accelerator, network):
            type(self).calls += 1

    trainer = Trainer()
    coalesced_reduce.install(trainer)
    emb = nn.Embedding(10, 4, sparse=True)
    emb(torch.tensor([1, 3])).sum().backward()
    trainer.all_reduce_network(Accelerator(), emb)
    assert Trainer.calls == 1 and emb.weight.grad.is_sparse


def test_it_applies_only_beside_other_processes_and_its_probe_catches_a_wrong_layout(monkeypatch):
    spec = registry.REGISTRY["coalesced_reduce"]
    assert spec.target == "trainer" and spec.in_auto
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert registry.select("auto", "cpu", target="trainer").installed == ("single_process_reduce",)
    ok, why = spec.applies("cpu")
    assert not ok and "one process" in why
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert registry.select("auto", "cpu", target="trainer").installed == ("single_process_reduce", "coalesced_reduce")
    result = registry.probe(spec, "cpu")
    assert result.ok and "bit for bit" in result.reason
    real = coalesced_reduce.reduce_grads

    def off_by_one(reduce, params):  # a layout bug: every view one element further into the buffer
        n = real(reduce, params)
        for p in params:
            if p.grad is not None:
                base = p.grad.reshape(-1)
                p.grad = torch.roll(base, 1).view_as(p)
        return n

    monkeypatch.setattr(coalesced_reduce, "reduce_grads", off_by_one)
    result = registry.probe(spec, "cpu")
    assert not result.ok and "differs from its per-tensor reduce" in result.reason


def test_two_processes_through_accelerate_get_sd_scripts_own_averages_bit_for_bit(fm, tmp_path):
    """Two CPU processes (gloo, loopback) with accelerate's Accelerator: sd-scripts' per-tensor all_reduce_network
    and the coalesced one give the same gradients, bit for bit (two processes' sums do not depend on order), and
    both are the mean of the two processes' gradients."""
    check_two_process_reduce(tmp_path, cuda=False)
