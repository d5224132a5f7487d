"""Why did training fail: the likely cause and its fix, read from the end of the log.

Users meet the same few failures again and again (out of memory, a torch build without kernels for a new card, a
missing package, a NaN loss); naming the cause and the exact config change saves them reading a 200-line traceback.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

from flux_trainer.config.tiers import TIERS as MEMORY_TIERS  # largest first: an OOM at one tier suggests the next

# Import names whose pip package has another name.
_PIP_NAMES = {
    "cv2": "opencv-python-headless",
    "PIL": "pillow",
    "yaml": "pyyaml",
    "google": "protobuf",
    "sklearn": "scikit-learn",
    "pynvml": "nvidia-ml-py",
    "bitsandbytes": "bitsandbytes",
}
_SD_SCRIPTS_MODULES = {"library", "networks", "flux_train_network", "train_network"}


def _next_tier(memory_tier: str | None) -> str:
    if memory_tier in MEMORY_TIERS:
        i = MEMORY_TIERS.index(memory_tier)
        if i + 1 < len(MEMORY_TIERS):
            return f"try the next smaller memory preset: memory={MEMORY_TIERS[i + 1]}"
        return (
            f"memory={memory_tier} is already the smallest preset: raise memory.blocks_to_swap, or lower "
            "dataset.resolution (768 or 512)"
        )
    return "pick a memory preset below your card's VRAM (memory=vram24, vram16, vram12, vram8)"


def _missing_module(m: re.Match) -> str:
    name = m.group(1)
    top = name.split(".")[0]
    if top in _SD_SCRIPTS_MODULES:
        return (
            f"cause: sd-scripts' module '{name}' was not importable: point sd_scripts=... or FLUX_TRAIN_SD_SCRIPTS "
            "at a checkout of the pinned commit."
        )
    if top in ("flux_trainer", "flux_kernels"):
        return (
            f"cause: flux-train's own module '{name}' is not importable in the training process: reinstall "
            "flux-train (pip install .) in the Python that runs it, or put the installed package on its path."
        )
    return f"cause: Python module '{name}' is missing: pip install {_PIP_NAMES.get(top, top)}"


def _compile_failed(text: str) -> str:
    """torch.compile stopped (flux_kernels compiles the model's blocks): name the kernel whose module the traceback
    shows last, so that the run can go on without it; with none shown, the blocks' compilation itself."""
    try:  # on the failure path only: the registry imports torch
        from flux_kernels.runtime.registry import REGISTRY as names
    except ImportError:
        names = {}
    files = re.findall(r"flux_kernels[/\\](?:\w+[/\\])*(\w+)\.py", text)  # flux_kernels/patches/single_qkv.py too
    shown = [n for n in files if n in names and n != "compile_blocks"]
    if shown:
        fix = f"the traceback goes through the {shown[-1]} kernel: leave it out, e.g. kernels.set='auto,-{shown[-1]}'"
    else:
        fix = "kernels.set='auto,-compile_blocks' keeps the other kernels with blocks that are not compiled"
    return (
        f"cause: torch.compile failed. {fix}; kernels=off runs plain sd-scripts. The error above is torch's; "
        "please report it with this log."
    )


_CAUSES: tuple[tuple[str, Callable[[re.Match, str | None], str]], ...] = (
    (
        r"CUDA out of memory|OutOfMemoryError|CUBLAS_STATUS_ALLOC_FAILED|CUDA error: out of memory",
        lambda m, tier: (
            f"cause: the GPU ran out of memory. {_next_tier(tier)}; or turn on "
            "memory.gradient_checkpointing=true, or store the base model in fp8: precision=fp8_base."
        ),
    ),
    (
        r"no kernel image is available|not compatible with the current PyTorch installation|"
        r"CUDA error: invalid device function",
        lambda m, tier: (
            "cause: this torch build has no kernels for your GPU. Install the PyTorch build for your card's "
            "CUDA (RTX 50xx / B200 need CUDA 12.8 or newer: pytorch.org 'Get started' selector, cu128) in this "
            "environment, then run again."
        ),
    ),
    (
        r"CUDA driver version is insufficient",
        lambda m, tier: (
            "cause: the NVIDIA driver is older than the CUDA this torch build needs: update the driver, "
            "or install a torch build for an older CUDA."
        ),
    ),
    (r"No module named '([\w.]+)'", lambda m, tier: _missing_module(m)),
    (
        r"cannot import name 'CLIPFeatureExtractor'|FLAX_WEIGHTS_NAME",
        lambda m, tier: (
            "cause: transformers 5 is installed; sd-scripts needs transformers 4: "
            "pip install 'transformers>=4.54.1,<5' 'huggingface_hub<1'"
        ),
    ),
    (
        r"(?i)\b(?:avr_loss|loss)\s*[=:]\s*nan\b|\bloss is nan\b|\bnan loss\b|\bnans? (?:value|detected)",
        lambda m, tier: (
            "cause: the loss became NaN. Lower optimizer.lr, keep precision.mixed=bf16 (fp16 overflows), "
            "keep optimizer.max_grad_norm > 0, and check the dataset for broken images."
        ),
    ),
    (
        r"ERROR\s+kernels: attention:",  # flux_kernels.attention: no backend correct, PyTorch's own SDPA included
        lambda m, tier: (
            "cause: no attention implementation gave correct results on this GPU with this PyTorch build, PyTorch's "
            "own SDPA included (the ERROR line lists each and why), so training would learn from wrong gradients, "
            "with flux-train's kernels or without. `flux-train doctor` checks the PyTorch build against the card; "
            "install one built for it."
        ),
    ),
    (
        r"ERROR\s+kernels: (?:kernel '(\w+)')?",  # the runner's KernelError line (no traceback)
        lambda m, tier: (
            f"cause: a kernel named in kernels= cannot run here{f' ({m.group(1)})' if m.group(1) else ''}; the "
            "ERROR line above says why. Remove it from kernels.set, or use kernels=auto, which installs only what "
            "applies and passes its probe on this machine."
        ),
    ),
    (
        r"torch\._dynamo\.exc\.(?:BackendCompilerFailed|InternalTorchDynamoError|TorchRuntimeError)|"
        r"torch\._inductor\.exc\.\w+Error|During torch\.compile, ",
        lambda m, tier: _compile_failed(m.string),
    ),
    (
        r"File \"[^\"\n]*cudagraph_trees\.py\"[^\n]*\n(?:[^\n]*\n){0,12}?\s*(?:AssertionError|RuntimeError)\b|"
        r"accessing tensor output of CUDAGraphs that has been overwritten",
        lambda m, tier: (
            "cause: replaying the compiled blocks from CUDA graphs failed (torch's cudagraph trees). "
            "kernels.cuda_graphs=false runs them without graphs. A profiler or stack sampler inside the training "
            "process that reads its Python frames (sys._current_frames) can cause this: profile from outside it "
            "(py-spy, Nsight Systems)."
        ),
    ),
    (
        r"Address already in use|another process is utilizing it|EADDRINUSE",
        lambda m, tier: "cause: the rendezvous port is taken: set launcher.main_port to a free port (e.g. 29501).",
    ),
)


def explain_failure(log_tail: list[str], memory_tier: str | None) -> str:
    """The likely cause of a failed run and its fix, from the end of its log; a plain pointer when unknown.

    Of the known causes, the one mentioned last wins: a traceback's final line comes after earlier warnings
    (an optional module that was not found, a NaN that was survived).
    """
    text = "\n".join(log_tail)
    best: tuple[int, str] | None = None
    for pattern, message in _CAUSES:
        matches = list(re.finditer(pattern, text))
        if matches and (best is None or matches[-1].end() > best[0]):
            best = (matches[-1].end(), message(matches[-1], memory_tier))
    return best[1] if best else "cause: not recognised; the traceback above usually names it."


def oom_kill_count() -> int | None:
    """How many processes the kernel's out-of-memory killer has killed in this process's memory cgroup (v2's
    memory.events or v1's memory.oom_control); None where neither can be read."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        lines = []
    v2 = next((line.split(":", 2)[2] for line in lines if line.startswith("0::")), None)
    v1 = next((line.split(":", 2)[2] for line in lines if ":memory:" in line), None)
    candidates = []
    if v2 is not None:
        candidates.append(Path("/sys/fs/cgroup") / v2.lstrip("/") / "memory.events")
    if v1 is not None:
        candidates.append(Path("/sys/fs/cgroup/memory") / v1.lstrip("/") / "memory.oom_control")
    candidates += [Path("/sys/fs/cgroup/memory.events"), Path("/sys/fs/cgroup/memory/memory.oom_control")]
    for path in candidates:
        try:
            text = path.read_text()
        except OSError:
            continue
        if m := re.search(r"^oom_kill (\d+)$", text, re.M):
            return int(m.group(1))
    return None


def killed_message(oom_before: int | None, oom_after: int | None, memory_tier: str | None) -> str:
    """Why a training process ended by SIGKILL (exit 137): the out-of-memory killer, when host RAM ran out, is the
    usual sender; the cgroup's own count says so where it can be read."""
    seen = oom_before is not None and oom_after is not None and oom_after > oom_before
    likely = "was" if seen else "was most likely"
    evidence = f" (the memory cgroup's oom_kill count went {oom_before} -> {oom_after})" if seen else ""
    return (
        f"cause: the training process was killed (SIGKILL, exit 137): it {likely} the kernel's out-of-memory killer, "
        f"when the machine's RAM ran out{evidence}. Lower host memory use: train.data_loader_workers=0, "
        "memory.blocks_to_swap=0 (swapped blocks live in RAM), close other programs, or add swap; "
        f"{'`dmesg | grep -i oom` shows the kill' if not seen else 'then run again with resume=auto'}."
    )
