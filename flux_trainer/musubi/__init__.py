"""Everything that knows musubi-tuner, kohya-ss's second trainer (FLUX.2 [klein], FLUX.1 Kontext): the sibling of
`flux_trainer.sdscripts`. The config, launch and metrics layers reach it only through the backend seam."""
