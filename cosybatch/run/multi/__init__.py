"""synth --devices/--workers: the launcher, one worker process, where workers run."""
