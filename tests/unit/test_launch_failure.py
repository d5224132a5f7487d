def test_our_own_missing_module_is_not_a_pip_package():
    from flux_trainer.launch.failure import explain_failure

    text = explain_failure(["ModuleNotFoundError: No module named 'flux_kernels'"], None)
    assert "reinstall flux-train" in text and "pip install flux_kernels" not in text


def test_a_named_kernel_that_cannot_run_is_explained():
    """The runner logs a KernelError as one ERROR line (no traceback), wrapped by the rich handler."""
    from flux_trainer.launch.failure import explain_failure

    tail = [
        "INFO     flux_kernels installed prodigy_step: 26 tensors",
        "ERROR    kernels: kernel 'attention' cannot    runner.py:155",
        "         run on cpu: only meaningful on a CUDA",
    ]
    text = explain_failure(tail, "vram24")
    assert text.startswith("cause: a kernel named in kernels= cannot run here (attention)") and "kernels=auto" in text
    assert "cannot run here;" in explain_failure(["ERROR    kernels: kernels qk_norm_rope failed verification"], None)
    assert explain_failure(["INFO     kernels: off (plain sd-scripts compute path)"], None).startswith(
        "cause: not recognised"
    )
