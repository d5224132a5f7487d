"""Where each kernel applies (`applies`: a device, or a DeviceInfo, to (ok, reason)) and when `auto` installs one
that applies (`auto_if`: the built model to (ok, reason)), as the registry's records name them.
"""

from __future__ import annotations

import os

import torch

from flux_kernels.memory import block_swap
from flux_kernels.patches import fp8, lora_fold, lora_norms
from flux_kernels.patches.blocks import patched_blocks
from flux_kernels.runtime.device import as_device_info, triton_available, triton_interpreting


def triton_applies(device) -> tuple[bool, str]:
    info = as_device_info(device)
    if not triton_available():
        return False, "triton is not installed (pip install triton)"
    if info.type == "cpu":
        if triton_interpreting():
            return True, "CPU through Triton's interpreter (TRITON_INTERPRET=1): for tests, slow"
        return False, "needs a CUDA GPU (device is cpu)"
    if info.type != "cuda":
        return False, f"needs a CUDA GPU (device is {info.type})"
    if info.capability is None or info.capability < (8, 0):
        return False, f"needs sm_80 or newer for bf16 (found {info.name}, capability {info.capability})"
    return True, f"{info.name} ({info.family})"


def cuda_applies(device) -> tuple[bool, str]:
    info = as_device_info(device)
    if info.type != "cuda":
        return False, f"only meaningful on a CUDA GPU (device is {info.type})"
    return True, f"{info.name} ({info.family})"


def fp8_applies(device) -> tuple[bool, str]:
    ok, why = cuda_applies(device)
    if not ok:
        return ok, why
    info = as_device_info(device)
    if not fp8.fp8_capable(info.capability):
        return False, f"needs fp8 tensor cores (sm_89 or newer; found {info.name}, capability {info.capability})"
    if not hasattr(torch, "_scaled_mm"):
        return False, f"torch {torch.__version__} has no torch._scaled_mm"
    return True, why


def fp8_base_only(model) -> tuple[bool, str]:
    """`auto` multiplies in fp8 only where the base weights already are fp8; on a bf16 base fp8 would change
    the frozen model's numbers, so it must be asked for by name."""
    double, single = patched_blocks(model)
    if fp8.has_fp8_weights(double + single):
        return True, "the base weights are fp8"
    return False, "the base weights are not fp8 (name fp8_matmul, or kernels=fp8, to quantise them)"


def any_applies(device) -> tuple[bool, str]:
    return True, f"plain PyTorch, any device ({as_device_info(device).name})"


def several_processes(device) -> tuple[bool, str]:
    """Whether this process trains beside others (WORLD_SIZE, which torch.distributed's launchers set, accelerate's
    included): read before the process group exists."""
    n = int(os.environ.get("WORLD_SIZE") or 1)
    if n > 1:
        return True, f"{n} processes"
    return False, "one process: no gradient all-reduce to coalesce"


def has_lora(model) -> tuple[bool, str]:
    n = len(lora_norms.lora_modules(model))
    return (True, f"{n} LoRA modules") if n else (False, "no LoRA module is applied to the model")


def has_wide_lora(model) -> tuple[bool, str]:
    """`auto` folds the LoRA where there are layers to fold and the model does not checkpoint its blocks: measured
    faster without checkpointing (vram80). With checkpointing it must be named: on an H200 at 1024² the vram48
    default ran 0.4314 s/step with the fold against 0.4250 without (its selectively checkpointed blocks keep more,
    so the planner keeps fewer blocks), vram32 0.5192 against 0.5210. (The ~11 GiB it once added under plain
    checkpointing was torch 2.11 saving what autograd.Functions compute: compile_blocks' routing, see
    flux_kernels.memory.selective_checkpoint.)"""
    n = len(lora_fold.candidates(model))
    if not n:
        return False, f"no plain LoRA on a frozen Linear with {lora_fold.FOLDABLE}"
    if getattr(model, "blocks_to_swap", None):
        return False, "block swap is on (it moves the frozen weights every step)"
    if getattr(model, "gradient_checkpointing", False):
        return False, "gradient checkpointing is on (not faster there at the default tiers: name lora_fold to use it)"
    return True, f"{n} LoRA Linear layers with {lora_fold.FOLDABLE}"


def checkpoints_blocks(model) -> tuple[bool, str]:
    """Selective checkpointing changes only checkpointed blocks, and costs memory the tiers that swap blocks or
    offload checkpoints to the CPU do not have."""
    if not getattr(model, "gradient_checkpointing", False):
        return False, "gradient checkpointing is off (nothing is recomputed)"
    if getattr(model, "cpu_offload_checkpointing", False):
        return False, "checkpoints are offloaded to the CPU (that tier saves memory; its blocks do not call checkpoint)"
    if getattr(model, "blocks_to_swap", None):
        return False, "block swap is on (that tier saves memory)"
    return True, "gradient checkpointing is on"


def swaps_blocks(model) -> tuple[bool, str]:
    """`auto` replaces sd-scripts' block swap where the model has it on (its `enable_block_swap` made the two
    offloaders this kernel takes the place of) and nothing in the blocks stops it (block_swap.refusal: trained or
    mismatched weights); otherwise sd-scripts' own swap stays."""
    n = getattr(model, "blocks_to_swap", None)
    if not n:
        return False, "block swap is off (memory.blocks_to_swap=0)"
    why = block_swap.refusal(model)
    if why:
        return False, f"{why}; sd-scripts' own swap stays"
    return True, f"{n} blocks swapped"


def compile_applies(device) -> tuple[bool, str]:
    ok, why = cuda_applies(device)
    if not ok:
        return ok, why
    if not hasattr(torch.nn.Module, "compile"):
        return False, f"torch {torch.__version__} has no nn.Module.compile (needs 2.2+)"
    if not triton_available():
        return False, "torch.compile's GPU backend needs triton (pip install triton)"
    return True, why
