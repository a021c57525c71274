"""Driving a run: synth, resume, shards, signals, options, check, merge, progress, exit codes."""
