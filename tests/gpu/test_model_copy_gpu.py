"""train.staged_copy on CUDA: the model moved through pinned buffers and side streams is bit for bit what
Module.to gives, also where the default stream was still writing the memory the copies land in, and accelerate's
prepare afterwards keeps it in place. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from flux_trainer.sdscripts import model_copy

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (page-locked memory and side streams)"),
]


def model(seed: int) -> torch.nn.Module:
    gen = torch.Generator().manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(3072, 9216), torch.nn.Linear(9216, 3001), torch.nn.Linear(8, 8))
    for p in m.parameters():
        p.data = torch.randn(p.shape, generator=gen).to(torch.bfloat16)
    m[1].weight.data = m[1].weight.data.to(torch.float8_e4m3fn)
    m.register_buffer("scale", torch.rand(9216, 300, generator=gen))
    return m


@pytest.mark.parametrize("threads, chunk_mib", [(1, 64), (4, 3)])
def test_staged_copy_matches_module_to(dev, threads, chunk_mib):
    ref = model(0).to(dev)
    m = model(0)
    busy = torch.empty(512 << 20, dtype=torch.uint8, device=dev)
    for _ in range(20):
        busy.add_(1)  # work queued on the default stream; its memory freed into the pool the copies draw from
    del busy
    report = model_copy.staged_copy(m, dev, threads=threads, chunk=chunk_mib << 20)
    assert (
        report is not None and report.pinned and report.tensors == 3
    )  # the two large weights and the buffer; biases go the plain way
    for (name, a), b in zip(
        [*m.named_parameters(), *m.named_buffers()], [*ref.parameters(), *ref.buffers()], strict=True
    ):
        assert a.device == b.device and a.dtype == b.dtype and a.shape == b.shape, name
        assert torch.equal(model_copy._bytes(a.detach()), model_copy._bytes(b.detach())), name


def test_accelerate_keeps_the_moved_model_in_place(dev):
    from accelerate import Accelerator

    m = model(1)
    model_copy.staged_copy(m, dev, threads=2)
    pointers = [t.data_ptr() for t in m.parameters()]
    prepared = Accelerator().prepare(m)
    assert [t.data_ptr() for t in prepared.parameters()] == pointers
