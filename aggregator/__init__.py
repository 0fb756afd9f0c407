"""dlshare shared aggregation service: server, client and PyTorch DDP hook.

Public names: :class:`Client`, :class:`AggregationError`, :class:`AggregationServer`
(and ``aggregator.torch.comm_hook`` / ``AggState`` for DDP, imported on demand so
that numpy users do not pay for torch).
"""

from aggregator.client import AggregationError, Client
from aggregator.server import AggregationServer, serve

__all__ = ["Client", "AggregationError", "AggregationServer", "serve"]
