"""Attention backend choice: every backend that can run here, measured forward+backward at the real shape,
checked against a float32 math reference, the fastest correct one chosen, the verdict cached on disk.

`backends` (the table, and `heads_to_tokens`, how the blocks take their output), `probe` (`probe_attention`, its
cache), `dispatch` (`AttentionDispatch`, what the patched blocks call), `fa4` (cuDNN's forward with FlashAttention-4's
backward as custom ops)."""
