"""Builders of Slurm JSON records shaped like ``squeue --json`` / ``sinfo --json`` of Slurm 22.05."""

from __future__ import annotations

from typing import Any


def job_json(job_id: int, **kw: Any) -> dict[str, Any]:
    d: dict[str, Any] = {
        "job_id": job_id, "name": kw.pop("name", "wrap"), "partition": "dlshare", "job_state": "PENDING",
        "state_reason": "JobHeldUser", "priority": 0, "nodes": "", "required_nodes": "", "node_count": 1,
        "tasks": 1, "cpus": 1, "memory_per_node": None, "memory_per_cpu": 2000, "tres_per_node": "gres:gpu:1",
        "tres_per_job": "", "tres_per_task": "", "comment": "", "admin_comment": "", "submit_time": 1000,
        "start_time": 0, "end_time": 0, "exit_code": 0, "restart_cnt": 0, "gres_detail": [], "flags": [],
        "array_job_id": 0, "array_task_id": None, "het_job_id": 0, "user_name": "root", "user_id": 0,
        "account": "",
    }
    d.update(kw)
    return d


def node_json(name: str, **kw: Any) -> dict[str, Any]:
    d: dict[str, Any] = {
        "name": name, "state": "idle", "state_flags": [], "cpus": 12, "real_memory": 256000, "gres": "gpu:8",
        "gres_used": "gpu:0", "partitions": ["dlshare"], "alloc_cpus": 0, "alloc_memory": 0, "reason": "",
    }
    d.update(kw)
    return d
