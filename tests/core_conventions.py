"""The one event convention of the pure cores, checked the same way for every core.

A core module defines ``Event`` and ``Decision`` as unions of frozen dataclasses.
Every event starts with ``stimulus_id: str`` and ``now: float``; every decision
has a ``stimulus_id: str`` (the id of the event that caused it).  Any other
frozen dataclass in the module must be named in one of the two unions, so a new
event cannot slip past the check.
"""

from __future__ import annotations

import dataclasses
import inspect
import typing
from types import ModuleType


def _hints(cls: type) -> dict[str, typing.Any]:
    return typing.get_type_hints(cls, vars(inspect.getmodule(cls)))


def assert_core_convention(module: ModuleType) -> None:
    events = typing.get_args(module.Event)
    decisions = typing.get_args(module.Decision)
    assert events and decisions, f"{module.__name__} must define Event and Decision as unions"
    for cls in events:
        fields = dataclasses.fields(cls)
        hints = _hints(cls)
        first = [(f.name, hints[f.name]) for f in fields[:2]]
        assert first == [("stimulus_id", str), ("now", float)], f"{cls.__name__} starts with {first}"
        assert cls.__dataclass_params__.frozen, f"event {cls.__name__} must be frozen"
    for cls in decisions:
        hints = _hints(cls)
        assert hints.get("stimulus_id") is str, f"decision {cls.__name__} has no stimulus_id: str"
        assert cls.__dataclass_params__.frozen, f"decision {cls.__name__} must be frozen"
    frozen = {cls for _, cls in inspect.getmembers(module, inspect.isclass)
              if cls.__module__ == module.__name__ and dataclasses.is_dataclass(cls)
              and cls.__dataclass_params__.frozen}
    stray = sorted(c.__name__ for c in frozen - set(events) - set(decisions))
    assert not stray, f"{module.__name__}: frozen dataclasses in neither Event nor Decision: {stray}"
