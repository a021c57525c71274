"""Prompt-frontend internals: batched features, the device and reference backends, the cache."""
