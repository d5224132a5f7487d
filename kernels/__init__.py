"""flux_kernels: fast ops for FLUX training with a plain-PyTorch reference beside each, probes and fallback.
Stands alone: never imports flux_trainer or sd-scripts. Triton is imported only when a fast op first runs.

    from flux_kernels.patch import apply_kernels, remove_kernels
    from flux_kernels.registry import KernelError, select

    selection = select("auto", accelerator.device)   # or "off", ["qk_norm_rope", ...] / "a,b", "auto,a,-b"
    installed = apply_kernels(flux, selection)        # patches the built model's blocks; remove_kernels undoes it

Kernels: attention (backend chosen by measurement at the run's shape), qk_norm_rope, modulate, gated_residual,
gated_modulate (Triton, forward and backward), fp8_matmul (frozen Linears in fp8 via torch._scaled_mm), lora_fold (a
LoRA factor inside the frozen GEMM: B on widening layers, A on narrowing ones), lora_grad_norms (sd-scripts' per-step
LoRA gradient norms from rank-sized factors), prodigy_step and adamw_step (the optimizer's step with no per-tensor host
reads; install into the optimizer), single_process_reduce and coalesced_reduce (sd-scripts' gradient all-reduce: none on
one process, one collective per dtype on several; install into the trainer), selective_checkpoint (checkpointed blocks
keep their attention and wide-input matmul outputs), compile_blocks (regional torch.compile), activation_offload (what
checkpointed compiled blocks keep for backward waits in page-locked host memory; opt-in). `auto` = attention +
fp8_matmul (only on an fp8 base) + lora_fold (widening and narrowing layers, without checkpointing) + lora_grad_norms
(where a LoRA is applied) + prodigy_step or adamw_step (whichever the optimizer is) + the all-reduce pair +
selective_checkpoint (where blocks are checkpointed) + compile_blocks; the Triton ones are opt-in (registry `in_auto`);
"auto,name,-other" adds to and takes from auto (`request`). Modules: `reference` (sd-scripts' math), `fast` (Triton
behind autograd.Function), `fp8` (fp8 matmuls as custom ops; `tl_transpose` its weight transpose), `lora_fold`,
`lora_norms`, `selective_checkpoint`, `compile_blocks` (with `graph_record`, CUDA graph recording without cudagraph
trees' quadratic alias search), `activation_offload`, `attention` (backend probe and choice; `attention_fa4` its cuDNN +
FlashAttention-4 backend), `registry` (KernelSpec, probe, select), `patch` (installing into a built model), `device`
(what device is this).
"""

_EXPORTS = {
    "select": "registry",
    "probe": "registry",
    "REGISTRY": "registry",
    "KernelSpec": "registry",
    "KernelError": "patch",
    "Selection": "registry",
    "apply_kernels": "patch",
    "remove_kernels": "patch",
    "probe_attention": "attention",
    "device_info": "device",
    "unchecked": "registry",
}


def __getattr__(name: str):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(f"flux_kernels.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'flux_kernels' has no attribute {name!r}")


__all__ = list(_EXPORTS)
