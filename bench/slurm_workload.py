"""A sleep-like training job for ``dlshare bench slurm``: it does ``--work`` seconds of isolated work.

Run by Slurm as the batch script (``python -m bench.slurm_workload --type KEY --work S --dir D``).
It progresses at the speed the simulator's ground truth gives it (``scheduler.sim.GroundTruth``,
precomputed by the benchmark into ``D/speeds.json`` so this process imports nothing heavy): 1 alone
on its GPUs, Gavel's measured pair speed when another job shares one of them (fake GPUs: the jobs
on a GPU register in ``D/gpus/NODE-IDX/``, with their pid, so a killed one does not count).  The
GPUs are those dlshare bound (``DLSHARE_GPUS``, from the TaskProlog); without it (Slurm alone) the
job holds its GPUs exclusively.

It reports progress: ``D/progress/JOB`` holds the isolated seconds done, so a job that is requeued
(preempted, or its node lost) resumes where it stopped, as the simulator's checkpoint model says.
``D/events`` gets one line per start (``start JOB t node restarts``), end (``end JOB t``) and
overlap (``twice JOB t``: a second copy ran while one was alive, or a job ran after its end).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

TICK_S = 0.2


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def _append(path: Path, line: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="slurm_workload")
    ap.add_argument("--type", required=True, help="the job's type key in speeds.json")
    ap.add_argument("--work", type=float, required=True, help="isolated seconds of work")
    ap.add_argument("--dir", required=True)
    args = ap.parse_args(argv)
    d = Path(args.dir)
    job = os.environ.get("SLURM_JOB_ID", str(os.getpid()))
    node = os.environ.get("SLURMD_NODENAME", "local")
    restarts = os.environ.get("SLURM_RESTART_COUNT", "0")
    events = d / "events"
    speeds = json.loads((d / "speeds.json").read_text())
    mine = speeds.get(args.type, {})
    (d / "progress").mkdir(exist_ok=True)
    (d / "running").mkdir(exist_ok=True)
    now = time.time()
    # One live copy per job: a second one, or a run after the end, is a job run twice.
    lock = d / "running" / job
    try:
        fd = os.open(lock, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        os.write(fd, str(os.getpid()).encode())
        os.close(fd)
    except FileExistsError:
        try:
            other = int(lock.read_text() or 0)
        except (OSError, ValueError):
            other = 0
        if other and _alive(other):
            _append(events, f"twice {job} {now:.3f}")
        lock.write_text(str(os.getpid()))
    prog_file = d / "progress" / job
    try:
        state = json.loads(prog_file.read_text())
    except (OSError, ValueError):
        state = {"done": 0.0, "ended": False}
    if state.get("ended"):
        _append(events, f"twice {job} {now:.3f}")
    _append(events, f"start {job} {now:.3f} {node} {restarts}")
    bound = [g for g in os.environ.get("DLSHARE_GPUS", "").split(",") if g]
    regs = []
    for g in bound:
        gdir = d / "gpus" / f"{node}-{g}"
        gdir.mkdir(parents=True, exist_ok=True)
        reg = gdir / f"{job}.{os.getpid()}"
        reg.write_text(args.type)
        regs.append((gdir, reg))
    stop = {"now": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.__setitem__("now", True))
    done = float(state.get("done", 0.0))
    last = time.time()
    try:
        while done < args.work and not stop["now"]:
            time.sleep(TICK_S)
            t = time.time()
            speed = 1.0
            for gdir, reg in regs:
                others = []
                for f in gdir.iterdir():
                    if f == reg:
                        continue
                    try:
                        pid = int(f.name.rsplit(".", 1)[1])
                        kind = f.read_text()
                    except (OSError, ValueError, IndexError):
                        continue
                    if _alive(pid):
                        others.append(kind)
                if len(others) == 1:
                    speed = min(speed, float(mine.get(others[0], 0.5)))
                elif others:
                    speed = min(speed, 1.0 / (len(others) + 1))
            done += speed * (t - last)
            last = t
            _write_atomic(prog_file, json.dumps({"done": done, "ended": False}))
        ended = done >= args.work
        if ended:
            _write_atomic(prog_file, json.dumps({"done": done, "ended": True}))
            _append(events, f"end {job} {time.time():.3f}")
    finally:
        for _, reg in regs:
            reg.unlink(missing_ok=True)
        try:
            if lock.read_text() == str(os.getpid()):
                lock.unlink()
        except OSError:
            pass
    return 0 if ended else 143


if __name__ == "__main__":
    sys.exit(main())
