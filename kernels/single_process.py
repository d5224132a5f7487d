"""`single_process_reduce`: no gradient all-reduce where there is one process.

sd-scripts averages the network's gradients over processes itself after every backward (`all_reduce_network`:
`param.grad = accelerator.reduce(param.grad, "mean")` for each parameter). On one process accelerate's reduce has
nobody to talk to, but it still clones the tensor and divides the clone by the process count: for a FLUX LoRA (608
tensors) ~1.2k small kernels and their Python every step, at the end of the backward, where the step waits for them
(H200 profile: ~2 ms of copies and divisions before the optimizer). Dividing by 1 is exact, so leaving the gradients
as they are gives the same bits. With more than one process the trainer's own reduce runs, unchanged.

Duck-typed on the trainer (an `all_reduce_network(accelerator, network)` method) and the accelerator (its
`num_processes`); nothing here imports sd-scripts.
"""

from __future__ import annotations

import torch

ATTR = "_flux_single_process_reduce"  # on the trainer: its own all_reduce_network, put back by uninstall


def install(trainer) -> str:
    """Wrap `trainer.all_reduce_network` so that it does nothing when the accelerator has one process."""
    reduce = getattr(trainer, "all_reduce_network", None)
    if not callable(reduce):
        raise ValueError(f"single_process_reduce: {type(trainer).__name__} has no all_reduce_network")
    if ATTR in trainer.__dict__:
        return "single_process_reduce: already installed"

    def all_reduce_network(accelerator, network):
        if getattr(accelerator, "num_processes", 1) == 1:
            return None
        return reduce(accelerator, network)

    trainer.__dict__[ATTR] = trainer.__dict__.get("all_reduce_network")
    trainer.all_reduce_network = all_reduce_network
    return "single_process_reduce: the gradient all-reduce runs only with more than one process"


def uninstall(trainer) -> bool:
    if ATTR not in trainer.__dict__:
        return False
    previous = trainer.__dict__.pop(ATTR)
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
