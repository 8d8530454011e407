"""lctrain: train and fine-tune Llama-style language models at very long context."""

__version__ = "0.1.0"
