"""Ops: each a fast kernel beside its plain-PyTorch reference, the reference both the fallback and the tests' ground
truth. `reference` (sd-scripts' math), `fast` (the Triton kernels behind autograd.Functions; `_launch` launches them,
`tl_*` are the kernels, imported lazily), and the steps that install into the optimizer or the trainer (`prodigy`,
`adamw`, `single_process`, `coalesced_reduce`). Nothing here knows sd-scripts' model."""
