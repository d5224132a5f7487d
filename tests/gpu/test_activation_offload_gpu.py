"""activation_offload on a real GPU: full-size sd-scripts blocks (hidden 3072, 512 + 4096 tokens), compiled,
checkpointed selectively as training runs them, their saved tensors through page-locked host memory on a side
stream: the same outputs and gradients, and the card holds less between forward and backward by about what went
to the host. Skipped without CUDA."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from flux_kernels import activation_offload as ao
from flux_kernels import compile_blocks, patch, registry
from flux_kernels import selective_checkpoint as sac
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
    try:
        _step(model, args, dev)  # compiles
        want, held_plain = _step(model, args, dev)
        again, _ = _step(model, args, dev)  # the run-to-run difference without offload (attention's backward)
        ao.install(model, keep_last=0)
        off = ao.offloader_of(model)
        _step(model, args, dev)  # the host buffers are allocated
        got, held = _step(model, args, dev)
    finally:
        patch.remove_kernels(model)
        torch._dynamo.reset()
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
