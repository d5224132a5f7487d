"""CUDA graph recording without the quadratic alias search (`kernels.cuda_graphs`, installed by `compile_blocks`).

torch.compile's CUDA graphs (cudagraph trees) record the compiled blocks' graphs at the second step, one node per
block forward and per block backward, each node a child of the one before: 114 nodes in a path for FLUX.1's 57
blocks. For every input, static input and output of a new node, torch asks whether its storage is an output of an
earlier node of the path (`CUDAGraphNode._is_cuda_graph_recorded_tensor`, `_is_alias_of_live_recorded_tensor`), and
answers by scanning every output of every node in the path. The blocks' forwards save dozens of activations each,
so the work grows with the square of the path: on the H200 at `memory=vram80` the second step spent 12-20 s over a
step, and stack samples of it sat in `_add_first_outputs` -> `_is_alias_of_live_recorded_tensor`. With these
lookups, on an H100 (`memory=vram80 kernels=auto`, warm compile cache, one run each): 5.0 s against 12.2 s, the
same s/step (0.369 / 0.368) and peaks.

`install` gives `CUDAGraphNode` the same two questions answered through a dict from storage pointer to the path
positions holding it. The dict is kept per node with a copy of the path's lists of weak references, and is used
only while the path still holds exactly those references in those places (compared by identity, in C), so every
change torch makes to the path (a node's outputs added, a reference replaced or dropped) rebuilds it. A position's
storage pointer is fixed when its reference is made (`StorageWeakRefWrapper.data_ptr`), and liveness is checked at
each lookup as torch does, in torch's order: the answers are torch's. `probe` checks that on this torch before
anything is patched (torch's own methods against these on a path of real CPU storages, alive, freed, aliased and
repeated, changed between questions); where it fails, torch's methods stay and the install line says why. Replays
(every step after the second) never ask these questions, so steady-state steps are unchanged.
"""

from __future__ import annotations

import random
import weakref
from collections.abc import Callable
from typing import Any

import torch

METHODS = ("_is_cuda_graph_recorded_tensor", "_is_alias_of_live_recorded_tensor")
_saved: dict[str, Callable] = {}  # torch's methods while ours are installed
_index: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # node -> (path copy, {data_ptr: [(depth, i)]})


def _trees():
    from torch._inductor import cudagraph_trees

    return cudagraph_trees


def positions(node: Any) -> dict[int, list[tuple[int, int]]]:
    """Storage pointer -> the (depth, output index) places of the node's path holding a reference to it, in the order
    torch scans them; rebuilt whenever the path is not the one it was built from."""
    path = node.path_weakrefs
    kept = _index.get(node)
    if kept is not None and kept[0] == path:  # the same references in the same places (identity, compared in C)
        return kept[1]
    copy = [list(level) for level in path]
    found: dict[int, list[tuple[int, int]]] = {}
    for depth, level in enumerate(copy):
        for i, ref in enumerate(level):
            if ref is not None:
                found.setdefault(ref.data_ptr(), []).append((depth, i))
    _index[node] = (copy, found)
    return found


def is_cuda_graph_recorded_tensor(self: Any, t: torch.Tensor) -> bool:
    """Whether t's storage is an output of a node of this path, alive or not (torch's question, indexed)."""
    return t.untyped_storage().data_ptr() in positions(self)


def is_alias_of_live_recorded_tensor(self: Any, t: torch.Tensor) -> tuple[int, int] | None:
    """The first place in the path whose output is alive and shares t's storage (torch's question, indexed)."""
    maybe_deref = _trees().maybe_deref
    for depth, i in positions(self).get(t.untyped_storage().data_ptr(), ()):
        if maybe_deref(self.path_weakrefs[depth][i]) is not None:
            return depth, i
    return None


OURS = {
    "_is_cuda_graph_recorded_tensor": is_cuda_graph_recorded_tensor,
    "_is_alias_of_live_recorded_tensor": is_alias_of_live_recorded_tensor,
}


class _Path:
    """A stand-in for a CUDAGraphNode: all that the two questions read is `path_weakrefs`."""

    def __init__(self, path: list[list[Any]]) -> None:
        self.path_weakrefs = path


def probe(theirs: dict[str, Callable] | None = None, rounds: int = 40, seed: int = 0) -> tuple[bool, str]:
    """Ask torch's methods (or `theirs`) and ours the same questions about a random path of real CPU storages, with
    the path changed between questions as torch changes it; (True, "") when every answer agrees. The storages are
    `torch.empty`'s: nothing is drawn from torch's global generator, which decides the run's data order (sd-scripts'
    shuffled DataLoader takes its seed from it; a probe that drew from it gave `kernels=auto` other batches than
    `kernels=off` with the same seed). Its own choices come from random.Random(seed)."""
    cgt = _trees()
    theirs = theirs or {name: getattr(cgt.CUDAGraphNode, name) for name in METHODS}
    rng = random.Random(seed)
    keep = [torch.empty(rng.randint(1, 4)) for _ in range(24)]  # alive until replaced (below)
    gone: list[Any] = []  # references whose storages are already freed

    def ref() -> Any:
        pick = rng.random()
        if pick < 0.15:
            return None
        if pick < 0.3:
            return rng.choice(gone)
        if pick < 0.4:  # a dead reference at the address of a live storage (freed, then reused by the allocator)
            dead = cgt.StorageWeakRefWrapper(torch.empty(3))
            dead._data_ptr = rng.choice(keep).untyped_storage().data_ptr()
            return dead
        return cgt.StorageWeakRefWrapper(rng.choice(keep))

    node = _Path([])
    try:
        gone.extend(cgt.StorageWeakRefWrapper(torch.empty(3)) for _ in range(6))
        node.path_weakrefs.extend([ref() for _ in range(rng.randint(0, 6))] for _ in range(8))
        path = node.path_weakrefs
        for r in range(rounds):
            queries = keep + [k[1:] for k in keep if k.numel() > 1] + [torch.empty(2), torch.empty(0)]
            for t in rng.sample(queries, 8):
                for name in METHODS:
                    want, got = theirs[name](node, t), OURS[name](node, t)
                    if want != got:
                        return False, f"{name} answered {got!r} where torch answers {want!r} (round {r})"
            del queries, t
            change = rng.random()  # then change the path as torch does: outputs added, references replaced
            level = rng.choice(path)
            if change < 0.4:
                level.append(ref())
            elif change < 0.7 and level:
                level[rng.randrange(len(level))] = ref()
            elif change < 0.8:
                path.append([ref() for _ in range(3)])
            else:  # a storage freed (its references die) and a new one made, maybe at its address
                keep[rng.randrange(len(keep))] = torch.empty(2)
    except Exception as e:  # torch's methods read more than the path here: not the code this was written for
        return False, f"this torch's CUDAGraphNode does not take the probe ({type(e).__name__}: {e})"
    finally:
        _index.pop(node, None)
    return True, ""


def install() -> str:
    """Patch `CUDAGraphNode`'s two lookups (once; probed first). Returns a note for compile_blocks' install line."""
    if _saved:
        return "CUDA graph recording: indexed alias lookups"
    try:
        cls = _trees().CUDAGraphNode
    except (ImportError, AttributeError) as e:
        return f"CUDA graph recording: torch's own lookups ({e})"
    if not all(callable(getattr(cls, name, None)) for name in METHODS):
        return "CUDA graph recording: torch's own lookups (this torch's CUDAGraphNode has other methods)"
    ok, why = probe()
    if not ok:
        return f"CUDA graph recording: torch's own lookups (probe failed: {why})"
    for name in METHODS:
        _saved[name] = cls.__dict__[name]
        setattr(cls, name, OURS[name])
    return "CUDA graph recording: indexed alias lookups"


def remove() -> bool:
    """Put torch's methods back; True when there was something to undo."""
    if not _saved:
        return False
    cls = _trees().CUDAGraphNode
    for name, method in _saved.items():
        setattr(cls, name, method)
    _saved.clear()
    _index.clear()
    return True


def installed() -> bool:
    return bool(_saved)
