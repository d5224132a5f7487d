"""activation_offload on a real GPU: full-size sd-scripts blocks (hidden 3072, 512 + 4096 tokens), compiled,
checkpointed selectively as training runs them, their saved tensors through page-locked host memory on a side
stream: the same outputs and gradients, and the card holds less between forward and backward by about what went
to the host. Skipped without CUDA."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from torch._dynamo.utils import counters
from torch._inductor import cudagraph_trees

from flux_kernels.memory import activation_offload as ao
from flux_kernels.memory import selective_checkpoint as sac
from flux_kernels.patches import compile_blocks, patch
from flux_kernels.runtime import registry
from tests.conftest import undoing
from tests.gpu.test_kernels_gpu import block_inputs, flux_blocks, leaves, rel

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (flux_kernels' GPU tier)"),
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed"),
]


def test_the_probe_passes_on_the_gpu(dev):
    result = registry.probe(registry.REGISTRY["activation_offload"], dev)
    assert result.ok, result


def _step(model, args: dict, dev) -> tuple[list[torch.Tensor], int]:
    """Both blocks' forward, then (the card's allocation read with every output alive) their backward."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated(dev)
    outs = [*model.double_blocks[0](*args["double"]), model.single_blocks[0](*args["single"])]
    torch.cuda.synchronize()
    torch.empty(1, device=dev)  # lets the allocator see the finished copies and free what they read
    held = torch.cuda.memory_allocated(dev) - before
    gen = torch.Generator().manual_seed(1)
    gouts = [torch.randn(o.shape, generator=gen).to(o.device, o.dtype) for o in outs]
    wrt = leaves(args["double"]) + leaves(args["single"])
    grads = torch.autograd.grad(outs, wrt, gouts)
    return [o.detach() for o in outs] + list(grads), held


def test_full_size_blocks_give_the_same_gradients_and_the_card_holds_less(fm, dev, tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    model = flux_blocks(fm, dev).train()
    for b in (model.double_blocks[0], model.single_blocks[0]):
        b.enable_gradient_checkpointing()
    sac.install(model)
    compile_blocks.install(model)
    args = {kind: block_inputs(dev, kind) for kind in ("double", "single")}
    torch._dynamo.reset()
    with undoing(lambda: patch.remove_kernels(model), torch._dynamo.reset):
        _step(model, args, dev)  # compiles
        want, held_plain = _step(model, args, dev)
        again, _ = _step(model, args, dev)  # the run-to-run difference without offload (attention's backward)
        ao.install(model, keep_last=0)
        off = ao.offloader_of(model)
        _step(model, args, dev)  # the host buffers are allocated
        got, held = _step(model, args, dev)
    errors = [rel(g, w) for g, w in zip(got, want, strict=True)]
    noise = [rel(a, w) for a, w in zip(again, want, strict=True)]
    print(
        f"\n  offloaded {off.step_tensors} tensors, {off.step_bytes / 2**20:.0f} MiB; held after forward "
        f"{held / 2**20:.0f} against {held_plain / 2**20:.0f} MiB; max rel. error {max(errors):.1e} (two runs "
        f"without: {max(noise):.1e})"
    )
    assert max(errors[:3]) == 0  # the outputs: the forward reads nothing back
    # the copies are bit-exact: what differs is what differs between two runs without offload
    assert max(errors) <= max(2 * max(noise), 1e-4), (errors, noise)
    assert off.step_tensors >= 4  # both blocks' inputs and selective outputs
    # the blocks' inputs went to the host too, but this test still holds them: what the card no longer holds is
    # the rest (the selective outputs)
    inputs = sum(
        a.numel() * a.element_size() for k in args.values() for a in k if torch.is_tensor(a) and off.offloads(a)
    )
    assert held_plain - held >= 0.9 * (off.step_bytes - inputs) > 0, (held_plain, held, off.step_bytes, inputs)


def _chain(model, args: dict) -> torch.Tensor:
    """Two double-block calls, then two single-block calls: four offloaded groups a step."""
    d, s = model.double_blocks[0], model.single_blocks[0]
    img, txt, vec, pe, mask = args["double"]
    for _ in range(2):
        img, txt = d(img, txt, vec, pe, mask)
    x = torch.cat((txt, img), dim=1)
    for _ in range(2):
        x = s(x, vec, pe, mask)
    return x


def _graph_steps(model, args: dict, steps: int, records: list, recorded: list) -> list[list[torch.Tensor]]:
    """Steps as training runs them under CUDA graphs (a new generation each); cloned, since a replay writes its
    outputs where the last one did. `recorded` gets how many graphs each step recorded (`records` grows by one
    per recording)."""
    got = []
    for _ in range(steps):
        before = len(records)
        torch.compiler.cudagraph_mark_step_begin()
        out = _chain(model, args)
        gen = torch.Generator().manual_seed(1)
        gout = torch.randn(out.shape, generator=gen).to(out.device, out.dtype)
        grads = torch.autograd.grad(out, leaves(args["double"]), gout)
        got.append([out.detach().clone(), *(g.clone() for g in grads)])
        recorded.append(len(records) - before)
    return got


LATE_CYCLES = 40_000_000  # ~20 ms at the H200's clock: each group's copies start that late


def test_with_cuda_graphs_late_copies_still_read_what_the_blocks_saved(fm, dev, tmp_path, monkeypatch):
    """Compiled blocks replayed from CUDA graphs write into the graphs' pool, which holds what the blocks saved.
    The copies to the host are made late on purpose (a sleep queued on their stream, as at the end of a real
    forward where they queue behind each other), so a replay that reused their memory too early would corrupt them:
    the replayed steps' gradients must still match the graphs without offload."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    model = flux_blocks(fm, dev).train()
    for b in (model.double_blocks[0], model.single_blocks[0]):
        b.enable_gradient_checkpointing()
    sac.install(model)
    compile_blocks.install(model, mode="reduce-overhead")
    args = {"double": block_inputs(dev, "double")}
    offload = ao.Offloader._offload

    def late(self, g):
        with torch.cuda.stream(self._streams_of(g.device)[0]):
            torch.cuda._sleep(LATE_CYCLES)
        offload(self, g)

    monkeypatch.setattr(ao.Offloader, "_offload", late)
    records, plain, offloaded = [], [], []
    record = cudagraph_trees.CUDAGraphTreeManager.record_function
    monkeypatch.setattr(
        cudagraph_trees.CUDAGraphTreeManager, "record_function", lambda *a, **k: records.append(1) or record(*a, **k)
    )
    torch._dynamo.reset()
    skips = counters["inductor"]["cudagraph_skips"]
    with undoing(lambda: patch.remove_kernels(model), torch._dynamo.reset):
        want = _graph_steps(model, args, 5, records, plain)  # compile, warm-up, record, then replays
        # new graphs (dynamo's reset drops the recorded ones): recorded with the offloaded tensors' memory free
        torch._dynamo.reset()
        ao.install(model, keep_last=0, graphs=True)
        off = ao.offloader_of(model)
        got = _graph_steps(model, args, 5, records, offloaded)
    noise = [rel(a, w) for a, w in zip(want[-2], want[-1], strict=True)]
    errors = [rel(g, w) for g, w in zip(got[-1], want[-1], strict=True)]
    print(f"\n  offloaded {off.step_tensors}; max rel. error {max(errors):.1e} (replays {max(noise):.1e}); {offloaded}")
    assert counters["inductor"]["cudagraph_skips"] == skips  # every block call ran from CUDA graphs
    # and the last steps replayed them: a reload at a new address would record the backward graphs again each step
    assert plain[-2:] == offloaded[-2:] == [0, 0] and sum(offloaded) > 0, (plain, offloaded)
    assert off.step_tensors >= 8  # four groups: the blocks' inputs and selective outputs
    assert all(torch.isfinite(t).all() for t in got[-1])
    assert max(errors) <= max(2 * max(noise), 1e-4), (errors, noise)


def test_a_view_with_gaps_goes_to_the_host_and_back_on_the_gpu(dev):
    """`views=True` (FLUX_KERNELS_OFFLOAD_VIEWS=1): sin saves its input, a view with gaps; it goes through the
    streams and page-locked memory packed, comes back at its strides, and the gradient is exact."""
    off = ao.Offloader(min_bytes=0, views=True)
    x = torch.randn(256, 1040, device=dev, requires_grad=True)
    with off.group(x.device):
        v = (x * 2)[:, :1024]
        y = v.sin().sum()
    del v
    y.backward()
    torch.cuda.synchronize()
    assert off.step_tensors == 1 and off.step_bytes == 256 * 1024 * 4
    assert torch.equal(x.grad[:, :1024], 2 * torch.cos(2 * x.detach()[:, :1024]))
    assert not x.grad[:, 1024:].any()


@pytest.mark.parametrize("kernels", [[], ["lora_fold"]], ids=["auto", "auto+lora_fold"])
def test_selectively_checkpointed_blocks_save_only_dense_tensors_that_offload_can_take(dev, fm, lora_flux, kernels):
    """activation_offload leaves tensors with gaps on the card, and with them their whole storage: with lora_fold the
    single blocks saved the mirror fold's [x Wᵀ, x Aᵀ] (4608 x 3088) at the row stride inductor padded it to (3136),
    so under CUDA graphs 38 of them stayed in the graphs' pool (1.2 GiB of the card at vram48, every block
    checkpointed, offload; lora_fold.DOWN_ROWS). Every saved tensor of 1 MiB or more must be dense."""
    from flux_kernels.ops.reference import saved_tensors
    from flux_kernels.patches import lora_fold
    from flux_kernels.runtime.registry import unchecked
    from tests.gpu.test_kernels_gpu import with_lora

    torch._dynamo.reset()
    model = with_lora(lora_flux, flux_blocks(fm, dev), dev)
    blocks = {"double": model.double_blocks[0], "single": model.single_blocks[0]}
    for b in blocks.values():
        b.train().enable_gradient_checkpointing()
    names = ["attention", "single_qkv", *kernels, "selective_checkpoint", "compile_blocks"]
    patch.apply_kernels(model, unchecked(names), verify=False)
    if kernels:
        lora_fold.sync(model.__dict__[lora_fold.ATTR][1])  # the model's first forward does it in training
    with undoing(lambda: patch.remove_kernels(model), torch._dynamo.reset):
        gapped = []
        for kind, block in blocks.items():
            args = block_inputs(dev, kind)
            for t in saved_tensors(block, args):
                size, storage = t.numel() * t.element_size(), t.untyped_storage().nbytes()
                print(f"\n  {kind}: {tuple(t.shape)} stride {t.stride()} {size / 2**20:.2f} MiB of a "
                      f"{storage / 2**20:.2f} MiB storage, dense {ao.dense(t)}", end="")  # fmt: skip
                if size >= 2**20 and not ao.dense(t):
                    gapped.append((kind, tuple(t.shape), t.stride()))
        assert gapped == []
