"""The only place the Slurm shell runs Slurm's commands (``squeue``, ``sinfo``, ``scontrol``).

Thin on purpose: :meth:`SlurmCLI.snapshot` reads the queue and the nodes as JSON and parses them
(:mod:`scheduler.slurm.squeue`); :meth:`SlurmCLI.run` runs one ``scontrol`` line.  A slurmctld that
does not answer raises :class:`SlurmUnavailable` (the shell waits and tries again); a command Slurm
refuses comes back as a failed :class:`Result`, never as an exception.
"""

from __future__ import annotations

import logging
import os
import subprocess
from dataclasses import dataclass

from scheduler.slurm.book import Snapshot
from scheduler.slurm.squeue import SlurmJsonError, parse_jobs, parse_nodes

log = logging.getLogger("dlshare.slurm")


class SlurmUnavailable(RuntimeError):
    """slurmctld did not answer (down, restarting, unreachable) or Slurm's commands are missing."""


@dataclass(frozen=True)
class Result:
    argv: tuple[str, ...]
    returncode: int
    stdout: str
    stderr: str

    @property
    def ok(self) -> bool:
        return self.returncode == 0


class SlurmCLI:
    """Slurm's command-line clients; ``slurm_conf`` sets ``SLURM_CONF`` for them (empty: Slurm's default)."""

    def __init__(self, slurm_conf: str = "", timeout_s: float = 30.0) -> None:
        self.env = dict(os.environ)
        if slurm_conf:
            self.env["SLURM_CONF"] = slurm_conf
        self.timeout_s = timeout_s

    def _call(self, argv: tuple[str, ...]) -> Result:
        try:
            p = subprocess.run(argv, env=self.env, capture_output=True, text=True, timeout=self.timeout_s)
        except FileNotFoundError:
            raise SlurmUnavailable(f"{argv[0]} not found: install Slurm's clients (slurm-client)") from None
        except subprocess.TimeoutExpired:
            raise SlurmUnavailable(f"{' '.join(argv[:3])}: no answer within {self.timeout_s:g}s") from None
        return Result(tuple(argv), p.returncode, p.stdout, p.stderr.strip())

    def _json(self, argv: tuple[str, ...]) -> str:
        r = self._call(argv)
        if not r.ok:
            raise SlurmUnavailable(f"{' '.join(argv)}: exit {r.returncode}: {r.stderr[:300]}")
        return r.stdout

    def snapshot(self, partition: str, now: float) -> Snapshot:
        """The partition's jobs (all states Slurm still lists) and the cluster's nodes."""
        jobs_text = self._json(("squeue", "--json", "--partition", partition))
        nodes_text = self._json(("sinfo", "--json"))
        try:
            jobs = [j for j in parse_jobs(jobs_text) if partition in j.partition.split(",")]
            nodes = parse_nodes(nodes_text)
        except SlurmJsonError as exc:
            raise SlurmUnavailable(f"unexpected Slurm JSON: {exc}") from None
        return Snapshot(tuple(jobs), tuple(nodes), now)

    def run(self, argv: tuple[str, ...]) -> Result:
        """Run one command line; a refusal is a failed Result (logged by the caller)."""
        try:
            return self._call(argv)
        except SlurmUnavailable as exc:
            return Result(tuple(argv), -1, "", str(exc))
