"""dlshare operator benchmark suite."""
