"""What runs on top of training: arms and their registry, the interleaved runner, `compare` and its verdict,
the fit ceiling, run reports, experiment files and optional tracking."""
