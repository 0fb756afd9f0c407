"""A reply's ``ts`` (when the node took the command) feeds the decision's stage times, whatever
a node puts there: only a time (a positive number below 1e12) is taken, anything else is ignored, nothing raises."""

from __future__ import annotations

import asyncio

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nodesvc.bus import messages
from scheduler.service.commands import NodeCommands

_TS = (st.none() | st.booleans() | st.integers(-10**400, 10**400) | st.floats()
       | st.text(max_size=5) | st.lists(st.integers(), max_size=2) | st.dictionaries(st.text(max_size=3),
                                                                                     st.integers(), max_size=2))


class _Wire:
    """The bus's publish, looped back: the command is decoded as a node would and answered."""

    def __init__(self, cmds: NodeCommands, ts, ok: bool) -> None:
        self.cmds, self.ts, self.ok = cmds, ts, ok

    async def publish(self, topic: str, payload: bytes, qos: int = 0, retain: bool = False) -> bool:
        cmd = messages.parse_command(payload)
        body = {"id": cmd.id, "ok": self.ok, "result": {}, "error": "no", "ts": self.ts}
        asyncio.get_running_loop().call_soon(self.cmds.resolve, body)
        return True


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@given(ts=_TS, ok=st.booleans())
async def test_a_replys_ts_is_taken_only_when_it_is_a_positive_number(ts, ok):
    cmds = NodeCommands(timeout_s=5.0)
    cmds.bus = _Wire(cmds, ts, ok)
    stages: dict[str, float] = {}
    try:
        await cmds.send("n1", "run", {"job": "j"}, "d1/n1/run", stages=stages)
        answered = True
    except Exception as exc:  # noqa: BLE001 - only a refusal may come out
        assert not ok and type(exc).__name__ == "CommandRefused"
        answered = False
    assert stages["publish"] <= stages["sent"] and stages["reply"] >= stages["publish"]
    good = isinstance(ts, (int, float)) and not isinstance(ts, bool) and 0 < ts < 1e12
    assert ("node" in stages) == good and (not good or stages["node"] == float(ts))
    assert cmds._replied == {} and cmds.correlator.in_flight == 0
    assert answered == ok
