"""An in-memory stand-in for Slurm's commands, for the Slurm shell's unit tests.

It answers :meth:`snapshot` and :meth:`run` like :class:`scheduler.slurm.runner.SlurmCLI` and keeps
just enough of Slurm's rules: only a pending job can be updated (a running one only its comments and
time limit, as an operator can); release/hold need a held/unheld
pending job; ``requeuehold`` puts a running job back pending and held, with its restart count up;
:meth:`schedule` starts released jobs on their required nodes when slots, CPUs and memory fit, as
Slurm's own scheduler does.  ``crash_after`` raises :class:`Crash` before the N-th command, to cut a
shell off between any two of its actions.  The integration tests use the real Slurm.
"""

from __future__ import annotations

from scheduler.slurm.book import Snapshot
from scheduler.slurm.runner import Result
from scheduler.slurm.squeue import parse_job, parse_node
from tests.scheduler.slurm.slurm_json import job_json, node_json


class Crash(Exception):
    """The shell 'died' here (a kill -9 between two commands)."""


class FakeSlurm:
    def __init__(self, nodes: int = 2, gpus: int = 4, slots: int = 2, cpus: int = 12, mem_mb: int = 256000) -> None:
        self.slots = slots
        self.nodes = {f"n{i + 1}": node_json(f"n{i + 1}", gres=f"gpu:{gpus * slots}", cpus=cpus, real_memory=mem_mb)
                      for i in range(nodes)}
        self.jobs: dict[str, dict] = {}
        self.next_id = 1
        self.commands: list[tuple[str, ...]] = []
        self.starts: dict[str, int] = {}
        self.crash_after: int | None = None
        self.now = 1000.0

    # ------------------------------------------------------------------ users

    def submit(self, name: str = "wrap", comment: str = "", gpus: int = 1, held: bool = True, **kw) -> str:
        jid = str(self.next_id)
        self.next_id += 1
        kw.setdefault("tres_per_node", f"gres:gpu:{gpus}" if gpus else "")
        self.jobs[jid] = job_json(int(jid), name=name, comment=comment, priority=0 if held else 1,
                                  state_reason="JobHeldUser" if held else "None", submit_time=int(self.now), **kw)
        return jid

    def finish(self, jid: str, state: str = "COMPLETED") -> None:
        j = self.jobs[jid]
        assert j["job_state"] == "RUNNING", j
        j.update(job_state=state, end_time=int(self.now))

    def requeue_by_slurm(self, jid: str) -> None:
        """Slurm's own requeue (node failure): pending, not held, restart count up."""
        j = self.jobs[jid]
        j.update(job_state="PENDING", state_reason="BeginTime", nodes="", restart_cnt=j["restart_cnt"] + 1)

    def schedule(self) -> list[str]:
        """Start released pending jobs that fit on their required nodes (Slurm's scheduler)."""
        started = []
        for jid, j in self.jobs.items():
            if j["job_state"] != "PENDING" or j["priority"] == 0 or not j["required_nodes"]:
                continue
            nodes = j["required_nodes"].split(",")
            if all(self._fits(n, j) for n in nodes):
                j.update(job_state="RUNNING", nodes=j["required_nodes"], state_reason="None", start_time=int(self.now))
                self.starts[jid] = self.starts.get(jid, 0) + 1
                started.append(jid)
        return started

    def _used(self, node: str) -> tuple[int, int, int]:
        s = c = m = 0
        for j in self.jobs.values():
            if j["job_state"] == "RUNNING" and node in j["nodes"].split(","):
                s += parse_job(j).gpus() // max(1, j["node_count"])
                c += j["cpus"] // max(1, j["node_count"])
                m += j["memory_per_node"] or 0
        return s, c, m

    def _fits(self, node: str, j: dict) -> bool:
        n = self.nodes[node]
        if n["state"] not in ("idle", "mixed", "allocated"):
            return False
        s, c, m = self._used(node)
        slots = int(n["gres"].split(":")[1])
        return (s + parse_job(j).gpus() // max(1, j["node_count"]) <= slots and c + j["cpus"] <= n["cpus"]
                and m + (j["memory_per_node"] or 0) <= n["real_memory"])

    # ------------------------------------------------------------------ the CLI face

    def snapshot(self, partition: str, now: float) -> Snapshot:
        jobs = tuple(parse_job(j) for j in self.jobs.values() if j["partition"] == partition)
        return Snapshot(jobs, tuple(parse_node(n) for n in self.nodes.values()), now)

    def run(self, argv: tuple[str, ...]) -> Result:
        if self.crash_after is not None and len(self.commands) >= self.crash_after:
            raise Crash(argv)
        self.commands.append(tuple(argv))
        assert argv[0] == "scontrol", argv
        verb = argv[1]
        if verb == "update":
            kv = dict(a.split("=", 1) for a in argv[2:])
            j = self.jobs[kv.pop("JobId")]
            if j["job_state"] != "PENDING" and set(kv) - {"Comment", "AdminComment", "TimeLimit"}:
                return Result(tuple(argv), 1, "", "Job is no longer pending execution")
            for k, v in kv.items():
                if k == "NodeList":
                    j["required_nodes"] = v
                elif k == "NumNodes":
                    j["node_count"] = int(v)
                elif k == "NumCPUs":
                    j["cpus"] = int(v)
                elif k == "MinMemoryNode":
                    j["memory_per_node"] = int(v)
                elif k == "Comment":
                    j["comment"] = v
                elif k == "AdminComment":
                    j["admin_comment"] = v
                elif k == "Gres":
                    j["tres_per_node"] = f"gres:{v}" if v else ""
                elif k == "TimeLimit":
                    j["time_limit"] = int(v)
            return Result(tuple(argv), 0, "", "")
        j = self.jobs.get(argv[2])
        if j is None:
            return Result(tuple(argv), 1, "", "Invalid job id specified")
        if verb == "release":
            if j["job_state"] != "PENDING" or j["priority"] != 0:
                return Result(tuple(argv), 1, "", "Job is not held")
            j.update(priority=1, state_reason="None")
        elif verb == "hold":
            if j["job_state"] != "PENDING":
                return Result(tuple(argv), 1, "", "Job is no longer pending execution")
            j.update(priority=0, state_reason="JobHeldAdmin")
        elif verb == "requeuehold":
            if j["job_state"] != "RUNNING":
                return Result(tuple(argv), 1, "", "Job is not running")
            j.update(job_state="PENDING", priority=0, state_reason="job requeued in held state", nodes="",
                     restart_cnt=j["restart_cnt"] + 1)
        else:
            return Result(tuple(argv), 1, "", f"unknown verb {verb}")
        return Result(tuple(argv), 0, "", "")
