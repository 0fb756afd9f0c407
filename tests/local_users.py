"""Real local users for the tests of jobs that run as their owner (``useradd``, removed after).

Names are unique per test process (``dlt<pid><letter>``), so tests that run beside each other
never share one.  ``useradd`` and ``userdel`` take the user database's lock: a busy lock is
retried for a few seconds.  Each user has no home directory made, no password and no login shell
(``/usr/sbin/nologin``); the tests run programs as them through the node daemon only.
"""

from __future__ import annotations

import grp
import os
import pwd
import subprocess
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class LocalUser:
    name: str
    uid: int
    gid: int
    groups: tuple[int, ...]


def _retry(argv: list[str]) -> None:
    deadline = time.monotonic() + 20
    while True:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=30)
        if r.returncode == 0:
            return
        # 10: cannot lock the user database (another useradd/userdel); 8 (userdel): the user's
        # processes are still exiting.  Anything else is real.
        if r.returncode not in (8, 10) or time.monotonic() > deadline:
            raise RuntimeError(f"{' '.join(argv)} failed ({r.returncode}): {r.stderr.strip()}")
        time.sleep(0.2)


class LocalUsers:
    """Creates users and groups on demand; :meth:`remove_all` deletes every one it made."""

    def __init__(self) -> None:
        self.users: list[str] = []
        self.groups: list[str] = []
        self._n = 0

    def _name(self) -> str:
        self._n += 1
        return f"dlt{os.getpid()}{chr(ord('a') + self._n - 1)}"

    def group(self) -> str:
        name = self._name() + "g"
        _retry(["groupadd", name])
        self.groups.append(name)
        return name

    def user(self, groups: list[str] = ()) -> LocalUser:
        name = self._name()
        argv = ["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", "--home-dir", "/nonexistent"]
        if groups:
            argv += ["--groups", ",".join(groups)]
        _retry([*argv, name])
        self.users.append(name)
        pw = pwd.getpwnam(name)
        gids = tuple(sorted({pw.pw_gid, *(grp.getgrnam(g).gr_gid for g in groups)}))
        return LocalUser(name, pw.pw_uid, pw.pw_gid, gids)

    def remove_all(self) -> None:
        for name in reversed(self.users):
            uid = pwd.getpwnam(name).pw_uid
            for pid in pids_of(uid):  # anything a test left running as this user, by pid
                try:
                    os.kill(pid, 9)
                except ProcessLookupError:
                    pass
            _retry(["userdel", name])
        for name in reversed(self.groups):
            _retry(["groupdel", name])
        self.users.clear()
        self.groups.clear()


def pids_of(uid: int) -> list[int]:
    """The processes whose real uid is ``uid``."""
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                if proc_ids(int(d)).get("Uid", [None])[0] == uid:
                    out.append(int(d))
            except OSError:
                continue
    return out


def proc_ids(pid: int) -> dict[str, list[int]]:
    """``Uid``, ``Gid`` and ``Groups`` of ``/proc/<pid>/status`` (real, effective, saved, fs ids)."""
    out: dict[str, list[int]] = {}
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            key, _, rest = line.partition(":")
            if key in ("Uid", "Gid", "Groups", "NoNewPrivs"):
                out[key] = [int(x) for x in rest.split()]
    return out
