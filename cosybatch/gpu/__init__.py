"""CUDA-graph capture and caches, host-to-device copies, process-wide numeric settings."""
