"""flux_kernels.patches.graph_record: cudagraph trees' two alias lookups answered through an index give torch's own
answers (asked on paths of real CPU storages, as torch builds and changes them), the probe rejects lookups that differ,
and install / remove swap torch's methods and put them back."""

from __future__ import annotations

import random

import pytest
import torch
from torch._inductor import cudagraph_trees as cgt

from flux_kernels.patches import graph_record
from tests.conftest import undoing

TORCH = {name: cgt.CUDAGraphNode.__dict__[name] for name in graph_record.METHODS}


class Node:
    def __init__(self, path):
        self.path_weakrefs = path


def ask_both(node, queries):
    for t in queries:
        for name in graph_record.METHODS:
            assert graph_record.OURS[name](node, t) == TORCH[name](node, t), name


@pytest.mark.parametrize("seed", range(4))
def test_a_path_recorded_node_by_node_gets_torchs_answers(seed):
    """As in a recording: each node asks about its inputs and outputs, then its outputs join the path; earlier
    outputs die (their backward ran), some outputs are views of another's storage."""
    rng = random.Random(seed)
    path, alive, queries = [], [], []
    for _ in range(30):
        outs = [torch.randn(rng.randint(2, 5)) for _ in range(rng.randint(0, 8))]
        outs += [o[1:] for o in outs[:2]]  # views: an output aliasing another of the same node
        node = Node(path + [[]])
        ask_both(node, outs + rng.sample(queries, min(len(queries), 10)))
        node.path_weakrefs[-1].extend(cgt.StorageWeakRefWrapper(o) if rng.random() > 0.1 else None for o in outs)
        path = node.path_weakrefs
        alive += outs
        queries += outs[:3]
        for _ in range(rng.randint(0, 4)):  # freed
            if alive:
                alive.pop(rng.randrange(len(alive)))
        ask_both(node, queries[-20:])


def test_a_reference_replaced_in_place_is_seen():
    """torch replaces an output's reference in place (cached tensor outputs): the path keeps its shape."""
    a, b = torch.randn(3), torch.randn(3)
    node = Node([[cgt.StorageWeakRefWrapper(a)]])
    assert graph_record.is_cuda_graph_recorded_tensor(node, a)
    assert not graph_record.is_cuda_graph_recorded_tensor(node, b)
    node.path_weakrefs[0][0] = cgt.StorageWeakRefWrapper(b)
    assert graph_record.is_cuda_graph_recorded_tensor(node, b)
    assert graph_record.is_alias_of_live_recorded_tensor(node, b) == (0, 0)
    assert graph_record.is_alias_of_live_recorded_tensor(node, a) is None


def test_the_first_live_place_is_the_answer_and_dead_ones_still_count_as_recorded():
    a = torch.randn(4)
    dead = cgt.StorageWeakRefWrapper(torch.randn(4))
    dead._data_ptr = a.untyped_storage().data_ptr()  # a freed output whose address a now holds
    node = Node([[None, dead], [cgt.StorageWeakRefWrapper(a), cgt.StorageWeakRefWrapper(a[2:])]])
    assert (
        graph_record.is_alias_of_live_recorded_tensor(node, a[1:])
        == (1, 0)
        == TORCH["_is_alias_of_live_recorded_tensor"](node, a[1:])
    )
    lone = Node([[dead]])
    assert graph_record.is_alias_of_live_recorded_tensor(lone, a) is None
    assert graph_record.is_cuda_graph_recorded_tensor(lone, a) and TORCH["_is_cuda_graph_recorded_tensor"](lone, a)


def _last_live(self, t):
    found = None
    for depth, level in enumerate(self.path_weakrefs):
        for i, ref in enumerate(level):
            if cgt.maybe_deref(ref) is not None and ref.data_ptr() == t.untyped_storage().data_ptr():
                found = (depth, i)
    return found


def _any_place(self, t):  # liveness ignored
    for depth, level in enumerate(self.path_weakrefs):
        for i, ref in enumerate(level):
            if ref is not None and ref.data_ptr() == t.untyped_storage().data_ptr():
                return depth, i
    return None


@pytest.mark.parametrize(
    ("name", "wrong"),
    [
        ("_is_alias_of_live_recorded_tensor", _last_live),
        ("_is_alias_of_live_recorded_tensor", _any_place),
        ("_is_cuda_graph_recorded_tensor", lambda self, t: _last_live(self, t) is not None),  # live ones only
    ],
)
def test_the_probe_rejects_lookups_that_answer_otherwise(name, wrong):
    assert graph_record.probe() == (True, "")
    ok, why = graph_record.probe({**TORCH, name: wrong})
    assert not ok and why.startswith(name)


def test_the_probe_rejects_a_torch_whose_methods_read_more_than_the_path():
    def reads_more(self, t):
        return self.live_indices_after_graph

    ok, why = graph_record.probe({**TORCH, "_is_cuda_graph_recorded_tensor": reads_more})
    assert not ok and "does not take the probe (AttributeError" in why


def test_install_patches_torch_once_and_remove_puts_its_methods_back(monkeypatch):
    removed = []
    with undoing(lambda: removed.append(graph_record.remove())):
        assert graph_record.install() == "CUDA graph recording: indexed alias lookups"
        assert graph_record.install() == "CUDA graph recording: indexed alias lookups"  # once
        for name in graph_record.METHODS:
            assert cgt.CUDAGraphNode.__dict__[name] is graph_record.OURS[name]
    assert removed == [True]
    assert not graph_record.remove()
    for name in graph_record.METHODS:
        assert cgt.CUDAGraphNode.__dict__[name] is TORCH[name]
    monkeypatch.setattr(graph_record, "probe", lambda: (False, "an answer differs"))
    assert graph_record.install() == "CUDA graph recording: torch's own lookups (probe failed: an answer differs)"
    assert (
        not graph_record.installed()
        and cgt.CUDAGraphNode.__dict__["_is_cuda_graph_recorded_tensor"] is TORCH["_is_cuda_graph_recorded_tensor"]
    )


def test_the_probe_draws_nothing_from_the_runs_random_streams():
    """sd-scripts' shuffled DataLoader seeds itself from torch's global generator when it starts iterating, after the
    kernels are installed: a probe that drew from it gave kernels=auto other batches than kernels=off."""
    torch.manual_seed(5)
    random.seed(5)
    before, py_before = torch.get_rng_state(), random.getstate()
    assert graph_record.probe() == (True, "")
    assert torch.equal(torch.get_rng_state(), before) and random.getstate() == py_before
