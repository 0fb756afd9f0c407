"""The one event convention of the pure cores, checked the same way for every core.

A core module defines ``Event`` and ``Decision``: unions of frozen dataclasses (the aggregation and
reclaim cores) or base classes that every event and decision derives from (the scheduler's).
Every event starts with ``stimulus_id: str`` and ``now: float``; every decision
has a ``stimulus_id: str`` (the id of the event that caused it).  Any other
frozen dataclass in the module must be an event, a decision or named in ``Payload`` (a value an
event carries), so a new event cannot slip past the check.  The shells make the ids with ``nodesvc.bus.ids.stimulus_id``.
"""

from __future__ import annotations

import dataclasses
import inspect
import typing
from types import ModuleType


def _hints(cls: type, module: ModuleType) -> dict[str, typing.Any]:
    return typing.get_type_hints(cls, vars(inspect.getmodule(cls) or module))


def _members(module: ModuleType, kind: type) -> tuple[type, ...]:
    """The classes of a union, or a base class's subclasses defined in ``module``."""
    args = typing.get_args(kind)
    if args:
        return args
    return tuple(cls for _, cls in inspect.getmembers(module, inspect.isclass)
                 if issubclass(cls, kind) and cls.__module__ == module.__name__)


def assert_core_convention(module: ModuleType) -> None:
    events = _members(module, module.Event)
    decisions = _members(module, module.Decision)
    assert events and decisions, f"{module.__name__} must define Event and Decision as unions"
    for cls in events:
        fields = dataclasses.fields(cls)
        hints = _hints(cls, module)
        first = [(f.name, hints[f.name]) for f in fields[:2]]
        assert first == [("stimulus_id", str), ("now", float)], f"{cls.__name__} starts with {first}"
        assert cls.__dataclass_params__.frozen, f"event {cls.__name__} must be frozen"
    for cls in decisions:
        hints = _hints(cls, module)
        assert hints.get("stimulus_id") is str, f"decision {cls.__name__} has no stimulus_id: str"
        assert cls.__dataclass_params__.frozen, f"decision {cls.__name__} must be frozen"
    frozen = {cls for _, cls in inspect.getmembers(module, inspect.isclass)
              if cls.__module__ == module.__name__ and dataclasses.is_dataclass(cls)
              and cls.__dataclass_params__.frozen}
    payloads = set(_members(module, module.Payload)) if hasattr(module, "Payload") else set()
    stray = sorted(c.__name__ for c in frozen - set(events) - set(decisions) - payloads)
    assert not stray, f"{module.__name__}: frozen dataclasses in neither Event, Decision nor Payload: {stray}"
