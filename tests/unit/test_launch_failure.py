

def test_our_own_missing_module_is_not_a_pip_package():
    from flux_trainer.launch.failure import explain_failure

    text = explain_failure(["ModuleNotFoundError: No module named 'flux_kernels'"], None)
    assert "reinstall flux-train" in text and "pip install flux_kernels" not in text
