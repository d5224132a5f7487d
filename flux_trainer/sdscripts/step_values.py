"""The numbers sd-scripts' loop reads back every step, without the loop waiting for the step to finish
(`train.sync_free`).

sd-scripts' training loop ends each step with two reads from the device: the mean of the LoRA network's gradient
norms (`grad_norms().mean().item()`, for the `norm/avg_grad_norm` tag) and the loss (`loss.detach().item()`, for
the progress bar and `loss/*`). Both are queued behind the whole backward and the optimizer step, so the host waits
for the device to drain, then runs the loop's bookkeeping and the next batch's preparation while the device sits
idle (~4 ms a step at `vram80` on an H200).

Here:
- the loss is copied to page-locked host memory as soon as the forward has made it (`early_loss`); its `.item()`
  waits for that copy only, which is long done by the time the loop asks, so the host goes on to the next step
  while the device is still in the backward;
- the network's norm methods (`DeferredNorms`) hand the loop None (sd-scripts then skips their `.item()` and
  their tag) and queue each mean's copy instead; the tag is written once the copy has landed, normally at the next
  step, under the step it belongs to. The last step waits for its values, so nothing is lost at the end.

Same values, same steps in TensorBoard; only when they are written changes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

log = logging.getLogger("flux_trainer.runner")

# the LoRA network methods sd-scripts' loop calls every step, and the tag it logs each one's mean under
NORM_TAGS = {
    "weight_norms": "norm/avg_key_norm",
    "grad_norms": "norm/avg_grad_norm",
    "combined_weight_norms": "norm/avg_combined_norm",
}
ATTR = "_flux_train_deferred_norms"  # on the network: the methods as they were before DeferredNorms.install


class HostCopy:
    """A device tensor's value on its way to the host: queued without waiting (CUDA: a non-blocking copy into
    page-locked memory and an event behind it); on the CPU, a copy taken at once."""

    def __init__(self, value: torch.Tensor) -> None:
        value = value.detach()
        if value.device.type == "cuda":
            self.host = torch.empty(value.shape, dtype=value.dtype, pin_memory=True)
            self.host.copy_(value, non_blocking=True)
            self.event: Any = torch.cuda.Event()
            self.event.record()
        else:
            self.host, self.event = value.clone(), None

    def ready(self) -> bool:
        return self.event is None or self.event.query()

    def value(self) -> torch.Tensor:
        """The host tensor, once the copy has landed (waits for it, and only for it)."""
        if self.event is not None:
            self.event.synchronize()
        return self.host


class EarlyLoss(torch.Tensor):
    """The loss sd-scripts' `process_batch` returned, with a copy of its value already on its way to the host.
    `.item()` (on it or on its `.detach()`) reads that copy; any other op sees a plain tensor. A loss changed in
    place after the copy was queued (its version counter moved) is read from the device as before."""

    _early: tuple[HostCopy, int] | None = None

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        first = args[0] if args else None
        early = first._early if isinstance(first, EarlyLoss) else None
        if func is torch.Tensor.item and early is not None and early[1] == first._version:
            return early[0].value().item()
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
        if func is torch.Tensor.detach and early is not None:
            out = out.as_subclass(EarlyLoss)
            out._early = early
        return out


def early_loss(loss: torch.Tensor) -> torch.Tensor:
    """`loss` (still in the autograd graph) with its value queued to the host now; see EarlyLoss."""
    out = loss.as_subclass(EarlyLoss)
    out._early = (HostCopy(loss), loss._version)
    return out


@dataclass
class _Pending:
    tag: str
    copy: HostCopy
    step: int | None = None


class DeferredNorms:
    """The LoRA network's per-step norm methods, deferred: each call computes what sd-scripts' method computes,
    queues its mean to the host and returns None. `label(step)` gives the values queued since the last label their
    step; `flush(write)` hands each labelled value that has reached the host to `write({tag: value}, step=step)`
    (accelerate's `Accelerator.log`), in the
    order they were made. Without a `write` (no TensorBoard), nothing is queued at all."""

    def __init__(self, keep: bool = True) -> None:
        self.keep = keep
        self.pending: list[_Pending] = []

    def install(self, network: Any) -> list[str]:
        """Wrap the norm methods `network` has (sd-scripts' LoRANetwork: all three); returns their names."""
        own = getattr(network, "__dict__", None)
        if own is None or ATTR in own:
            return []
        wrapped = {}
        for name, tag in NORM_TAGS.items():
            method = getattr(network, name, None)
            if callable(method):
                wrapped[name] = own.get(name)
                setattr(network, name, self._deferred(method, tag))
        if wrapped:
            setattr(network, ATTR, wrapped)
        return list(wrapped)

    @staticmethod
    def uninstall(network: Any) -> bool:
        wrapped = vars(network).pop(ATTR, None)
        if wrapped is None:
            return False
        for name, previous in wrapped.items():
            vars(network).pop(name, None)
            if previous is not None:
                setattr(network, name, previous)
        return True

    def _deferred(self, method: Callable[[], torch.Tensor | None], tag: str) -> Callable[[], None]:
        def deferred() -> None:
            norms = method()
            if norms is not None and self.keep:
                self.pending.append(_Pending(tag, HostCopy(norms.mean())))

        return deferred

    def label(self, step: int) -> None:
        for p in self.pending:
            if p.step is None:
                p.step = step

    def flush(self, write: Callable[[dict[str, float], int], Any], wait: bool = False) -> int:
        """Write the labelled values whose copies have landed (all of them with `wait`); returns how many."""
        done = 0
        while self.pending and self.pending[0].step is not None and (wait or self.pending[0].copy.ready()):
            p = self.pending.pop(0)
            write({p.tag: float(p.copy.value().item())}, step=p.step)
            done += 1
        return done
