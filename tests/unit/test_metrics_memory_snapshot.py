"""`logging.memory_snapshot_at`: one optimizer step's CUDA allocations recorded and summarised (a stand-in for
torch.cuda.memory here; the real recorder needs a GPU)."""

from __future__ import annotations

import logging
import pickle

import torch

from flux_trainer.metrics.memory_snapshot import MemorySnapshot, peak_live, reserve_by_pool, summary, where

GIB = 2**30
TORCH = {"filename": "/x/site-packages/torch/nn/functional.py", "line": 10, "name": "linear"}
FOLD = {"filename": "/repo/kernels/patches/lora_fold.py", "line": 92, "name": "forward"}
BLOCK = {"filename": "/sd/library/flux_models.py", "line": 700, "name": "_forward"}


def alloc(addr, gib, *frames):
    return {"action": "alloc", "addr": addr, "size": int(gib * GIB), "frames": list(frames)}


def free(addr):
    return {"action": "free_completed", "addr": addr}


# two tensors from the fold and one from the block live together at 3.5 GiB; later a larger one alone (3 GiB)
TRACE = [
    alloc(1, 1.0, TORCH, FOLD, BLOCK),
    alloc(2, 1.5, TORCH, FOLD),
    {"action": "free_requested", "addr": 1},  # requested on a stream: still live until completed
    alloc(3, 1.0, BLOCK),
    free(1),
    free(2),
    free(3),
    alloc(4, 3.0, BLOCK),
    free(99),  # allocated before the recording started: not counted
]


GENERATED = {"filename": "/cache/torchinductor/dp/cdp3jpc73.py", "line": 923, "name": "call"}


def test_where_is_the_first_frame_outside_torch_and_inductors_generated_code():
    assert where([TORCH, FOLD, BLOCK]) == "lora_fold.py:92 (forward)"
    # as on the H200: a compiled block's tensors come out of inductor's `call`, called from the model's code
    assert where([TORCH, GENERATED, TORCH, FOLD, BLOCK]) == "lora_fold.py:92 (forward)"
    assert where([TORCH, GENERATED]) == "cdp3jpc73.py:923 (call)"  # nothing else outside torch
    assert where([TORCH]) == "functional.py:10 (linear)"
    assert where([]) == "?"


def test_peak_live_groups_what_was_live_at_the_peak_by_where_it_was_allocated():
    peak, end, groups, position = peak_live(TRACE)
    assert peak == int(3.5 * GIB) and end == 3 * GIB
    assert groups == {"lora_fold.py:92 (forward)": (int(2.5 * GIB), 2), "flux_models.py:700 (_forward)": (GIB, 1)}
    assert position == 4 / 9  # the 4th of the trace's 9 events (the third allocation)
    text = summary(7, TRACE)
    assert text.startswith(
        "memory of step 7: 3.50 GiB allocated within the step and live at its peak, 44% of the way through the "
        "step's 9 allocation events (3.00 GiB"
    )
    assert text.splitlines()[1].split() == ["2.500", "GiB", "2", "tensors", "lora_fold.py:92", "(forward)"]


def seg(gib, allocated_gib, stream=0, pool=(0, 0), device=0):
    return {
        "device": device,
        "total_size": int(gib * GIB),
        "allocated_size": int(allocated_gib * GIB),
        "stream": stream,
        "segment_pool_id": pool,
    }


# two default-pool segments on stream 0, one in a graphs' pool, one on a side stream, one on another card
SEGMENTS = [
    seg(2.0, 1.5),
    seg(1.0, 0.25),
    seg(1.5, 0.5, pool=(1, 3)),
    seg(0.5, 0, stream=0x55),
    seg(4.0, 4.0, device=1),
]


def test_reserve_by_pool_splits_the_reserve_by_pool_and_stream():
    rows = reserve_by_pool(SEGMENTS[:4])
    assert rows == [
        ("the default pool, stream 0x0", 3 * GIB, int(1.75 * GIB), 2),
        ("private pool 1.3 (CUDA graphs), stream 0x0", int(1.5 * GIB), GIB // 2, 1),
        ("the default pool, stream 0x55", GIB // 2, 0, 1),
    ]


class FakeMemory:
    def __init__(self):
        self.calls = []

    def _record_memory_history(self, enabled, device, **opts):
        self.calls.append(enabled)

    def _snapshot(self, device):
        return {"segments": SEGMENTS, "device_traces": [TRACE]}


def test_records_one_optimizer_step_and_writes_the_snapshot_and_its_peak(tmp_path, caplog):
    mem = FakeMemory()
    snap = MemorySnapshot(tmp_path, at=2, accumulation=2, memory=mem)  # micro-batches 3 and 4 are step 2
    cuda = torch.device("cuda", 0)
    assert [snap.on_batch(i, cuda) for i in (1, 2, 3, 4)] == [False] * 4
    assert mem.calls == ["all"]
    with caplog.at_level(logging.INFO):
        assert snap.on_batch(5, cuda)
    assert mem.calls == ["all", None] and not snap.close()  # written once, recording off
    assert pickle.loads((tmp_path / "memory" / "snapshot-rank0.pickle").read_bytes())["device_traces"] == [TRACE]
    peak = (tmp_path / "memory" / "peak-rank0.txt").read_text()
    assert peak.startswith("memory of step 2: 3.50 GiB") and "memory_viz" in caplog.text
    # device 1's segment is another card's: not in this one's reserve
    assert "reserved after the step: 5.00 GiB in 4 segments, 2.25 GiB of it allocated" in peak
    assert "   1.500 /   0.500 GiB     1 segments  private pool 1.3 (CUDA graphs), stream 0x0" in peak


def test_a_run_that_ends_inside_the_step_writes_at_close_and_a_cpu_run_records_nothing(tmp_path, caplog):
    mem = FakeMemory()
    snap = MemorySnapshot(tmp_path / "a", at=1, memory=mem)
    snap.on_batch(1, torch.device("cuda", 0))
    assert snap.close() and mem.calls == ["all", None]
    cpu = MemorySnapshot(tmp_path / "b", at=1, memory=FakeMemory())
    with caplog.at_level(logging.INFO):
        assert not any(cpu.on_batch(i, torch.device("cpu")) for i in (1, 2, 3))
    assert cpu._memory.calls == [] and not (tmp_path / "b").exists() and "not on a CUDA device" in caplog.text
