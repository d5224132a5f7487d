"""flux_kernels: fast ops for FLUX training with a plain-PyTorch reference beside each, probes and fallback.
Stands alone: never imports flux_trainer or sd-scripts. Triton is imported only when a fast op first runs.

    from flux_kernels.patches.patch import apply_kernels, remove_kernels
    from flux_kernels.runtime.errors import KernelError
    from flux_kernels.runtime.registry import select

    selection = select("auto", accelerator.device)   # or "off", ["qk_norm_rope", ...] / "a,b", "auto,a,-b"
    installed = apply_kernels(flux, selection)        # patches the built model's blocks; remove_kernels undoes it

Kernels: attention (backend chosen by measurement at the run's shape), qk_norm_rope, modulate, gated_residual,
gated_modulate (Triton, forward and backward), fp8_matmul (frozen Linears in fp8 via torch._scaled_mm), lora_fold (a
LoRA factor inside the frozen GEMM: B on widening layers, A on narrowing ones), lora_grad_norms (sd-scripts' per-step
LoRA gradient norms from rank-sized factors), prodigy_step and adamw_step (the optimizer's step with no per-tensor host
reads; install into the optimizer), single_process_reduce and coalesced_reduce (sd-scripts' gradient all-reduce: none on
one process, one collective per dtype on several; install into the trainer), selective_checkpoint (checkpointed blocks
keep their attention and wide-input matmul outputs), compile_blocks (regional torch.compile), activation_offload (what
checkpointed compiled blocks keep for backward waits in page-locked host memory; opt-in), block_swap (sd-scripts'
--blocks_to_swap schedule with page-locked weight copies made once and side-stream copies, no host waits). `auto` =
attention + fp8_matmul (only on an fp8 base) + lora_fold (widening and narrowing layers, without checkpointing) +
lora_grad_norms (where a LoRA is applied) + prodigy_step or adamw_step (whichever the optimizer is) + the all-reduce
pair + selective_checkpoint (where blocks are checkpointed) + compile_blocks + block_swap (where sd-scripts swaps
blocks); the Triton ones are opt-in (registry `in_auto`);
"auto,name,-other" adds to and takes from auto (`runtime.request`).

Layers, one folder each (imports go from runtime's leaves up to its registry; no module imports one that imports it):
  ops/      a fast kernel beside its plain-PyTorch reference: `reference` (sd-scripts' math), `fast` (Triton behind
            autograd.Function; `_launch` and the `tl_*` kernels), the optimizer's and the trainer's steps (`prodigy`,
            `adamw`, `single_process`, `coalesced_reduce`)
  patches/  what changes sd-scripts' model: `patch` (installing into a built model; `blocks` finds the blocks,
            `verify` checks them), `attention` (backends, probe and choice; `fa4` its cuDNN + FlashAttention-4
            backend), `single_qkv`, `fp8` (fp8 matmuls as custom ops), `lora_fold`, `lora_norms`, `prologue`,
            `compile_blocks` (with `graph_record`: CUDA graph recording without cudagraph trees' quadratic search)
  memory/   what checkpointed blocks keep, and where: `selective_checkpoint`, `activation_offload`, `l2` (not
            installed); where swapped blocks' weights live: `block_swap`
  runtime/  `registry` (KernelSpec, probe, select: the one table of kernels; `applies` and `examples` its conditions
            and probe inputs), `request` (kernels.set, without torch), `errors`, `device` (what device is this),
            `timing`
"""

_EXPORTS = {
    "select": "runtime.registry",
    "probe": "runtime.registry",
    "REGISTRY": "runtime.registry",
    "KernelSpec": "runtime.registry",
    "KernelError": "runtime.errors",
    "Selection": "runtime.registry",
    "apply_kernels": "patches.patch",
    "remove_kernels": "patches.patch",
    "probe_attention": "patches.attention.probe",
    "device_info": "runtime.device",
    "unchecked": "runtime.registry",
}


def __getattr__(name: str):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(f"flux_kernels.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'flux_kernels' has no attribute {name!r}")


__all__ = list(_EXPORTS)
