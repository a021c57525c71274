"""Everything a run leaves on disk: atomic files, audio files, ledger, timing, row records."""
