"""Reference (parity) paths: simple, sequential re-implementations of the official inference loops."""
