"""Replaying a recorded live run through the core the simulator drives.

The live service logs every batch of events it hands to
:meth:`SchedulerState.handle_batch <scheduler.state.SchedulerState.handle_batch>`,
with the decisions that batch produced.  Replayed in the same batches into a
core built the same way (the same profile, predictors and rules, or the
snapshot the log continues from), the events give the same decisions: this is
how the service rebuilds its core at start, and how a run is checked after the
fact (``dlshare sim replay``).

Pure: batches in, decisions out.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

from scheduler.codec import decision_to_dict
from scheduler.events import Decision, Event
from scheduler.state import SchedulerState


@dataclass(frozen=True)
class ReplayedBatch:
    batch: int
    decisions: list[Decision]
    refused: list[tuple[str, str]]  # (stimulus_id, why) of the events the core refused


def replay(state: SchedulerState, batches: Iterable[tuple[int, Sequence[Event]]]) -> Iterator[ReplayedBatch]:
    """Hand ``batches`` ((number, events), in order) to ``state``, one batch per call."""
    for n, events in batches:
        decisions, refused = state.handle_batch(events)
        yield ReplayedBatch(n, decisions, refused)


def differences(recorded: dict[int, list[dict]], replayed: Iterable[ReplayedBatch], limit: int = 20) -> list[str]:
    """Where a replay departs from the recorded decisions (codec dicts per batch); empty when
    every batch gave the same decisions in the same order."""
    out: list[str] = []
    seen: set[int] = set()
    for rb in replayed:
        seen.add(rb.batch)
        got = [decision_to_dict(d) for d in rb.decisions]
        want = recorded.get(rb.batch)
        if want is None:
            out.append(f"batch {rb.batch}: replayed, but no decisions were recorded for it")
        elif got != want:
            k = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
            out.append(f"batch {rb.batch}: decision {k} differs: recorded {want[k] if k < len(want) else None}, "
                       f"replayed {got[k] if k < len(got) else None}")
        if len(out) >= limit:
            return out
    for n in sorted(set(recorded) - seen):
        out.append(f"batch {n}: recorded, but not replayed")
        if len(out) >= limit:
            break
    return out
