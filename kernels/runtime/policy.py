"""When the kernels' run-wide switches turn on: CUDA graphs over the compiled blocks, and fp8_matmul keeping its
weights' transposes. Decisions only, from a plain description of the run (no torch, no config library); the caller
phrases the reasons in its own words and keys.

Each switch is `auto`, `true` or `false`. `auto` turns a switch on where memory is not traded for speed (no gradient
checkpointing, no block swap: the largest tier), since both cost card memory; `true` turns it on anywhere it can
run, and CUDA graphs asked for where they cannot run is refused with the reasons (`GraphsBlocked`).
"""

from __future__ import annotations

from dataclasses import dataclass

SETTINGS = ("auto", "true", "false")

# Why CUDA graphs cannot replay the compiled blocks. A graph fixes every address it reads and writes: it needs the
# compiled blocks, weights that stay put and one backward per optimizer step.
NO_GPU = "no_gpu"
NO_COMPILED_BLOCKS = "no_compiled_blocks"
WEIGHTS_MOVE = "weights_move"  # sd-scripts' own block swap, or CPU-offloaded checkpointing
ACCUMULATION = "accumulation"  # gradient accumulation: a replay would overwrite the gradients being summed


@dataclass(frozen=True)
class RunShape:
    """What the switches depend on."""

    gpu: bool
    compiles_blocks: bool  # the kernel request includes compile_blocks (kernels=auto does)
    gradient_checkpointing: bool
    weights_move: bool  # block swap or CPU-offloaded checkpointing: frozen weights travel between CPU and GPU
    gradient_accumulation_steps: int = 1
    # the memory tier has room for the graphs' pool beside checkpointing (memory.cuda_graphs): `auto` replays there too
    graphs_fit: bool = False
    # the blocks' text length changes from batch to batch (Chroma: sd-scripts trims the text to each batch's longest
    # caption before the blocks): every new length would record new graphs, so `auto` does not replay there
    varying_text: bool = False
    # the swap is flux_kernels' block_swap (requested; installed where sd-scripts' own would run), which copies each
    # swapped block into the same card buffers at every use (block j always runs from those block j % (N - S) started
    # with), so a graph recorded over a swapped block reads the right weights at every replay; sd-scripts' own swap
    # moves the tensors themselves. CPU-offloaded checkpointing (`offloads_checkpoints`) still blocks the graphs.
    swap_in_place: bool = False
    offloads_checkpoints: bool = False
    # the run renders samples between steps: the graphs' pools (~3 GiB at the 16 GB tier) stay on the card through
    # them, and on a tier that swaps blocks the autoencoder's decode at 1024 px then ran out of the tier's memory
    # (H200 under vram16's cap, 10 blocks swapped, 2026-11-29: 14.76 of 14.99 GiB allocated, 2.94 in the pools, 1 GiB
    # more asked for); `auto` leaves the graphs off there, `true` keeps them
    samples: bool = False

    @property
    def trades_memory(self) -> bool:
        return self.gradient_checkpointing or self.weights_move


class GraphsBlocked(ValueError):
    """CUDA graphs were asked for (`true`) where they cannot run; `blockers` says why (the constants above)."""

    def __init__(self, blockers: list[str]) -> None:
        super().__init__(", ".join(blockers))
        self.blockers = blockers


def setting(value: object) -> str:
    """A switch's value as one of SETTINGS (a config reads `true` as a bool); ValueError for anything else."""
    text = str(value).strip().lower()
    if text not in SETTINGS:
        raise ValueError(f"{value}: choose auto, true or false")
    return text


def cuda_graph_blockers(shape: RunShape) -> list[str]:
    blockers = [] if shape.gpu else [NO_GPU]
    if not shape.compiles_blocks:
        blockers.append(NO_COMPILED_BLOCKS)
    if shape.weights_move and (shape.offloads_checkpoints or not shape.swap_in_place):
        blockers.append(WEIGHTS_MOVE)
    if shape.gradient_accumulation_steps > 1:
        blockers.append(ACCUMULATION)
    return blockers


def cuda_graphs(value: object, shape: RunShape) -> bool:
    """Whether the compiled blocks replay from CUDA graphs (torch.compile "reduce-overhead"). `auto`: where memory
    is not traded for speed, or where the tier says its memory has room for the graphs' own pool (about 1.5 GiB on the
    card) beside checkpointing (`graphs_fit`), but not on a tier that swaps blocks where the run renders samples
    (`samples`, above). With flux_kernels' block_swap the tiers that swap replay too (`swap_in_place`): at the 16 GB
    tier's cap (10 blocks swapped) 0.415 s/step against 0.570 without graphs (4 swapped) and plain sd-scripts' 1.191,
    at the 12 GB tier's (20 swapped) 0.438 against 1.218 (H200, 2026-11-29). Measured on an H200: 4% faster at
    vram80; at the 24 GB tier's cap (fp8 base, every block checkpointed selectively) 0.372 s/step against 0.464 for the
    tier without graphs, 20.4 GiB on the card (2026-11-28); with a bf16 base at vram48 0.471 against 0.460, so not
    there. On several GPUs each
    process replays its own graphs (two H200s, vram80: 0.3515 s/step against 0.3532 without, the same losses, +1.9
    GiB on the card). Not where the text length varies (Chroma): with graphs on, a 10-step Chroma bench at vram80
    (H200, 2026-11-28) ranged 0.13-4.1 s a step, mean 1.22 against plain sd-scripts' 0.72, as new caption lengths
    came; with them off the same bench (20 steps) ran 0.317 s/step against 0.675, 2.13x; `true` still turns them on."""
    chosen = setting(value)
    blockers = cuda_graph_blockers(shape)
    if chosen == "true" and blockers:
        raise GraphsBlocked(blockers)
    if chosen == "auto":
        fits = not shape.gradient_checkpointing or shape.graphs_fit
        room_to_sample = not (shape.samples and shape.weights_move)
        return not blockers and not shape.varying_text and fits and room_to_sample
    return chosen == "true"


def fp8_keep_transposed(value: object, shape: RunShape) -> bool:
    """Whether fp8_matmul (where it is installed) keeps each fp8 weight's transpose for the input gradient instead
    of making it again every backward: +1 byte per frozen block weight (~8 GiB on FLUX.1) for ~5 ms of a 0.32 s
    step at 1024² on an H200. An fp8 weight's transpose is bit-exact, so either way computes the same."""
    chosen = setting(value)
    if chosen == "auto":
        return not shape.trades_memory
    return chosen == "true"
