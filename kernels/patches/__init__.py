"""Model patches: what installs into sd-scripts' built FLUX model. `blocks` finds the blocks, `patch` installs the block
ops (and `apply_kernels` / `remove_kernels` every kernel), `verify` checks patched blocks against sd-scripts' own;
`attention` chooses the attention backend; `single_qkv`, `fp8`, `lora_fold`, `lora_norms`, `prologue` replace parts of
the blocks, the LoRA or the model's prologue; `compile_blocks` (with `graph_record`) compiles the blocks."""
