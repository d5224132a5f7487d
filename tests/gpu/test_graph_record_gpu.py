"""On the GPU: cudagraph trees record a chain of compiled blocks (one compiled function called at 24 places in a
step, forwards saving activations that the backwards read back) with flux_kernels.patches.graph_record's lookups exactly
as with torch's own: the same bookkeeping on every recorded node, the same losses and gradients, bit for bit. Each
way runs in a process of its own (no cudagraph tree or compiled code shared between them). Also how long the
recording step took either way, printed (a timing, not asserted).

The gradients are set to None before each step, as training's zero_grad does: a gradient that AccumulateGrad kept
from a backward graph's output lives in the graphs' memory pool, and adding to it in the next step reads memory the
next replay overwrote (torch raises "accessing tensor output of CUDAGraphs that has been overwritten"). Without it
this test failed so on an H100, with torch's own lookups."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (CUDA graphs)")]

SCRIPT = r"""
import json, sys, time
import torch
from torch import nn
from torch._inductor import cudagraph_trees as cgt
from flux_kernels.patches import graph_record

if sys.argv[1] == "indexed":
    assert graph_record.install() == "CUDA graph recording: indexed alias lookups"

class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.a, self.b = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

    def forward(self, x):
        h = torch.nn.functional.gelu(self.a(x))
        return x + self.b(h * torch.sigmoid(h))

torch.manual_seed(0)
blocks = nn.ModuleList(Block(96) for _ in range(24)).cuda()
for b in blocks:
    b.compile(mode="reduce-overhead")
x0 = torch.randn(4, 96, device="cuda")
losses, record_s = [], 0.0
for step in range(4):  # warm-up, recording, two replays
    for p in blocks.parameters():  # as an optimizer's zero_grad: a gradient is a graph output of its step only
        p.grad = None
    torch.compiler.cudagraph_mark_step_begin()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    x = x0
    for b in blocks:
        x = b(x)
    loss = x.square().mean()
    loss.backward()
    torch.cuda.synchronize()
    if step == 1:
        record_s = time.perf_counter() - t0
    losses.append(loss.item())

def alias(a):
    return [type(a).__name__, getattr(a, "index", None)]

manager = cgt.get_container(torch.cuda.current_device()).tree_manager
nodes, todo = [], [n for ns in manager.roots.values() for n in ns]
while todo:
    node = todo.pop(0)
    nodes.append(node)
    todo += [c for kids in node.children.values() for c in kids]
books = [[list(n.cudagraph_managed_idxs), [list(r) if r else None for r in n.live_cudagraph_managed_path_refs],
          [alias(a) for a in n.output_storage_alias], list(n.preserved_aliased_inputs),
          list(n.unaliased_in_all_paths)] for n in nodes]
grads = [p.grad.float().view(-1).tolist() for p in blocks.parameters()]
from torch._dynamo.utils import counters
print(json.dumps({"losses": losses, "grads": grads, "books": books, "record_s": record_s,
                  "skips": counters["inductor"]["cudagraph_skips"]}))
"""


def record(way: str) -> dict:
    done = subprocess.run([sys.executable, "-c", SCRIPT, way], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_recording_with_the_index_is_recording_with_torchs_lookups():
    theirs, ours = record("torch"), record("indexed")
    print(f"\nrecording step, 24 blocks: torch's lookups {theirs['record_s']:.3f} s, indexed {ours['record_s']:.3f} s")
    assert ours["skips"] == theirs["skips"] == 0, "a block ran without CUDA graphs (TORCH_LOGS=cudagraphs)"
    assert len(ours["books"]) == len(theirs["books"]) >= 48, "every block's forward and backward recorded as a node"
    for i, (a, b) in enumerate(zip(ours["books"], theirs["books"], strict=True)):
        assert a == b, f"node {i}"
    assert any(r for book in ours["books"] for r in book[1]), "no input was found among earlier nodes' outputs"
    assert ours["losses"] == theirs["losses"]
    assert ours["grads"] == theirs["grads"]
