"""flux_kernels: fast ops for FLUX training with a plain-PyTorch reference beside each, probes and fallback.
Stands alone: never imports flux_trainer or sd-scripts. Triton is imported only when a fast op first runs.

    from flux_kernels.registry import select
    from flux_kernels.patch import apply_kernels, remove_kernels

    selection = select("auto", device)          # or "off", or ["qk_norm_rope", "modulate", ...]
    apply_kernels(flux_model, selection)        # patches the model's blocks in place; remove_kernels undoes it

Modules: `reference` (sd-scripts' math), `fast` (Triton behind autograd.Function), `attention` (backend probe
and choice), `registry` (KernelSpec, probe, select), `patch` (installing into a built model), `device`.
"""

_EXPORTS = {
    "select": "registry",
    "probe": "registry",
    "REGISTRY": "registry",
    "KernelSpec": "registry",
    "KernelError": "registry",
    "Selection": "registry",
    "apply_kernels": "patch",
    "remove_kernels": "patch",
    "probe_attention": "attention",
    "device_info": "device",
}


def __getattr__(name: str):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(f"flux_kernels.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'flux_kernels' has no attribute {name!r}")


__all__ = list(_EXPORTS)
