"""cosybatch: bulk zero-shot speech synthesis with CosyVoice3 on one GPU."""

__version__ = "0.1.0"
