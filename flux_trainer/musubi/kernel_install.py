"""What `kernels=` installs on musubi-tuner's FLUX.2 / Kontext training, from our trainer subclass (runner.py), never
through the TOML (the bench runs plain musubi-tuner on our very TOMLs: a TOML key would speed up the baseline too).

What applies here (backend.options.MUSUBI_KERNELS): `attention`, flux_kernels' measured backend choice in the
blocks' plain self-attention (attention.py: verified against musubi-tuner's attention function first), `compile_blocks`,
as its own mechanism for musubi-tuner's blocks (block_compile.py: verified against the eager block first, and installed
after the attention, so that it traces ours), and the optimizer's steps `prodigy_step` / `adamw_step` (musubi-tuner
builds the same optimizer classes sd-scripts does; flux_kernels' registry probes them). The other kernels patch
sd-scripts' FLUX.1 model (its block ops, prologue, LoRA module) or its trainer and do not fit musubi-tuner's objects;
the config check refuses them by name, and `auto` does without them.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from flux_trainer.config import ConfigError

log = logging.getLogger("flux_trainer.musubi.runner")
# measured on the 2-core CPU, random_flux2_klein_tiny, bf16: the probe 190 s and the first step 127 s, then 7.1 s/step
# against 4.1 uncompiled; as on sd-scripts' side (flux_kernels' compile_applies), auto leaves the CPU alone
ON_CPU = {  # (what auto does on a CUDA GPU only, how to have it on the CPU anyway)
    "attention": (
        "chooses the attention backend",
        "kernels.set=auto,attention installs it anyway (the probe picks among PyTorch's CPU backends, for tests)",
    ),
    "compile_blocks": ("compiles", "kernels=compile installs it anyway (minutes of compiling on a CPU, for tests)"),
}
# measured 2026-11-29 on an H200 (klein 4B vram8, 13 blocks swapped; 9B vram12, 16 swapped): with blocks swapped the
# blocks' Linear layers stay out of the graphs, and compiling the rest gave 0.97-1.03x the uncompiled step while the
# card held 1.7-2.2 GiB more (9B vram12: 11.6 GiB against 9.4, over the tier's 11.5) and the first step came 55-100 s
# later; so auto leaves the compile out wherever blocks are swapped
WITH_SWAP = (
    "with blocks swapped their Linear layers stay out of the graphs, and the compile measured 0.97-1.03x the "
    "uncompiled step with 1.7-2.2 GiB more on the card; kernels=compile installs it anyway"
)
WHAT = {
    "prodigy_step": "Prodigy's step in multi-tensor ops, where the optimizer is prodigyopt's Prodigy",
    "adamw_step": "torch's AdamW step fused, where the optimizer is AdamW",
    "attention": "the attention backend measured at the run's shape, checked against musubi-tuner's attention",
    "compile_blocks": "regional torch.compile of the double and single blocks, checked against the eager block",
}
ON_GPU = ("attention", "compile_blocks")  # auto installs these on a CUDA GPU only (named: on the CPU too)
# what training goes on with where one is skipped
INSTEAD = {
    "attention": "training goes on with musubi-tuner's own attention",
    "compile_blocks": "training goes on uncompiled",
}
OPTIMIZER_KERNELS = ("prodigy_step", "adamw_step")


def wanted(kernel_set: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(what to try, what was named) for a `kernels.set` on musubi-tuner's models (backend.options.musubi_kernels);
    ConfigError (one line) for one they cannot take."""
    from flux_trainer.backend.options import musubi_kernel_problem, musubi_kernels

    problem = musubi_kernel_problem(kernel_set)
    if problem:
        raise ConfigError(problem)
    return musubi_kernels(kernel_set)


def _swapped_unless_named(cfg: Any, named: tuple[str, ...]) -> int:
    """The blocks this run swaps, where that leaves auto's compile out (0: it does not)."""
    return int(cfg.get("memory", {}).get("blocks_to_swap") or 0) if "compile_blocks" not in named else 0


def planned(cfg: Any) -> tuple[str, ...]:
    """The kernels this run will try: `kernels.set`'s, less auto's compile where blocks are swapped (ConfigError for a
    set that cannot apply)."""
    names, named = wanted(str(cfg.kernels.get("set", "auto")))
    swapped = _swapped_unless_named(cfg, named)
    return tuple(n for n in names if not (n == "compile_blocks" and swapped))


def kernels_line(cfg: Any) -> str:
    """The run header's line: what `kernels=` will try on this run (ConfigError for a set that cannot apply)."""
    names, named = wanted(str(cfg.kernels.get("set", "auto")))
    if not names:
        return "kernels: off (plain musubi-tuner compute path)"
    swapped = _swapped_unless_named(cfg, named)
    parts = []
    for n in names:
        if n == "compile_blocks" and swapped:
            parts.append(f"compile_blocks left out (memory.blocks_to_swap={swapped}: {WITH_SWAP})")
            continue
        parts.append(f"{n} ({WHAT[n]}{'' if n in named or n not in ON_GPU else ', on a CUDA GPU'})")
    return "kernels: " + "; ".join(parts) + "; each installed by the runner where its check passes"


def install_kernels(
    trainer: Any,
    args: Any,
    accelerator: Any,
    network: Any,
    transformer: Any,
    kernels: dict[str, Any],
    on_optimizer: list[str] | None = None,
) -> list[str]:
    """Install what `kernels` asks on musubi-tuner's prepared transformer (called from on_train_start: after
    accelerate prepared it and musubi-tuner set up checkpointing and block swap, before the first step). Returns the
    names installed, `on_optimizer`'s first; each one skipped is one log line saying why, and training goes on
    without it. A kernel the user named that cannot be installed is a KernelError."""
    kernel_set = str(kernels.get("set", "auto"))
    names, named = wanted(kernel_set)
    if not names:
        log.info("kernels: off (plain musubi-tuner compute path)")
        return []
    installed = list(on_optimizer or [])  # install_optimizer_kernels' (musubi-tuner builds the optimizer first)
    swapped = getattr(trainer, "blocks_to_swap", 0) or 0
    attempts = {
        "attention": lambda: install_attention(args, accelerator, transformer),
        "compile_blocks": lambda: compile_blocks(trainer, args, accelerator, network, transformer),
    }
    for name, attempt in attempts.items():  # the attention first: the compiled blocks trace it
        if name not in names:
            continue
        began = time.monotonic()
        if name == "compile_blocks" and name not in named and swapped > 0:
            ok, why = False, f"{swapped} blocks are swapped: {WITH_SWAP}"
        elif name in named or accelerator.device.type == "cuda":
            try:
                ok, why = attempt()
            except Exception as exc:  # noqa: BLE001 - an install that breaks is a skipped kernel, not a failed run
                ok, why = False, f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300] if str(exc) else ''}"
        else:
            how, instead = ON_CPU[name]
            ok, why = False, f"auto {how} on a CUDA GPU only (device is {accelerator.device.type}); {instead}"
        if ok:
            log.info("kernels: installing %s: %s (checked in %.1f s)", name, why, time.monotonic() - began)
            installed.append(name)
        elif name in named:
            from flux_kernels.runtime.errors import KernelError

            raise KernelError(f"{name} cannot be installed: {why}; use kernels=auto or kernels=off")
        else:
            log.info("kernel %s skipped: %s; %s", name, why, INSTEAD[name])
    log.info("kernels: %s", ", ".join(installed) or "none")
    return installed


def install_optimizer_kernels(optimizer: Any, kernels: dict[str, Any]) -> list[str]:
    """The optimizer's kernels (prodigy_step, adamw_step) on the optimizer musubi-tuner's get_optimizer built, before
    accelerate wraps it: flux_kernels' registry probes each on this device and installs it where the optimizer is its
    class, as on sd-scripts' side (the same function); one that does not fit is one line."""
    names, _ = wanted(str(kernels.get("set", "auto")))
    if not any(n in OPTIMIZER_KERNELS for n in names):
        return []
    from flux_trainer.sdscripts.kernel_install import install_optimizer_kernels as install

    return install(optimizer, kernels)


def compile_blocks(trainer: Any, args: Any, accelerator: Any, network: Any, transformer: Any) -> tuple[bool, str]:
    """Probe one double and one single block compiled against eager, then compile every block in place. (ok, line)."""
    import contextlib

    import torch

    from flux_trainer.musubi import attention as musubi_attention
    from flux_trainer.musubi import block_compile as bc

    if getattr(args, "compile", False):
        return False, "musubi-tuner compiles the blocks itself (compile is set in its TOML)"
    model = accelerator.unwrap_model(transformer)
    double, single = bc.blocks_of(model)
    if not double or not single or not hasattr(model, "pe_embedder"):
        return False, f"{type(model).__name__} has no double_blocks / single_blocks to compile"
    device = next(double[0].parameters()).device
    ok, why = bc.compiler_available(device)
    if not ok:
        return False, why
    mixed, dtype = run_dtype(args, double[0])
    lora = accelerator.unwrap_model(network)
    params = [p for p in lora.parameters() if p.requires_grad]
    undo = lambda: None  # noqa: E731
    if (getattr(trainer, "blocks_to_swap", 0) or 0) > 0:
        from musubi_tuner.utils import model_utils

        undo = bc.disable_swapped_linears(double + single, model_utils)
    amp = accelerator.autocast if mixed else contextlib.nullcontext
    results = []
    rng_devices = [device] if device.type == "cuda" else []
    try:  # the probe draws its own random numbers: the run's RNG state is put back, so its noise is kernels=off's
        with torch.random.fork_rng(devices=rng_devices), bc.lora_eval(lora.modules()):
            for kind, blocks in (("double", double), ("single", single)):
                results.append(
                    bc.probe_block(
                        blocks[0],
                        lambda seed, kind=kind: bc.example_inputs(model, kind, device, dtype, seed),
                        params,
                        dtype,
                        amp,
                        kind,
                    )
                )
                if not results[-1].ok:
                    break
    except BaseException:
        undo()
        raise
    finally:
        torch._dynamo.reset()  # the probe's static graphs go: training compiles from its own first shape
    failed = next((r for r in results if not r.ok), None)
    if failed is not None:
        undo()
        return False, failed.why
    attention = musubi_attention.installed(model)  # its SDPA backend held around every compiled call
    bc.compile_in_place(double + single, hold=attention.dispatch.compiled_context if attention else None)
    notes = [r.why for r in results]
    if (getattr(trainer, "blocks_to_swap", 0) or 0) > 0:
        notes.append("block swap: Linear layers left out of the graphs, as musubi-tuner's own compile does")
    if getattr(model, "gradient_checkpointing", False):
        notes.append("checkpointed blocks: the checkpoint is traced inside each block's graph")
    return True, f"{len(double)} double + {len(single)} single blocks; " + "; ".join(notes)


def run_dtype(args: Any, block: Any) -> tuple[Any, Any]:
    """(autocast's dtype or None, the activations' dtype) of the run: the autocast one, else the blocks' own
    (musubi-tuner keeps FLUX.2's DiT in bf16 even with mixed_precision=no; an fp8 base computes in bf16)."""
    import torch

    from flux_trainer.musubi.block_compile import TOLERANCE

    mixed = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(str(args.mixed_precision))
    weight = next(block.parameters()).dtype
    return mixed, mixed or (weight if weight in TOLERANCE else torch.bfloat16)


def new_dispatch(device: Any) -> Any:
    """flux_kernels' AttentionDispatch for the training device (its verdicts cached where sd-scripts' runs keep
    theirs, `FLUX_KERNELS_CACHE` or flux-train's cache folder)."""
    from flux_kernels.patches.attention.dispatch import AttentionDispatch

    return AttentionDispatch(device=device)


def install_attention(args: Any, accelerator: Any, transformer: Any) -> tuple[bool, str]:
    """The measured attention backend in the blocks' plain self-attention (attention.py), verified against
    musubi-tuner's attention function at a few tokens first. (ok, line)."""
    from flux_trainer.musubi import attention
    from flux_trainer.musubi.block_compile import blocks_of

    model = accelerator.unwrap_model(transformer)
    double, single = blocks_of(model)
    if not double and not single:
        return False, f"{type(model).__name__} has no double_blocks / single_blocks"
    _, dtype = run_dtype(args, (double + single)[0])
    ok, line = attention.install(model, new_dispatch(accelerator.device), accelerator.device, dtype)
    if not ok:
        return False, line
    return True, f"{type(model).__module__}.attention in its plain self-attention calls; {line}"
