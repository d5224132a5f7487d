"""train.sync_free on the GPU: the loop's loss read and the norm means do not wait for the work queued after
them (the backward and the optimizer step), where a plain `.item()` does. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from flux_trainer.sdscripts.step_values import DeferredNorms, early_loss

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the waits it removes are host-device)"),
]

BUSY_CYCLES = 2_000_000_000  # ~1 s of one spinning kernel: the rest of a step, queued behind the loss


def a_loss(dev) -> torch.Tensor:
    w = torch.randn(512, 512, device=dev, requires_grad=True)
    x = torch.randn(64, 512, device=dev)
    return (x @ w).float().pow(2).mean()


def test_the_loss_read_waits_for_the_forward_only(dev):
    loss = a_loss(dev)
    early = early_loss(loss)
    torch.cuda._sleep(BUSY_CYCLES)
    value = early.detach().item()
    still_busy = not torch.cuda.current_stream().query()
    torch.cuda.synchronize()
    assert still_busy, "the read waited for the work queued after the loss"
    assert value == loss.item()

    plain = a_loss(dev)  # the control: sd-scripts' own read drains the queue
    torch.cuda._sleep(BUSY_CYCLES)
    plain.detach().item()
    assert torch.cuda.current_stream().query()


def test_norm_means_are_written_once_landed_without_draining_the_queue(dev):
    class Network:
        def grad_norms(self):
            return torch.rand(304, device=dev) + 1.0

    net, norms, written = Network(), DeferredNorms(), []
    norms.install(net)
    assert net.grad_norms() is None
    norms.label(1)
    torch.cuda._sleep(BUSY_CYCLES)
    while not norms.pending[0].copy.ready():
        pass
    assert norms.flush(lambda values, step: written.append((step, values))) == 1
    still_busy = not torch.cuda.current_stream().query()
    torch.cuda.synchronize()
    assert still_busy and written[0][0] == 1 and 1.0 < written[0][1]["norm/avg_grad_norm"] < 2.0
