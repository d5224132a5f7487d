"""lora_fold on the GPU at FLUX's linear1 shape (4608 tokens, 3072 -> 21504: B folded) and linear2 shape (15360 ->
3072: A folded), LoRA r16 in fp32 under bf16 autocast, as sd-scripts trains: the folded layer against sd-scripts'
form, eager, compiled and replayed from CUDA graphs, over optimizer steps that change the factors (the buffer must
follow). Skipped without CUDA."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from flux_kernels.ops.reference import max_rel_err
from flux_kernels.patches import lora_fold
from tests.unit.test_kernels_lora_fold import Lora  # sd-scripts' LoRAModule as flux_kernels sees it

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (lora_fold is installed on GPUs only)"),
]


class Layer(nn.Module):
    def __init__(self, k: int, n: int):
        super().__init__()
        self.linear1 = nn.Linear(k, n, device="cuda", dtype=torch.bfloat16).requires_grad_(False)

    def forward(self, x):
        return nn.functional.gelu(self.linear1(x), approximate="tanh")


@pytest.mark.parametrize("mode", ["eager", "compiled", "cuda_graphs"])
@pytest.mark.parametrize(("k", "n", "side"), [(3072, 21504, "up"), (15360, 3072, "down")])
def test_folded_layer_trains_like_sd_scripts_form(mode, k, n, side):
    torch.manual_seed(0)
    plain = Layer(k, n)
    plain_lora = Lora(plain.linear1, r=16, alpha=16.0, up_std=0.01)
    model, lora = copy.deepcopy((plain, plain_lora))
    outer = nn.Sequential(model)  # as in training: the hook on the FLUX model runs eagerly, the blocks compiled
    assert lora_fold.install(outer) == 1 and lora_fold.sides(outer)[side] == 1
    if mode != "eager":
        model.compile(mode="reduce-overhead" if mode == "cuda_graphs" else None)
    run = outer
    opt = torch.optim.AdamW(plain_lora.parameters(), lr=1e-2)
    gen = torch.Generator(device="cuda").manual_seed(1)
    for step in range(4):
        # the same weights each step (a trajectory would drift apart by bf16 noise through AdamW); A and B change
        # between steps through an in-place copy, as an optimizer changes them: the folded buffer must follow
        lora.load_state_dict(plain_lora.state_dict())
        x = torch.randn(1, 4608, k, device="cuda", generator=gen, dtype=torch.bfloat16).requires_grad_()
        dy = torch.randn(1, 4608, n, device="cuda", generator=gen, dtype=torch.bfloat16)
        results = []
        for lo, fn in ((plain_lora, plain), (lora, run)):
            x.grad = None
            if mode == "cuda_graphs":
                torch.compiler.cudagraph_mark_step_begin()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                y = fn(x)
            y.backward(dy)
            results.append([y.detach().clone(), x.grad.clone(), lo.lora_down.weight.grad.clone(),
                            lo.lora_up.weight.grad.clone()])  # fmt: skip
            lo.zero_grad(set_to_none=True)
        errs = [max_rel_err(got, want) for got, want in zip(results[1], results[0], strict=True)]
        assert max(errs) <= 2e-2, (step, errs)  # output, input gradient, lora_down, lora_up gradients
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            plain(x.detach()).float().square().mean().backward()
        opt.step()
    wb = getattr(model.linear1, lora_fold.BUFFER)
    assert model.linear1.weight.untyped_storage().data_ptr() == wb.untyped_storage().data_ptr()
    torch._dynamo.reset()


LAYOUT_SCRIPT = r"""
import json, sys
import torch
from torch import nn
from flux_kernels.patches import lora_fold
from tests.unit.test_kernels_lora_fold import Lora

lora_fold.COMPACT = sys.argv[1] == "compact"
torch.manual_seed(0)
blocks = []
for _ in range(8):  # FLUX's single block's large weights, in load order: linear1, linear2, modulation (not folded)
    blocks += [nn.Linear(3072, 21504), nn.Linear(15360, 3072), nn.Linear(3072, 9216)]
model = nn.ModuleList(blocks).to("cuda", torch.bfloat16).requires_grad_(False)
before = {i: m.weight.detach()[:2, :3].clone() for i, m in enumerate(blocks)}
loras = [Lora(m, r=16, alpha=16.0, up_std=0.01).cuda() for m in blocks[::3] + blocks[1::3]]
lora_fold.install(model)
torch.cuda.synchronize()
lora_fold.sync(model.__dict__[lora_fold.ATTR][1], model)  # what the model's first forward does
torch.cuda.synchronize()
same = all(torch.equal(m.weight.detach()[:2, :3], before[i]) for i, m in enumerate(blocks))
print(json.dumps({"slack": torch.cuda.memory_reserved() - torch.cuda.memory_allocated(), "same": same}))
"""


def test_compacted_first_re_homing_leaves_no_mapped_holes():
    """The first re-homing, with expandable segments, FLUX's single blocks' weights (8 of them, 2.1 GiB): compacted,
    the allocator holds hardly more than is allocated; re-homed one by one, the folded weights' holes keep pages."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    root = Path(__file__).resolve().parents[2]
    out = {}
    for mode in ("compact", "one_by_one"):
        run = subprocess.run([sys.executable, "-c", LAYOUT_SCRIPT, mode], env=env, cwd=root, capture_output=True,
                             text=True, timeout=300)  # fmt: skip
        assert run.returncode == 0, run.stderr[-2000:]
        out[mode] = json.loads(run.stdout.strip().splitlines()[-1])
        assert out[mode]["same"], mode
    print({k: f"{v['slack'] / 2**20:.0f} MiB" for k, v in out.items()})
    assert out["compact"]["slack"] <= 64 * 2**20
    assert out["compact"]["slack"] < out["one_by_one"]["slack"]
