"""Plain PyTorch modules of CosyVoice3 (no scheduling, no I/O)."""
