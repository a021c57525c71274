"""The codec stage: speech tokens -> mel (flow) -> waveform (HiFT)."""
