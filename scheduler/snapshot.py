"""Snapshots of the whole core, so that a restart replays only the events logged since.

A snapshot is the :class:`~scheduler.state.SchedulerState` after some batch:
the books, the watched deadlines, and what the plugins and predictors learned
online (the order plugin's finished-job distributions, the interference
model's updates), which no event log that has been cut short could rebuild.
It is the pickled state (a core object graph: dataclasses, dicts, numpy and
scikit-learn objects), compressed, behind a header that names the format
version and a fingerprint of the profile and the rules it ran under.

:func:`load` refuses a snapshot of another version or another profile with a
:class:`SnapshotError`, and the shell then rebuilds the core another way;
it never silently runs a different policy.  Snapshots are written and read by
the same service, from its own database: the pickle is only ever one the
service made itself.

Pure: bytes in, bytes out.
"""

from __future__ import annotations

import hashlib
import json
import pickle
import zlib
from dataclasses import asdict
from typing import Any

from scheduler.profile import Profile
from scheduler.state import SchedulerState
from scheduler.watch import WatchRules

MAGIC = b"DLSHARE-CORE\n"
# 2: the ledger holds the donor pool (lent memory); 3: jobs have owners (user, account) and the ledger
# holds their books (decayed usage for fair share, GPUs in use for quotas); 4: nodes have a GPU type, jobs
# their equal-share clock at arrival, the ledger that clock, and the 2D-Gittins order may hold a learned
# duration distribution (issue 23); 5: the equal-share clock is max-min fair, one clock per job size.
# Older snapshots are refused.
VERSION = 5


class SnapshotError(ValueError):
    """A snapshot that cannot be used here (another version, another profile, damaged)."""


def fingerprint(profile: Profile, rules: WatchRules | None) -> str:
    """What a snapshot must have been taken under to be resumed: the profile (its plugins,
    arguments, weights and placement settings) and the watch rules."""
    body = json.dumps({"profile": asdict(profile), "rules": asdict(rules or WatchRules())}, sort_keys=True,
                      default=str)
    return hashlib.sha256(body.encode()).hexdigest()[:32]


def dump(state: SchedulerState, meta: dict[str, Any] | None = None) -> bytes:
    """The state as bytes (``meta``: the shell's own notes, e.g. the batch it follows)."""
    header = {"version": VERSION, "fingerprint": fingerprint(state.profile, state.watch.rules),
              "profile": state.profile.name, "now": state.now, **(meta or {})}
    body = zlib.compress(pickle.dumps(state, protocol=pickle.HIGHEST_PROTOCOL), 1)
    return MAGIC + json.dumps(header, sort_keys=True).encode() + b"\n" + body


def header(data: bytes) -> dict[str, Any]:
    """The header of a snapshot (cheap: nothing is unpickled)."""
    if not data.startswith(MAGIC):
        raise SnapshotError("not a dlshare core snapshot")
    line, sep, _ = data[len(MAGIC):].partition(b"\n")
    if not sep:
        raise SnapshotError("truncated snapshot header")
    try:
        h = json.loads(line)
    except ValueError as exc:
        raise SnapshotError(f"unreadable snapshot header: {exc}") from None
    if not isinstance(h, dict):
        raise SnapshotError("unreadable snapshot header")
    return h


def load(data: bytes, profile: Profile | None = None, rules: WatchRules | None = None) -> SchedulerState:
    """The state a snapshot holds.  With ``profile`` (and ``rules``), the snapshot must have been
    taken under the same ones, else :class:`SnapshotError` says what differs."""
    h = header(data)
    if h.get("version") != VERSION:
        raise SnapshotError(f"snapshot format {h.get('version')!r}, this version reads {VERSION}")
    if profile is not None and h.get("fingerprint") != fingerprint(profile, rules):
        raise SnapshotError(f"the snapshot was taken under profile {h.get('profile')!r} with other settings; "
                            f"now profile {profile.name!r}")
    body = data[len(MAGIC):].partition(b"\n")[2]
    try:
        state = pickle.loads(zlib.decompress(body))
    except Exception as exc:  # noqa: BLE001 - zlib, pickle, a class that moved: all mean "unusable"
        raise SnapshotError(f"damaged or incompatible snapshot: {type(exc).__name__}: {exc}") from None
    if not isinstance(state, SchedulerState):
        raise SnapshotError(f"the snapshot holds a {type(state).__name__}, not a scheduler state")
    return state
