"""Pinned, non-blocking batches (`train.pin_memory`, hooks.pin_batches) through a real Accelerator on CUDA: the
batches a prepared loader yields are on the GPU and equal to the dataset's. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from flux_trainer.sdscripts.hooks import pin_batches

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (page-locked memory and async copies)"),
]


def first(batch):
    return batch[0]  # sd-scripts' collator: the dataset already returns whole batches


@pytest.mark.parametrize("workers", [0, 1])
def test_pinned_batches_arrive_on_the_gpu_intact(workers):
    from accelerate import Accelerator

    acc = Accelerator()
    assert pin_batches(acc) is not None
    gen = torch.Generator().manual_seed(0)
    data = [{"latents": torch.randn(16, 64, 64, generator=gen), "captions": [f"c{i}"], "none": None} for i in range(8)]
    loader = torch.utils.data.DataLoader(data, batch_size=1, collate_fn=first, num_workers=workers)
    shard = acc.prepare(loader)
    assert loader.pin_memory and acc.non_blocking
    got = []
    for batch in shard:
        assert batch["latents"].is_cuda and batch["none"] is None
        got.append(batch["latents"] * 2)  # used on the GPU before anyone waits for the copy
    assert torch.equal(torch.stack(got).cpu(), torch.stack([d["latents"] * 2 for d in data]))
