"""On the GPU: cudagraph trees record a chain of compiled blocks (forwards that save activations, an output that is
the block's own input, an output that is a view of another) with flux_kernels.graph_record's lookups exactly as
with torch's own: the same aliasing bookkeeping on every recorded node, the same losses and gradients, bit for bit.
Also how long the recording step took either way, printed (a timing, not asserted)."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn
from torch._inductor import cudagraph_trees as cgt

from flux_kernels import graph_record

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (CUDA graphs)")]

BLOCKS = 24


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.a = nn.Linear(width, 2 * width)
        self.b = nn.Linear(2 * width, width)

    def forward(self, x):
        h = torch.nn.functional.gelu(self.a(x))
        y = x + self.b(h * torch.sigmoid(h))
        return y, x, y[:, : y.shape[1] // 2]  # the input itself and a view of the output: aliased outputs


def node_book(node) -> tuple:
    """What recording decided about a node from the two lookups (and what follows from them)."""

    def alias(a):
        return type(a).__name__, getattr(a, "index", None)

    return (
        tuple(node.cudagraph_managed_idxs),
        tuple(node.live_cudagraph_managed_path_refs),
        tuple(alias(a) for a in node.output_storage_alias),
        tuple(node.preserved_aliased_inputs),
        tuple(node.unaliased_in_all_paths),
        tuple(t is None for t in node.static_output_tensors),
    )


def all_nodes(manager) -> list:
    found, todo = [], [n for nodes in manager.roots.values() for n in nodes]
    while todo:
        node = todo.pop(0)
        found.append(node)
        todo += [c for kids in node.children.values() for c in kids]
    return found


def train(patched: bool) -> tuple[list, list, list, float]:
    torch._dynamo.reset()
    cgt.reset_cudagraph_trees()
    if patched:
        assert graph_record.install() == "CUDA graph recording: indexed alias lookups"
    try:
        torch.manual_seed(0)
        blocks = nn.ModuleList(Block(96) for _ in range(BLOCKS)).cuda()
        for b in blocks:
            b.compile(mode="reduce-overhead")
        x0 = torch.randn(4, 96, device="cuda")
        losses, record_s = [], 0.0
        for step in range(4):  # warm-up, recording, two replays
            torch.compiler.cudagraph_mark_step_begin()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            x, extra = x0, 0.0
            for b in blocks:
                x, skip, half = b(x)
                extra = extra + (skip.sum() + half.square().sum()) * 1e-3
            loss = x.square().mean() + extra
            loss.backward()
            torch.cuda.synchronize()
            if step == 1:
                record_s = time.perf_counter() - t0
            losses.append(loss.item())
        grads = [p.grad.clone() for p in blocks.parameters()]
        manager = cgt.get_container(torch.cuda.current_device()).tree_manager
        books = [node_book(n) for n in all_nodes(manager)]
        return losses, grads, books, record_s
    finally:
        graph_record.remove()


def test_recording_with_the_index_is_recording_with_torchs_lookups():
    theirs = train(patched=False)
    ours = train(patched=True)
    print(f"\nrecording step, {BLOCKS} blocks: torch's lookups {theirs[3]:.3f} s, indexed {ours[3]:.3f} s")
    assert len(ours[2]) == 2 * BLOCKS, "every block forward and backward recorded as a node"
    assert ours[2] == theirs[2]
    assert any(a[0] == "AliasesPriorGraphOutput" for book in ours[2] for a in book[2]), "no alias was exercised"
    assert ours[0] == theirs[0]
    for a, b in zip(ours[1], theirs[1]):
        assert torch.equal(a, b)
