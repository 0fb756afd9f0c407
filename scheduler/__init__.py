"""dlshare interference-aware scheduler."""
