"""`single_process_reduce`: no gradient all-reduce where there is one process.

sd-scripts averages the network's gradients over processes itself after every backward (`all_reduce_network`:
`param.grad = accelerator.reduce(param.grad, "mean")` for each parameter). On one process accelerate's reduce has
nobody to talk to, but it still clones the tensor and divides the clone by the process count: for a FLUX LoRA (608
tensors) ~1.2k small kernels and their Python every step, at the end of the backward, where the step waits for them
(H200 profile: ~2 ms of copies and divisions before the optimizer). Dividing by 1 is exact, so leaving the gradients
as they are gives the same bits. With more than one process the method it wrapped runs (coalesced_reduce's, where
installed: both wrap the trainer's method through wrap_reduce).

Duck-typed on the trainer (an `all_reduce_network(accelerator, network)` method) and the accelerator (its
`num_processes`); nothing here imports sd-scripts.
"""

from __future__ import annotations

import torch

ATTR = "_flux_single_process_reduce"  # on the trainer: its own all_reduce_network, put back by uninstall


def install(trainer) -> str:
    """Wrap `trainer.all_reduce_network` so that it does nothing when the accelerator has one process."""

    def wrapper(previous):
        def all_reduce_network(accelerator, network):
            if getattr(accelerator, "num_processes", 1) == 1:
                return None
            return previous(accelerator, network)

        return all_reduce_network

    return wrap_reduce(
        trainer, ATTR, wrapper, "single_process_reduce", "the gradient all-reduce runs only with more than one process"
    )


def uninstall(trainer) -> bool:
    return unwrap_reduce(trainer, ATTR)


def wrap_reduce(trainer, attr: str, wrapper, name: str, line: str) -> str:
    """Replace the instance's `all_reduce_network` with `wrapper(the method it had)`, noting the old one under
    `attr` for unwrap_reduce; returns `name: line` (or that it was installed already)."""
    reduce = getattr(trainer, "all_reduce_network", None)
    if not callable(reduce):
        raise ValueError(f"{name}: {type(trainer).__name__} has no all_reduce_network")
    if attr in trainer.__dict__:
        return f"{name}: already installed"
    trainer.__dict__[attr] = trainer.__dict__.get("all_reduce_network")
    trainer.all_reduce_network = wrapper(reduce)
    return f"{name}: {line}"


def unwrap_reduce(trainer, attr: str) -> bool:
    """Undo wrap_reduce (the class's method again where the instance had none of its own)."""
    if attr not in trainer.__dict__:
        return False
    previous = trainer.__dict__.pop(attr)
    if previous is None:
        del trainer.all_reduce_network
    else:
        trainer.all_reduce_network = previous
    return True


def self_check(device: torch.device) -> tuple[bool, str]:
    """The install probe: on this device, what the skipped reduce would give on one process (a copy divided by a
    process count of 1) is bit-identical to the gradient left alone, for random values of each float dtype and
    subnormal ones (a device that flushed those to zero would make the skip a change)."""
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        tiny = torch.finfo(dtype).smallest_normal
        values = torch.cat([torch.randn(64 * 33, generator=gen) * 3, torch.tensor([tiny / 2, -tiny / 8, tiny / 64])])
        grad = values.to(dtype).to(device)
        mean = grad.clone()
        mean /= 1
        if not torch.equal(mean, grad):
            return False, f"{dtype}: dividing by one process changes the gradient here"
    return True, "a gradient averaged over one process is the gradient itself, bit for bit"
