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


def test_attention_wrong_everywhere_is_explained_as_the_builds_not_a_kernels():
    from flux_trainer.launch.failure import explain_failure

    tail = [
        "ERROR    kernels: attention: no backend is    runner.py:201",
        "         correct at (1, 24, 4608, 128) bfloat16 mask=False on NVIDIA GeForce RTX 5090 (rejected: sdpa: wrong",
    ]
    text = explain_failure(tail, "vram24")
    assert text.startswith("cause: no attention implementation gave correct results") and "flux-train doctor" in text
    assert "kernels=auto" not in text  # auto would meet the same error


# the ends of two real logs (H100, 2026-11-25), shortened: a compile error inside single_qkv's backward, and CUDA
# graph replay failing with a stack sampler in the process
_COMPILE_FAILED = """\
  File "/tmp/pkgs/flux_kernels/compile_blocks.py", line 116, in call
    return compiled(*args, **kwargs)
torch._dynamo.exc.BackendCompilerFailed: backend='inductor' raised:
RuntimeError: During torch.compile, encountered a mutation on a view chain of length 2, where view 1 was an
While executing %copy_ : [num_users=0] = call_method[target=copy_](args = (%gelu_part, %gelu_backward), kwargs = {})
Original traceback:
  File "/work/main/.gpu/sd-scripts/library/flux_models.py", line 858, in forward
  File "/tmp/pkgs/flux_kernels/patch.py", line 160, in _single_forward
  File "/tmp/pkgs/flux_kernels/single_qkv.py", line 201, in single_qkv
  File "/tmp/pkgs/flux_kernels/single_qkv.py", line 131, in _triton_backward
steps:   0%|          | 0/12 [00:25<?, ?it/s]"""

_GRAPHS_FAILED = """\
  File "/opt/torch/.venv/lib/python3.12/site-packages/torch/_inductor/cudagraph_trees.py", line 2300, in _run
    self.apply_checkpoint_execution_state_in_allocator()
  File "/opt/venv/torch/_inductor/cudagraph_trees.py", line 2700, in apply_checkpoint_execution_state_in_allocator
    assert storage_ptr is not None
           ^^^^^^^^^^^^^^^^^^^^^^^
AssertionError
steps:  33%|███▎      | 4/12 [01:17<02:35, 19.41s/it, avr_loss=2.62]"""


def test_a_compile_error_names_the_kernel_its_traceback_goes_through():
    from flux_trainer.launch.failure import explain_failure

    text = explain_failure(_COMPILE_FAILED.splitlines(), "vram80")
    assert text.startswith("cause: torch.compile failed") and "kernels.set='auto,-single_qkv'" in text, text
    # no kernel's module in the traceback (compile_blocks' own frame is where every block compiles): the blocks
    without = [line for line in _COMPILE_FAILED.splitlines() if "single_qkv" not in line]
    assert "kernels.set='auto,-compile_blocks'" in explain_failure(without, "vram80")
    # the package's layers are folders: a kernel's module in one is named the same (Windows separators too)
    nested = [line.replace("flux_kernels/", "flux_kernels/patches/") for line in _COMPILE_FAILED.splitlines()]
    assert "kernels.set='auto,-single_qkv'" in explain_failure(nested, "vram80")
    windows = [line.replace("/", "\\") for line in nested]
    assert "kernels.set='auto,-single_qkv'" in explain_failure(windows, "vram80")


def test_cuda_graph_replay_failing_points_at_cuda_graphs_false():
    from flux_trainer.launch.failure import explain_failure

    text = explain_failure(_GRAPHS_FAILED.splitlines(), "vram80")
    assert text.startswith("cause: replaying the compiled blocks from CUDA graphs failed"), text
    assert "kernels.cuda_graphs=false" in text
    recorded = [
        '  File "x/torch/_inductor/cudagraph_trees.py", line 1806, in check_invariants',
        "    torch._check(",
        "RuntimeError: TODO: graph recording observed an input tensor deallocate during graph  recording",
    ]
    assert "kernels.cuda_graphs=false" in explain_failure(recorded, None)


def test_out_of_memory_inside_cuda_graphs_or_compile_is_still_out_of_memory():
    from flux_trainer.launch.failure import explain_failure

    in_graphs = _GRAPHS_FAILED.splitlines()[:2] + ["RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB"]
    assert explain_failure(in_graphs, "vram80").startswith("cause: the GPU ran out of memory"), in_graphs
    in_compile = [
        "torch._dynamo.exc.BackendCompilerFailed: backend='inductor' raised:",
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB",
    ]
    assert explain_failure(in_compile, "vram80").startswith("cause: the GPU ran out of memory")
