"""dlshare shared aggregation service: server, client and PyTorch DDP hook.

Run a server (one elastic pool of reduction threads shared by every job)::

    dlshare agg --listen 127.0.0.1:7700 --broker mqtt://127.0.0.1:1883 --id agg0
    python -m aggregator.cli --listen ...        # the same, without the console script

Reduce from every rank of a job (in place, like ``torch.distributed.all_reduce``)::

    from aggregator import Client
    with Client(["127.0.0.1:7700"], job="bert-7", rank=rank, world=world) as c:
        c.allreduce(grads)                       # numpy fp32/fp16 or torch fp32/fp16/bf16
        fut = c.allreduce_async(other, op="sum") # a concurrent.futures.Future

Or let DDP use it: ``ddp.register_comm_hook(AggState(client), comm_hook)`` with
``from aggregator.torch import AggState, comm_hook``.

Operators: telemetry on ``dlshare/v1/agg/<id>/telemetry``, retained state with a load
summary on ``.../state``, commands ``ping``, ``stats`` and ``drain`` on ``.../cmd``.

Public names: :class:`Client`, :class:`AggregationError`, :class:`AggregationServer`,
:func:`serve` (``aggregator.torch`` is imported on demand so that numpy users do not pay
for torch).
"""

from aggregator.client import AggregationError, Client
from aggregator.server import AggregationServer, serve

__all__ = ["Client", "AggregationError", "AggregationServer", "serve"]
