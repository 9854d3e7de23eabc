"""Reading checkpoints: HF directories and GGUF files into an HF-named state dict and a ``ModelArch``
(``loader.py``), and our own GGUF reader (``gguf_file.py``). Nothing here builds or runs a model."""
