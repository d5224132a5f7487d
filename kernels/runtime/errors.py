"""The error flux_kernels raises where a kernel that was asked for cannot run (no torch here: a module of its own, so
that every layer can raise it and callers can catch it without importing what raised it)."""


class KernelError(RuntimeError):
    """A kernel the user asked for by name cannot run here (the message says why and what to do)."""
