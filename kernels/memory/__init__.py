"""Memory strategies: what checkpointed blocks keep for their backward, and where. `selective_checkpoint` (keep the
outputs that cost the most to recompute), `activation_offload` (what they keep waits in page-locked host memory),
`l2` (L2 persistence windows: measured, not installed); and where swapped blocks' weights live: `block_swap`
(sd-scripts' block swap schedule, its copies from page-locked host memory on a side stream)."""
