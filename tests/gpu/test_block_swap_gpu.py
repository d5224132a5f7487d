"""block_swap on a real GPU: sd-scripts' Flux with real-size blocks (hidden 3072, 24 heads; 6 double + 10 single of
them, 1024 image + 256 text tokens), random weights, checkpointed, trained forward + backward through sd-scripts' own
block swap and then through block_swap, set up as a run sets them up (the weights on the host when the kernels go
in). The outputs and the gradients of the blocks' inputs are the same bits (the same weights, the same computation;
attention on SDPA's math backend, whose backward is deterministic), every block runs from its card buffers with the
card holding N - S blocks' weights of each list, as much memory as sd-scripts' swap, and after `remove` sd-scripts'
swap goes on from where block_swap left the weights. With flux_kernels' fp8_matmul on an fp8 base and on a bf16 base
it quantised (its row scales are buffers the swap must leave on the card). Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from flux_kernels.memory import block_swap as bs
from flux_kernels.patches import patch
from flux_kernels.runtime import registry
from tests.conftest import load_script, undoing

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.sd_scripts,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (flux_kernels' GPU tier)"),
]

DEPTH, SINGLE = 6, 10
IMG, TXT = 1024, 256
MIB = 2**20


@pytest.fixture(scope="module")
def bench():
    return load_script("bench_block_swap")


def test_the_registry_check_passes_on_the_gpu(dev):
    result = registry.probe(registry.REGISTRY["block_swap"], dev)
    assert result.ok, result


def lists(model):
    return (("double", model.double_blocks, model.offloader_double), ("single", model.single_blocks,
            model.offloader_single))  # fmt: skip


def card_weight_bytes(model) -> int:
    """Bytes of the swapped kind of weight (every submodule's `.weight`) that are on the card, over all blocks."""
    return sum(
        m.weight.numel() * m.weight.element_size()
        for _, blocks, _ in lists(model)
        for b in blocks
        for _, m in bs.swap_slots(b)
        if m.weight.is_cuda
    )


def expected_card_bytes(model, swap: int) -> int:
    double, single = swap // 2, (swap - swap // 2) * 2
    per = [sum(m.weight.numel() * m.weight.element_size() for _, m in bs.swap_slots(blocks[0])) for _, blocks, _ in
           lists(model)]  # fmt: skip
    return (DEPTH - double) * per[0] + (SINGLE - single) * per[1]


def checking_blocks(model, want_bytes: int, state: dict):
    """Every block's `_forward` (forward, and checkpointing's recompute in backward) checks first that with
    block_swap installed the block runs from its card buffers and the card holds N - S blocks' weights."""
    patched = []
    for kind, blocks, _ in lists(model):
        for i, b in enumerate(blocks):
            b._forward = _checked(model, kind, i, type(b)._forward.__get__(b), want_bytes, state)
            patched.append(b)
    return lambda: [b.__dict__.pop("_forward", None) for b in patched]


def _checked(model, kind: str, i: int, original, want_bytes: int, state: dict):
    def run(*args, **kwargs):
        off = getattr(model, f"offloader_{kind}")
        if isinstance(off, bs.BlockSwapOffloader):
            state["runs"] += 1
            assert off.on_device(i), f"{kind} block {i} ran from its host copy"
            assert card_weight_bytes(model) == want_bytes, (kind, i)
        return original(*args, **kwargs)

    return run


def on_host(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """A step's results off the card, so that they do not count in the next step's memory."""
    return [t.cpu() for t in tensors]


def setup_swap(model, swap: int, dev, ours: bool) -> str:
    """As a run: the model on the host (loaded), sd-scripts' enable_block_swap, the kernels (block_swap), the rest
    to the card, sd-scripts' prepare."""
    model.to("cpu")
    model.enable_block_swap(swap, dev)
    line = bs.install(model) if ours else ""
    model.move_to_device_except_swap_blocks(dev)
    model.prepare_block_swap_before_forward()
    torch.cuda.synchronize(dev)
    return line


@pytest.mark.parametrize(
    ("dtype", "swap", "fp8"),
    # (not 1: it swaps no double block, and sd-scripts then leaves the double blocks on the host; flux-train refuses it)
    [("bf16", 3, None), ("bf16", 5, "quantised"), ("fp8", 8, "fp8 base")],
    ids=["bf16-swap3", "bf16-fp8_matmul-swap5", "fp8-fp8_matmul-swap8"],
)
def test_sd_scripts_swap_and_block_swap_give_the_same_bits_and_memory(fm, dev, bench, dtype, swap, fp8):
    torch_dtype = torch.float8_e4m3fn if dtype == "fp8" else torch.bfloat16
    model = bench.build_flux(fm, dev, torch_dtype, depth=DEPTH, depth_single_blocks=SINGLE).train()
    model.enable_gradient_checkpointing()
    if fp8:
        print(patch.install_fp8(model, quantize=fp8 == "quantised"))
    p = model.params
    inputs = bench.flux_inputs(dev, IMG, TXT, p.context_in_dim, p.vec_in_dim)
    state = {"runs": 0}
    want_bytes = expected_card_bytes(model, swap)
    with sdpa_kernel(SDPBackend.MATH), undoing(checking_blocks(model, want_bytes, state), lambda: bs.remove(model)):
        setup_swap(model, swap, dev, ours=False)
        assert card_weight_bytes(model) == want_bytes  # sd-scripts' own count, the one to keep
        held_sd = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        want = [on_host(bench.train_step(model, inputs, torch_dtype)) for _ in range(2)]
        peak_sd = torch.cuda.max_memory_allocated(dev)
        assert all(torch.equal(a, b) for a, b in zip(want[0], want[1], strict=True))  # deterministic, or no test

        bench.unswap(model, torch.device("cpu"))
        line = setup_swap(model, swap, dev, ours=True)
        print(f"\n  {line}")
        held = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        got = []
        for _ in range(3):
            got.append(on_host(bench.train_step(model, inputs, torch_dtype)))
            ours = bs.installed_on(model)
            for off in (ours.double, ours.single):
                assert sum(off.on_device(i) for i in range(off.num_blocks)) == off.num_blocks - off.blocks_to_swap
                assert not off.pending  # every copy waited for
            assert card_weight_bytes(model) == want_bytes
        torch.cuda.synchronize(dev)
        peak = torch.cuda.max_memory_allocated(dev)
        assert state["runs"] == 3 * 2 * (DEPTH + SINGLE)  # every block forward and recomputed, each step
        print(f"  card: {held / MIB:.0f} MiB held, {peak / MIB:.0f} peak; sd-scripts' swap {held_sd / MIB:.0f}, "
              f"{peak_sd / MIB:.0f}")  # fmt: skip
        assert abs(held - held_sd) <= 2 * MIB
        assert peak <= peak_sd + 64 * MIB
        if fp8 == "quantised":  # fp8_matmul's row scales stayed on the card with the rest of the non-weights
            scales = [t for _, blocks, _ in lists(model) for t in blocks.buffers()]
            assert scales and all(t.is_cuda for t in scales)

        assert bs.remove(model)
        assert model.offloader_double.__class__.__name__ == "ModelOffloader"
        # sd-scripts' swap, from where ours left the weights
        again = on_host(bench.train_step(model, inputs, torch_dtype))
    for g in [*got, again]:
        for a, b in zip(g, want[0], strict=True):
            assert torch.equal(a, b), (a.shape, (a.float() - b.float()).abs().max().item())


def test_the_most_swapped_tier_at_full_depth_copies_each_weight_once(fm, dev, bench):
    """The most swapped (vram8: 15 of 19 double, 32 of 38 single, fp8): the page-locked copies are made from the
    host weights once and those weights point at them; the card holds N - S blocks after install and after a step."""
    model = bench.build_flux(fm, dev, torch.float8_e4m3fn).train()
    model.enable_gradient_checkpointing()
    inputs = bench.flux_inputs(dev, 256, 64, model.params.context_in_dim, model.params.vec_in_dim)
    with undoing(lambda: bs.remove(model)):
        line = setup_swap(model, 31, dev, ours=True)
        print(f"\n  {line}")
        ours = bs.installed_on(model)
        for off, n, s in ((ours.double, 19, 15), (ours.single, 38, 32)):
            assert (off.num_blocks, off.blocks_to_swap) == (n, s)
            assert sorted(off.host) == list(range(n))  # 2S > N: every block leaves at some point
            assert all(off.on_host(i) for i in range(n - s, n)) and all(t.is_pinned() for t in off.host[0])
            assert sum(off.on_device(i) for i in range(n)) == n - s
        per_d = ours.double.weight_bytes()
        per_s = ours.single.weight_bytes()
        assert ours.double.host_bytes() + ours.single.host_bytes() == 19 * per_d + 38 * per_s
        bench.train_step(model, inputs, torch.float8_e4m3fn)
        torch.cuda.synchronize(dev)
        assert sum(ours.double.on_device(i) for i in range(19)) == 4
        assert sum(ours.single.on_device(i) for i in range(38)) == 6


def _sample(model, inputs: dict) -> None:
    """What a sample (or a validation step) does between training steps: sd-scripts' prepare, a forward without
    backward, and its prepare again (the blocks are then where a forward without backward left them)."""
    model.prepare_block_swap_before_forward()
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        model(**{k: v.detach() for k, v in inputs.items()})
    model.prepare_block_swap_before_forward()


def test_compiled_blocks_replay_from_cuda_graphs_over_swapped_blocks(fm, dev, bench):
    """The vram16 / vram12 tiers: block_swap runs block j from the buffers block j % (N - S) started with at every
    use, so the compiled blocks replay from CUDA graphs over swapped blocks. Through training steps, a sample between
    them and training again, the outputs and the blocks' input gradients match the same compiled blocks without
    graphs (within bf16 attention's run-to-run noise), and each block ran from one set of card buffers."""
    import torch._dynamo

    from flux_kernels.patches import compile_blocks

    swap, steps, sampled_after = 4, 5, 1
    seen: dict[tuple[str, int], set] = {}

    def record(model) -> None:
        ours = bs.installed_on(model)
        for kind, off in (("double", ours.double), ("single", ours.single)):
            for i in range(off.num_blocks):
                if off.on_device(i):
                    seen.setdefault((kind, i), set()).add(tuple(m.weight.data_ptr() for _, m in off.slots[i]))

    results = {}
    for graphs in (False, True):
        model = bench.build_flux(fm, dev, torch.bfloat16, depth=DEPTH, depth_single_blocks=SINGLE).train()
        model.enable_gradient_checkpointing()
        inputs = bench.flux_inputs(dev, IMG, TXT, model.params.context_in_dim, model.params.vec_in_dim)
        with undoing(lambda m=model: bs.remove(m), torch._dynamo.reset):
            setup_swap(model, swap, dev, ours=True)
            compile_blocks.install(model, options={"triton.cudagraphs": True} if graphs else {})
            got = []
            for step in range(steps):
                torch.compiler.cudagraph_mark_step_begin()
                got.append(on_host(bench.train_step(model, inputs, torch.bfloat16)))
                if graphs:
                    record(model)
                if step == sampled_after:
                    _sample(model, inputs)
            results[graphs] = got
        del model
        torch.cuda.empty_cache()
    for step, (plain, replayed) in enumerate(zip(results[False], results[True], strict=True)):
        for what, a, b in zip(("output", "d img", "d txt"), replayed, plain, strict=True):
            err = ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
            assert err < 2e-2, (step, what, err)
    moved = {k: v for k, v in seen.items() if len(v) != 1}
    assert not moved, f"blocks ran from more than one set of card buffers: {sorted(moved)}"
