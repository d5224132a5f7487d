"""Runtime: choosing and checking kernels. `registry` (the one table of kernels, its probe, `select`; `applies` and
`examples` the records' conditions and probe inputs), `request` (`kernels.set` parsed without torch), `errors`
(KernelError), `device` (what device is this), `timing` (how ops are timed). Nothing here imports torch at package
import: `flux_kernels.runtime.request` stays torch-free."""
