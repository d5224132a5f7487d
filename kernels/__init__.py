"""flux_kernels: fast ops for FLUX training with a plain-PyTorch reference beside each, probes and fallback.
Stands alone: never imports flux_trainer or sd-scripts."""
