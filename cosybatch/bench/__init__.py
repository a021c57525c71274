"""Benchmarks: the closed-loop driver, its metrics, the synthetic workload, a random LM."""
