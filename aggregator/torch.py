"""The PyTorch DDP communication hook: DDP's bucket all-reduce through aggregation servers.

    from aggregator import Client
    from aggregator.torch import AggState, comm_hook

    client = Client(["127.0.0.1:7700"], job="resnet-42", rank=rank, world=world)
    ddp.register_comm_hook(AggState(client), comm_hook)

The job's secret (README, Security) comes from the ``DLSHARE_AGG_SECRET`` environment variable
the launcher gives every rank, or ``Client(..., secret=...)``.

Each bucket is reduced as key ``bucket.index()`` of round ``iteration``; the
iteration advances after the bucket DDP flags as the last of the iteration.
Keys are per round and the server checks each key's size across ranks in that
round only, so DDP's re-layout of its buckets after iteration 0 needs nothing
special.  The mean is computed on the server (sum in rank order, then one
division by the world size), which for two ranks gives exactly the bits of
DDP's default all-reduce.

Wire compression, like DDP's ``fp16_compress_hook``: ``AggState(client,
compression="fp16")`` (or ``"bf16"``) sends each bucket as 16-bit floats and
receives the mean in 16 bits, halving the bytes on the wire.  The client narrows
each chunk just before its push and widens each result into the fp32 bucket as it
arrives (no pass over the whole bucket on DDP's thread, none after the last
result); the server adds the 16-bit inputs in fp32 and rounds once (DDP's hook
rounds at every step of its all-reduce).
"""

# No ``from __future__ import annotations`` here: DDP checks the hook's annotations against the real
# ``dist.GradBucket`` and ``torch.futures.Future[torch.Tensor]`` objects.
from dataclasses import dataclass

import torch
import torch.distributed as dist

from aggregator.client import AggregationError, Client

__all__ = ["AggState", "comm_hook"]


@dataclass
class AggState:
    """The hook's state: the client and the iteration counter (the round number)."""

    client: Client
    iteration: int = 0
    op: str = "mean"
    compression: str | None = None  # None, "fp16" or "bf16": the dtype on the wire

    def __post_init__(self) -> None:
        if self.compression not in _WIRE:
            raise ValueError(f"compression must be one of {', '.join(map(str, _WIRE))}, not {self.compression!r}")


_WIRE = {None: None, "fp16": torch.float16, "bf16": torch.bfloat16}  # the compressions AggState accepts


def comm_hook(state: AggState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """All-reduce ``bucket.buffer()`` (mean over ranks) in place; the Future holds that tensor."""
    buf = bucket.buffer()
    out: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    rnd, key = state.iteration, bucket.index()
    if bucket.is_last():
        state.iteration += 1
    wire = state.compression if buf.dtype == torch.float32 else None
    try:
        fut = state.client.allreduce_async(buf, op=state.op, key=key, round=rnd, **({"wire": wire} if wire else {}))
    except (AggregationError, TypeError, ValueError) as exc:
        out.set_exception(exc)
        return out

    def _done(f) -> None:
        exc = f.exception()
        if exc is not None:
            out.set_exception(exc)
            return
        out.set_result(buf)

    fut.add_done_callback(_done)
    return out
