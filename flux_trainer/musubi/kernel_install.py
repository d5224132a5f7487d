"""What `kernels=` installs on musubi-tuner's FLUX.2 / Kontext training, from our trainer subclass (runner.py), never
through the TOML (the bench runs plain musubi-tuner on our very TOMLs: a TOML key would speed up the baseline too).

What applies here (backend.options.MUSUBI_KERNELS): `compile_blocks`, as its own mechanism for musubi-tuner's blocks
(block_compile.py: verified against the eager block first), and the optimizer's steps `prodigy_step` / `adamw_step`
(musubi-tuner builds the same optimizer classes sd-scripts does; flux_kernels' registry probes them). The other
kernels patch sd-scripts' FLUX.1 model (its block ops, attention dispatch, prologue, LoRA module) or its trainer and
do not fit musubi-tuner's objects; the config check refuses them by name, and `auto` does without them.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from flux_trainer.config import ConfigError

log = logging.getLogger("flux_trainer.musubi.runner")
# measured on the 2-core CPU, random_flux2_klein_tiny, bf16: the probe 190 s and the first step 127 s, then 7.1 s/step
# against 4.1 uncompiled; as on sd-scripts' side (flux_kernels' compile_applies), auto leaves the CPU alone
ON_CPU = "kernels=compile installs it anyway (minutes of compiling on a CPU, for tests)"
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
    "compile_blocks": "regional torch.compile of the double and single blocks, checked against the eager block",
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
        parts.append(f"{n} ({WHAT[n]}{'' if n in named or n != 'compile_blocks' else ', on a CUDA GPU'})")
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
    if "compile_blocks" in names:
        began = time.monotonic()
        swapped = (getattr(trainer, "blocks_to_swap", 0) or 0) > 0
        if "compile_blocks" not in named and swapped:
            ok, why = False, f"{trainer.blocks_to_swap} blocks are swapped: {WITH_SWAP}"
        elif "compile_blocks" in named or accelerator.device.type == "cuda":
            try:
                ok, why = compile_blocks(trainer, args, accelerator, network, transformer)
            except Exception as exc:  # noqa: BLE001 - an install that breaks is a skipped kernel, not a failed run
                ok, why = False, f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300] if str(exc) else ''}"
        else:
            ok, why = False, f"auto compiles on a CUDA GPU only (device is {accelerator.device.type}); {ON_CPU}"
        if ok:
            log.info("kernels: installing compile_blocks: %s (checked in %.1f s)", why, time.monotonic() - began)
            installed.append("compile_blocks")
        else:
            if "compile_blocks" in named:
                from flux_kernels.runtime.errors import KernelError

                raise KernelError(f"compile_blocks cannot be installed: {why}; use kernels=auto or kernels=off")
            log.info("kernel compile_blocks skipped: %s; training goes on uncompiled", why)
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
    # the activations' dtype: the autocast one, else the blocks' own (musubi-tuner keeps FLUX.2's DiT in bf16 even
    # with mixed_precision=no; an fp8 base computes in bf16)
    mixed = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(str(args.mixed_precision))
    weight = next(double[0].parameters()).dtype
    dtype = mixed or (weight if weight in bc.TOLERANCE else torch.bfloat16)
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
    bc.compile_in_place(double + single)
    notes = [r.why for r in results]
    if (getattr(trainer, "blocks_to_swap", 0) or 0) > 0:
        notes.append("block swap: Linear layers left out of the graphs, as musubi-tuner's own compile does")
    if getattr(model, "gradient_checkpointing", False):
        notes.append("checkpointed blocks: the checkpoint is traced inside each block's graph")
    return True, f"{len(double)} double + {len(single)} single blocks; " + "; ".join(notes)
