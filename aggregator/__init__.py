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

Give a client several servers and it stripes each tensor over them; when one dies it
retries that server's chunks on the others and uses it again once it is back
(aggregator/client.py, aggregator/membership.py).

Operators: telemetry on ``dlshare/v1/agg/<id>/telemetry``, retained state with a load
summary on ``.../state``, commands ``ping``, ``stats`` and ``drain`` on ``.../cmd``
(``dlshare agg drain ID`` sends ``drain`` and waits until the server's jobs have moved).

Public names: :class:`Client`, :class:`AggregationError`, :class:`AggregationServer`,
:func:`serve` (``aggregator.torch`` is imported on demand so that numpy users do not pay
for torch).
"""

from aggregator.client import AggregationError, Client
from aggregator.server import AggregationServer, serve

__all__ = ["Client", "AggregationError", "AggregationServer", "serve"]
