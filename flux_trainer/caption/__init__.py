"""`flux-train dataset caption`: natural-language captions from a vision-language model, written beside the images.

`models` is the table of named captioners (hub repository, files, memory); `tiny` builds `random_tiny`, a
random-weight model of the default's class with a stand-in tokenizer, locally; `engine` loads a captioner and turns
a batch of images into captions; `run` decides what to caption in a folder and writes each caption atomically.
"""
