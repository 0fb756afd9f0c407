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

Public names: :class:`Client` and :class:`AggregationError` (floor 1);
:class:`AggregationServer`, :class:`ServerSettings` and :func:`serve` (floor 2, the server
shell).  Each is loaded when first used, so that a training process that imports the client or
the DDP hook never loads the server, its pool or its MQTT code, and a command that only needs the
``[agg]`` config section (:mod:`aggregator.settings`) loads neither.  ``aggregator.torch`` is
imported on demand so that numpy users do not pay for torch.

Floors (README, Development): the core, client, protocol, kernel, sockio, pool, scheduling
and torch modules are floor 1 and may import :mod:`nodesvc.bus` (floor 0), ``rdma.native``
(the C kernels and socket calls) and each other; :mod:`aggregator.server` is floor 2 and may
import those, never another shell; :mod:`aggregator.cli` is floor 3.  Nothing in this package
imports ``bench`` or :mod:`nodesvc.cli`.
"""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from aggregator.client import AggregationError, Client
    from aggregator.server import AggregationServer, ServerSettings, serve

__all__ = ["Client", "AggregationError", "AggregationServer", "ServerSettings", "serve"]

_CLIENT_NAMES = ("Client", "AggregationError")
_SERVER_NAMES = ("AggregationServer", "ServerSettings", "serve")


def __getattr__(name: str) -> Any:
    if name in _CLIENT_NAMES:
        from aggregator import client

        return getattr(client, name)
    if name in _SERVER_NAMES:
        from aggregator import server

        return getattr(server, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_CLIENT_NAMES, *_SERVER_NAMES])
