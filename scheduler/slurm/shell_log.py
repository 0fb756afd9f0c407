"""The Slurm shell's own log: what it must remember across a ``kill -9``.

One JSON object a line, appended and fsync'ed before any ``scontrol`` call that depends on it:

* ``{"t": "hdr", "v": 1, "partition": .., "profile": ..}``: the first line; a restart with another
  partition or profile is refused (the replay would not rebuild the same state);
* ``{"t": "ev", "ev": {...}}``: every event handed to the core, in order (``scheduler.codec``);
  replaying them into a fresh core rebuilds its state exactly (same events, same decisions).  An
  arrival's job carries its owner (``user``, ``account``); a line written before dlshare read owners
  has neither and reads back as "" (the anonymous user, no account);
* ``{"t": "job", "id": .., "original": {...}, "comment": .., "name": .., "foreign": ..}``: a job
  seen for the first time, with its request as it was then (restored when dlshare is taken out);
* ``{"t": "rel", "id": .., "restart": N, "key": .., "at": T}``: dlshare is about to release the job at
  Slurm restart count N (a later, higher count means Slurm requeued it itself) at time T (a job Slurm
  has not started ``start_timeout_s`` later is placed again).

A torn last line (the crash happened while writing it) is dropped; any other bad line is an error
that names the line, since skipping it could forget a job.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

VERSION = 1


class ShellLogError(ValueError):
    """A journal that cannot be replayed; the message names the file and line."""


class ShellLog:
    def __init__(self, path: str | Path, fsync: bool = True) -> None:
        self.path = Path(path)
        self.fsync = fsync
        self._f = None
        self._dirty = False

    def load(self) -> list[dict[str, Any]]:
        """Every record, oldest first (``[]`` when there is no journal yet)."""
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise ShellLogError(f"{self.path}: cannot read: {exc}") from None
        *complete, torn = raw.split(b"\n")  # a crash mid-write leaves a last line without its newline
        out = []
        for i, line in enumerate(complete, start=1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except ValueError as exc:
                raise ShellLogError(f"{self.path}: line {i}: {exc}") from None
            if not isinstance(rec, dict) or not isinstance(rec.get("t"), str):
                raise ShellLogError(f"{self.path}: line {i}: not a journal record")
            out.append(rec)
        if torn:
            with open(self.path, "r+b") as f:  # nothing acted on a line that was never finished
                f.truncate(len(raw) - len(torn))
        return out

    def append(self, rec: dict[str, Any]) -> None:
        if self._f is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._f = open(self.path, "ab")
        self._f.write(json.dumps(rec, sort_keys=True, allow_nan=False, separators=(",", ":")).encode() + b"\n")
        self._dirty = True

    def sync(self) -> None:
        """Make everything appended so far durable (before acting on it)."""
        if self._f is not None and self._dirty:
            self._f.flush()
            if self.fsync:
                os.fsync(self._f.fileno())
            self._dirty = False

    def close(self) -> None:
        if self._f is not None:
            self.sync()
            self._f.close()
            self._f = None
