"""block_swap on the CPU: its schedule is sd-scripts' ModelOffloader's (recorded from sd-scripts' own object for
several list lengths and swap counts, none and the most included), the card holds N - S blocks at every step of it,
install/remove give sd-scripts' offloaders and hooks back, it refuses where it cannot apply, and sd-scripts' tiny
Flux trained through it (CPU device: the same bookkeeping with plain copies) runs every block on its card buffers
with the same outputs and input gradients as through sd-scripts' own swap. The streams and events are the GPU
tier's (tests/gpu/test_block_swap_gpu.py)."""

from __future__ import annotations

import importlib

import pytest
import torch
from torch import nn

from flux_kernels.memory import block_swap as bs
from flux_kernels.runtime import registry
from flux_kernels.runtime.applies import swaps_blocks
from flux_kernels.runtime.errors import KernelError
from tests.conftest import tiny_flux, tiny_flux_forward, undoing

CPU = torch.device("cpu")
SCHEDULES = [(19, 0), (19, 1), (19, 9), (19, 15), (19, 17), (38, 2), (38, 18), (38, 32), (38, 36), (4, 2), (3, 1)]


@pytest.fixture(scope="module")
def offloading(fm):
    """sd-scripts' `library.custom_offloading_utils`, from the checkout `fm` came from."""
    return importlib.import_module("library.custom_offloading_utils")


def sd_scripts_calls(offloading, n: int, swap: int, forward_only: bool = False) -> tuple[list, list]:
    """What sd-scripts' ModelOffloader asks for over one forward (wait, then submit, per block) and one backward
    (each block's hook, last block first): its own decisions, with its transfers recorded instead of run."""
    blocks = [nn.Linear(1, 1) for _ in range(n)]
    off = offloading.ModelOffloader(blocks, swap, CPU)
    calls = []
    off._submit_move_blocks = lambda _blocks, to_host, to_dev: calls.append(("move", to_host, to_dev))
    off._wait_blocks_move = lambda idx: calls.append(("wait", idx))
    off.forward_only = forward_only
    for i in range(n):
        off.wait_for_block(i)
        off.submit_move_blocks(blocks, i)
    forward, calls[:] = list(calls), []
    for i in reversed(range(n)):
        hook = off.create_backward_hook(blocks, i)
        if hook is not None:
            calls.append(("hook", i))
            hook(blocks[i], None, None)
    return forward, list(calls)


def our_calls(n: int, swap: int, forward_only: bool = False) -> tuple[list, list]:
    forward = []
    for i in range(n):
        forward += [("wait", i)] if swap else []
        move = bs.forward_move(n, swap, i, forward_only)
        forward += [("move", *move)] if move else []
    backward = []
    for i in reversed(range(n)):
        move, wait = bs.backward_step(n, swap, i)
        if move is None and wait is None:
            continue
        backward += [("hook", i)] + ([("move", *move)] if move else []) + ([("wait", wait)] if wait is not None else [])
    return forward, backward


@pytest.mark.sd_scripts
@pytest.mark.parametrize(("n", "swap"), SCHEDULES, ids=lambda v: str(v))
def test_the_schedule_is_sd_scripts(offloading, n, swap):
    assert our_calls(n, swap) == sd_scripts_calls(offloading, n, swap)
    assert our_calls(n, swap, True)[0] == sd_scripts_calls(offloading, n, swap, True)[0]  # forward-only


@pytest.mark.parametrize(("n", "swap"), SCHEDULES, ids=lambda v: str(v))
def test_the_card_holds_n_minus_s_blocks_at_every_step_and_ends_where_it_started(n, swap):
    on_card = set(range(n - swap))
    ever_host = set(range(n)) - on_card

    def move(to_host, to_dev):
        assert to_host in on_card and to_dev not in on_card
        on_card.remove(to_host)
        on_card.add(to_dev)
        ever_host.add(to_host)
        assert len(on_card) == n - swap

    for i in range(n):  # forward: each block on the card when it runs
        assert i in on_card, (i, sorted(on_card))
        if m := bs.forward_move(n, swap, i, False):
            move(*m)
    for i in reversed(range(n)):  # backward: block i's backward runs, then its hook
        assert i in on_card, (i, sorted(on_card))
        m, wait = bs.backward_step(n, swap, i)
        if m:
            move(*m)
        if wait is not None:
            assert wait in on_card
    assert on_card == set(range(n - swap))  # the next forward starts from the same state
    assert sorted(ever_host) == bs.host_blocks(n, swap)
    assert bs.host_blocks(n, swap, forward_only=True) == (list(range(n)) if swap else [])


class _Block(nn.Module):
    """A block of two frozen Linear layers: what the offloader swaps (their `.weight`)."""

    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 4)
        self.requires_grad_(False)


def _runs_from(off: bs.BlockSwapOffloader, idx: int) -> tuple[int, ...]:
    """The addresses block `idx` runs from (its card buffers: the offloader checks it is not on its host copy)."""
    assert off.on_device(idx), idx
    return tuple(m.weight.data_ptr() for _, m in off.slots[idx])


def _forward(off: bs.BlockSwapOffloader, seen: dict) -> None:
    off.prepare_block_devices_before_forward(off.blocks)
    for i in range(off.num_blocks):
        off.wait_for_block(i)
        seen.setdefault(i, set()).add(_runs_from(off, i))
        off.submit_move_blocks(off.blocks, i)


def _backward(off: bs.BlockSwapOffloader, seen: dict) -> None:
    for i in reversed(range(off.num_blocks)):
        seen[i].add(_runs_from(off, i))  # block i's backward (and its checkpoint's recompute), then its hook
        if hook := off._backward_hook(i):
            hook(off.blocks[i], None, None)


@pytest.mark.parametrize(("n", "swap"), [s for s in SCHEDULES if s[1]], ids=lambda v: str(v))
def test_every_block_runs_from_the_same_buffers_in_training_sampling_and_after(n, swap):
    """CUDA graphs replay over swapped blocks only if each block always runs from the same card addresses: through
    training steps, a forward without backward (a sample or validation step), and the training after it. Block j
    runs from the buffers block j % (N - S) started with. (sd-scripts' prepare hands the buffers back in reverse
    after a forward without backward: the order this test failed on before.)"""
    blocks = [_Block(i) for i in range(n)]
    want = [b.a.weight.clone() for b in blocks]
    off = bs.BlockSwapOffloader(blocks, swap, CPU)
    for i in range(n - swap, n):  # sd-scripts leaves the last S on the host at the start
        blocks[i].to("cpu")
    off.make_host_copies(bs.host_blocks(n, swap))
    seen: dict[int, set] = {}
    for sampled in (False, True, False, True, True, False):
        _forward(off, seen)
        if not sampled:
            _backward(off, seen)
    keep = n - swap
    for j in range(n):
        assert len(seen[j]) == 1, f"block {j} ran from {len(seen[j])} sets of buffers"
        assert seen[j] == seen[j % keep], j
    assert len({a for j in range(keep) for a in next(iter(seen[j]))}) == 2 * keep  # keep sets of two, all distinct
    off.prepare_block_devices_before_forward(blocks)
    for j in range(keep):
        assert torch.equal(blocks[j].a.weight, want[j])  # the right weights in them


def test_packing_wastes_little_and_never_overlaps():
    mib = 2**20
    sizes = [int(s * mib) for s in (63, 45, 27, 63, 45, 27, 9, 9, 54, 36, 36, 0.01)] * 5
    where, slabs = bs.pack(sizes)
    assert all(s & (s - 1) == 0 for s in slabs)  # powers of two: what the host allocator gives without rounding
    assert sum(slabs) <= 1.15 * sum(sizes)  # one pinned tensor per weight would take 1.6x here
    spans = sorted((k, off, off + n) for (k, off), n in zip(where, sizes, strict=True))
    for (k1, _, end), (k2, start, _) in zip(spans, spans[1:], strict=False):
        assert k1 != k2 or end <= start
    assert all(off % bs.ALIGN == 0 and off + n <= slabs[k] for (k, off), n in zip(where, sizes, strict=True))
    big = [300 * mib, mib]  # larger than a slab: a slab of its own power of two
    assert bs.pack(big)[1][0] == 512 * mib


def test_host_copies_keep_dtype_shape_and_values():
    ts = [torch.randn(7, 5).to(torch.bfloat16), torch.randn(3, 16).to(torch.float8_e4m3fn), torch.randn(4)]
    copies = bs.host_copies(ts, pin=False)
    for t, c in zip(ts, copies, strict=True):
        assert c.dtype == t.dtype and c.shape == t.shape and c.is_contiguous()
        assert torch.equal(c.view(torch.uint8), t.view(torch.uint8))
        assert (c.data_ptr() - c.untyped_storage().data_ptr()) % bs.ALIGN == 0  # within its slab


def swapped_flux(fm, swap: int | None):
    """sd-scripts' tiny Flux with 6 double and 10 single blocks, checkpointed, training; `swap` blocks swapped by
    sd-scripts (on the CPU device: its own swap is then not usable, see the test) or None."""
    model = tiny_flux(fm, depth=6, depth_single_blocks=10).train().requires_grad_(False)
    model.enable_gradient_checkpointing()
    if swap:
        model.enable_block_swap(swap, CPU)
        model.move_to_device_except_swap_blocks(CPU)
    return model


def hooks_of(model) -> list[list[str]]:
    return [[h.__qualname__ for h in b._backward_hooks.values()] for b in (*model.double_blocks, *model.single_blocks)]


def step(model, seed: int) -> list[torch.Tensor]:
    """One forward + backward as training runs it: the output and the gradients of the blocks' inputs (the
    image and text embeddings)."""
    model.prepare_block_swap_before_forward()
    inputs = []

    def keep(module, args, out):
        inputs.append(out.requires_grad_())

    handles = [model.img_in.register_forward_hook(keep), model.txt_in.register_forward_hook(keep)]
    with undoing(*(h.remove for h in handles)):
        out = tiny_flux_forward(model, seed=seed)
        gout = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed))
        grads = torch.autograd.grad(out, inputs, gout)
    return [out.detach(), *grads]


def checked_forward(model, name: str, i: int, original, state: dict):
    def checked(*args, **kwargs):
        state["runs"] += 1
        assert getattr(model, name).on_device(i), f"{name} block {i} ran from its host copy"
        return original(*args, **kwargs)

    return checked


def checking_blocks(model, state: dict):
    """Every block's `_forward` (run by forward and again by checkpointing's recompute in backward) first checks
    that the block's swapped weights are its card buffers, not its host copies. Returns the undo."""
    patched = []
    for name, blocks in (("offloader_double", model.double_blocks), ("offloader_single", model.single_blocks)):
        for i, b in enumerate(blocks):
            b._forward = checked_forward(model, name, i, type(b)._forward.__get__(b), state)
            patched.append(b)
    return lambda: [b.__dict__.pop("_forward", None) for b in patched]


@pytest.mark.sd_scripts
@pytest.mark.parametrize("swap", [1, 3, 8])
def test_tiny_flux_through_block_swap_matches_no_swap_and_removes_cleanly(fm, swap):
    """On the CPU sd-scripts' own swap is no reference: its `.to("cpu")` of a CPU weight is the weight itself, which
    it then overwrites with the incoming block's (its CPU path is marked "not tested"). The reference is the same
    seeded model without swap: the same block calls in the same order."""
    unswapped = swapped_flux(fm, None)
    want = [step(unswapped, seed) for seed in (1, 2)]
    model = swapped_flux(fm, swap)
    sd_double, sd_single = model.offloader_double, model.offloader_single
    hooks = hooks_of(model)
    assert any(hooks) and all("create_backward_hook" in q for h in hooks for q in h)
    state = {"runs": 0}
    with undoing(checking_blocks(model, state), lambda: bs.remove(model)):
        line = bs.install(model, cpu_for_tests=True)
        assert line.startswith(f"block_swap: {swap // 2} of 6 double and {(swap - swap // 2) * 2} of 10 single")
        ours = bs.installed_on(model)
        assert (model.offloader_double, model.offloader_single) == (ours.double, ours.single)
        # ours where sd-scripts had its own, no more
        assert [len(h) for h in hooks_of(model)] == [len(h) for h in hooks]
        assert all("BlockSwapOffloader" in q for h in hooks_of(model) for q in h)
        assert not sd_double.remove_handles and not sd_single.remove_handles
        got = [step(model, seed) for seed in (1, 2)]
        for off in (ours.double, ours.single):
            n, s = off.num_blocks, off.blocks_to_swap
            assert sorted(off.host) == bs.host_blocks(n, s)
            assert sum(off.on_device(i) for i in range(n)) == n - s  # after backward: where the forward started
            assert off.moves == 2 * 2 * s  # each step: S swaps in forward, S in backward
        assert state["runs"] == 2 * 2 * 16  # every block, forward and recompute, both steps
    for g, w in zip(got, want, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(g, w, strict=True))
    assert (model.offloader_double, model.offloader_single) == (sd_double, sd_single)
    assert hooks_of(model) == hooks  # sd-scripts' hooks again, on the same blocks
    assert len(sd_double.remove_handles) + len(sd_single.remove_handles) == sum(map(len, hooks))
    assert not bs.remove(model)  # once


@pytest.mark.sd_scripts
def test_refusals(fm):
    plain = tiny_flux(fm, depth=4, depth_single_blocks=6)
    with pytest.raises(KernelError, match="does not swap blocks"):
        bs.install(plain)
    assert swaps_blocks(plain) == (False, "block swap is off (memory.blocks_to_swap=0)")
    model = tiny_flux(fm, depth=4, depth_single_blocks=6).requires_grad_(False)
    model.enable_block_swap(2, CPU)
    ok, why = swaps_blocks(model)
    assert not ok and why == "needs a CUDA device (sd-scripts swaps to cpu); sd-scripts' own swap stays"
    with pytest.raises(KernelError, match="needs a CUDA device"):
        bs.install(model)
    model.single_blocks[3].linear1.weight.requires_grad_(True)
    with pytest.raises(KernelError, match="block 3's linear1.weight is trained"):
        bs.install(model, cpu_for_tests=True)
    model.single_blocks[3].linear1.weight.requires_grad_(False)
    model.single_blocks[2].linear2.weight.data = model.single_blocks[2].linear2.weight.data.to(torch.float16)
    with pytest.raises(KernelError, match="block 2's weights differ from block 0's"):
        bs.install(model, cpu_for_tests=True)
    assert bs.installed_on(model) is None and model.offloader_single.remove_handles  # nothing changed
    model.offloader_double = object()
    with pytest.raises(KernelError, match="is not sd-scripts' ModelOffloader"):
        bs.install(model, cpu_for_tests=True)


@pytest.mark.sd_scripts
def test_auto_takes_a_cuda_swap_and_a_failed_pinning_changes_nothing(fm):
    if torch.cuda.is_available():
        pytest.skip("page-locked memory works here: the GPU tier installs for real")
    model = tiny_flux(fm, depth=4, depth_single_blocks=6).requires_grad_(False)
    model.enable_block_swap(2, torch.device("cuda"))  # sd-scripts' offloaders only note the device
    assert swaps_blocks(model) == (True, "2 blocks swapped")
    weights = [m.weight for b in model.single_blocks for _, m in bs.swap_slots(b)]
    before = [w.data_ptr() for w in weights]
    hooks = hooks_of(model)
    with pytest.raises(KernelError, match="page-locked host copies failed.*auto,-block_swap"):
        bs.install(model)  # no CUDA here: no page-locked memory
    assert bs.installed_on(model) is None and hooks_of(model) == hooks
    assert "create_backward_hook" in hooks_of(model)[-2][0]
    assert [w.data_ptr() for w in weights] == before


def test_auto_goes_on_with_sd_scripts_swap_where_pinning_fails_and_a_named_request_stops(fm, caplog):
    """A machine without page-locked memory to spare (WSL, a low memlock limit): under `auto` one warning, sd-scripts'
    own swap and the run goes on; named (`kernels.set=block_swap`), the run stops with the reason."""
    if torch.cuda.is_available():
        pytest.skip("page-locked memory works here: the GPU tier installs for real")
    import logging

    from flux_kernels.patches import patch
    from flux_kernels.runtime.registry import REGISTRY, Selection

    model = tiny_flux(fm, depth=4, depth_single_blocks=6).requires_grad_(False)
    model.enable_block_swap(2, torch.device("cuda"))
    hooks = hooks_of(model)
    spec = REGISTRY["block_swap"]
    with caplog.at_level(logging.WARNING, logger="flux_kernels.patches.patch"):
        assert patch.apply_kernels(model, Selection(("block_swap",), specs=(spec,)), verify=False) == []
    assert "block_swap not installed (auto goes on without it)" in caplog.text and "page-locked" in caplog.text
    assert bs.installed_on(model) is None and hooks_of(model) == hooks
    with pytest.raises(KernelError, match="page-locked host copies failed"):
        patch.apply_kernels(model, Selection(("block_swap",), specs=(spec,), explicit=True), verify=False)


@pytest.mark.sd_scripts
def test_weights_replaced_after_install_are_named(fm):
    model = tiny_flux(fm, depth=4, depth_single_blocks=6).requires_grad_(False)
    model.enable_block_swap(2, CPU)
    bs.install(model, cpu_for_tests=True)
    with undoing(lambda: bs.remove(model)):
        lin = model.single_blocks[5].linear1
        lin.weight = nn.Parameter(lin.weight.detach().to(torch.float8_e4m3fn), requires_grad=False)
        with pytest.raises(KernelError, match="block 5's linear1.weight is now torch.float8_e4m3fn"):
            model.prepare_block_swap_before_forward()


def test_the_registry_record_and_where_it_applies():
    spec = registry.REGISTRY["block_swap"]
    assert spec.in_auto and spec.auto_if is swaps_blocks and spec.target == "model"
    assert list(registry.REGISTRY)[-1] == "block_swap"  # installed last: it copies the weights as the others left them
    assert "block_swap" not in registry.select("auto", "cpu").installed
    with pytest.raises(KernelError, match="block_swap.*only meaningful on a CUDA GPU"):
        registry.select("block_swap", "cpu")


def test_the_check_needs_streams():
    if not torch.cuda.is_available():
        pytest.skip("the registry check times nothing on a CPU but needs CUDA streams to mean anything (GPU tier)")
    assert bs.self_check(torch.device("cuda"))[0]
