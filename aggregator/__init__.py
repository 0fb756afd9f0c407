"""dlshare shared aggregation service."""
