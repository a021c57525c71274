"""Ray Data: the public synthesize(), the driver behind synth --ray, the actor stage."""
