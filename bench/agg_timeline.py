"""Per-stage timelines of ``dlshare bench agg --network`` steps: where a step's time beyond its bound goes.

The workers record, per step, when it started, when the forward pass ended, when backward
returned (every bucket reduced) and when the optimizer finished; per bucket, when DDP handed
it over and when its future completed; and with the hook, every chunk's push and result
(aggregator/stages.py).  The servers record every chunk's arrivals, sum and result sends.
All are wall-clock times on one machine, so they line up.

:func:`breakdown` splits each step into compute before the first bucket, the communication
span (first bucket handed over to last bucket reduced) and the tail after it, and the
communication span into stages.  :func:`one_step` keeps one step's every stage for the JSON,
and :func:`plot` draws it with the link counters' rates under it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

TCP_FIELDS = {"Tcp": ("RetransSegs",), "TcpExt": ("TCPTimeouts", "TCPLossProbes", "TCPSpuriousRTOs", "TCPLostRetransmit",
                                                  "TCPSackRecovery", "TCPAbortOnTimeout")}


def tcp_counters(pid: int) -> dict[str, int]:
    """TCP retransmission counters of the network namespace ``pid`` runs in (/proc/PID/net)."""
    out: dict[str, int] = {}
    for name in ("snmp", "netstat"):
        try:
            lines = Path(f"/proc/{pid}/net/{name}").read_text().splitlines()
        except OSError:
            continue
        for head, vals in zip(lines[::2], lines[1::2]):
            proto, keys = head.split(":", 1)
            if proto not in TCP_FIELDS:
                continue
            for k, v in zip(keys.split(), vals.split(":", 1)[1].split()):
                if k in TCP_FIELDS[proto]:
                    out[k] = int(v)
    return out


def _med(xs: list[float]) -> float | None:
    xs = [x for x in xs if x is not None]
    return round(float(np.median(xs)) * 1e3, 1) if xs else None


# A 1500-byte MTU carries 1448 bytes of TCP payload (20 bytes of IP, 32 of TCP with timestamps) in a
# 1514-byte frame (and its 14-byte Ethernet header), and tbf charges each frame whole: payload moves at
# most at this fraction of the shaped rate, whatever the protocol above TCP does.
TCP_PAYLOAD_PER_FRAME = 1448 / 1514


def _floor(bs: list[dict[str, Any]], start: float, s_per_byte: float) -> float:
    """The earliest the link could carry every bucket's bytes, given when each was handed over."""
    order = sorted(bs, key=lambda b: b["ready"])
    return max(b["ready"] - start + s_per_byte * sum(c["bytes"] for c in order[i:]) for i, b in enumerate(order))


def breakdown(wres: dict[str, Any], warmup: int, servers: list[dict] | None = None,
              job: str | None = None, s_per_byte: float = 0.0,
              peers: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """One worker's measured steps of one phase: medians (ms) of each part of the step.

    ``before_comm``: step start to the first bucket handed over (forward, the first part of
    backward); ``comm``: first bucket handed over to the last bucket reduced; ``after_comm``: to the
    end of the optimizer step.  With the hook's chunk records, the communication span is split at
    the last bucket handed over, the last push into the socket, the last chunk in at a server, the
    last sum and the last result in.

    ``s_per_byte``: the link seconds each byte of a bucket costs (the bound's own rate); then
    ``ready_floor`` is the earliest the communication could end given when the buckets were
    handed over: no bucket's bytes can leave before it is ready, so the link needs at least
    ``max_j(ready_j + bytes from bucket j on * s_per_byte)`` from the step's start.

    ``peers``: the other workers' records of the same phase.  A bucket is reduced only once every
    rank has pushed it, so ``ready_floor_all`` is the largest of the workers' floors (each measured
    from this worker's step start), ``framed_floor_all`` the same at the payload rate TCP over a
    1500-byte MTU leaves (:data:`TCP_PAYLOAD_PER_FRAME`), and ``comm_over_framed_floor`` what the
    pipeline loses past that: the part no rank's compute and no frame header explains."""
    marks = wres.get("marks") or []
    buckets = wres.get("buckets") or []
    stages = {(r["round"], r["key"]): r for r in wres.get("stages") or []}
    srv_last: dict[int, dict[str, float]] = {}
    for s in servers or []:
        for u in s["units"]:
            if job is not None and u["job"] != job:
                continue
            d = srv_last.setdefault(u["round"], {"arrived": 0.0, "summed": 0.0, "sent": 0.0})
            d["arrived"] = max(d["arrived"], max(a[1] for a in u["arrived"].values()))
            d["summed"] = max(d["summed"], u["sum"][1])
            d["sent"] = max([d["sent"], *[t for _, t in u["sent"]]])
    parts: dict[str, list[float]] = {}

    def add(name: str, v: float | None) -> None:
        parts.setdefault(name, []).append(v)

    for rnd in range(warmup, len(marks)):
        start, fwd, bwd, end = marks[rnd]
        bs = [b for b in buckets if b["round"] == rnd]
        if not bs:
            continue
        first, last_ready = min(b["ready"] for b in bs), max(b["ready"] for b in bs)
        done = max(b["done"] for b in bs)
        add("step", end - start)
        add("forward", fwd - start)
        add("before_comm", first - start)
        add("comm", done - first)
        add("buckets_handed_over", last_ready - first)
        add("after_comm", end - done)
        add("backward_returned_after_comm", bwd - done)
        for b in bs:
            add(f"ready_b{b['key']}", b["ready"] - start)
        if s_per_byte:
            floor = _floor(bs, start, s_per_byte)
            add("ready_floor", floor)
            add("comm_over_floor", done - start - floor)  # how late the last bucket was, given the compute
            if peers is not None:
                every = [bs] + [[b for b in p.get("buckets") or [] if b["round"] == rnd] for p in peers]
                if all(every):
                    add("ready_floor_all", max(_floor(x, start, s_per_byte) for x in every))
                    framed = max(_floor(x, start, s_per_byte / TCP_PAYLOAD_PER_FRAME) for x in every)
                    add("framed_floor_all", framed)
                    add("comm_over_framed_floor", done - start - framed)
        st = [stages[(rnd, b["key"])] for b in bs if (rnd, b["key"]) in stages]
        if st:
            add("first_push_after_first_ready", min(r["push_first"] for r in st) - first)
            add("last_push_done", max(r["push_last"] for r in st) - first)
            add("first_result_in", min(r["pull_first"] for r in st) - first)
            add("last_result_in", max(r["pull_last"] for r in st) - first)
            add("last_future_done", max(r["done"] for r in st) - first)
            sl = srv_last.get(rnd)
            if sl and sl["arrived"]:
                add("server_last_arrival", sl["arrived"] - first)
                add("server_last_sum", sl["summed"] - first)
                add("server_last_send", sl["sent"] - first)
    return {k: _med(v) for k, v in parts.items()}


def median_round(wres: dict[str, Any], warmup: int) -> int | None:
    """The measured step whose time is the median one (the step drawn)."""
    marks = wres.get("marks") or []
    rounds = list(range(warmup, len(marks)))
    if not rounds:
        return None
    times = [marks[r][3] - marks[r][0] for r in rounds]
    return rounds[int(np.argsort(times)[len(times) // 2])]


def one_step(res: dict[str, dict], workers: list[str], phase: str, rnd: int, servers: dict[str, dict] | None,
             job: str | None) -> dict[str, Any]:
    """Every recorded stage of round ``rnd`` of ``phase``: per worker, its marks and buckets (with
    their chunks), and per server, its chunks of that round."""
    out: dict[str, Any] = {"round": rnd, "workers": {}, "servers": {}}
    for w in workers:
        r = res[w][phase]
        out["workers"][w] = {
            "marks": r["marks"][rnd],
            "buckets": [b for b in r.get("buckets", []) if b["round"] == rnd],
            "stages": [s for s in r.get("stages", []) if s["round"] == rnd],
        }
    for name, tr in (servers or {}).items() if job is not None else ():
        units = [u for u in tr["units"] if u["round"] == rnd and (job is None or u["job"] == job)]
        if units:
            out["servers"][name] = units
    return out


def plot(steps: dict[str, dict[str, Any]], rates: dict[str, dict[str, Any]], path: Path) -> Path:
    """One column per phase: the step's stages per host above, the link rates below."""
    from bench import report

    plt = report.pyplot()
    names = list(steps)
    fig, axes = plt.subplots(2, len(names), figsize=(5.2 * len(names), 7.5), squeeze=False,
                             gridspec_kw={"height_ratios": [3, 1.2]})
    colors = {"compute": "0.75", "bucket": "tab:blue", "push": "tab:orange", "pull": "tab:green",
              "recv": "tab:purple", "sum": "black", "send": "tab:red"}
    for col, name in enumerate(names):
        st, ax = steps[name], axes[0][col]
        t0 = min(w["marks"][0] for w in st["workers"].values())
        rows: list[str] = []
        for w, wr in st["workers"].items():
            y = len(rows)
            rows.append(w)
            m = [x - t0 for x in wr["marks"]]
            ax.broken_barh([(m[0], m[1] - m[0]), (m[2], m[3] - m[2])], (y - 0.4, 0.8), color=colors["compute"])
            for b in wr["buckets"]:
                ax.broken_barh([(b["ready"] - t0, b["done"] - b["ready"])], (y - 0.4, 0.25), color=colors["bucket"],
                               alpha=0.6)
            for s in wr["stages"]:
                for c in s["chunk_times"]:
                    _, p0, p1, r0, r1 = c
                    if p0 and p1:
                        ax.broken_barh([(p0 - t0, max(1e-3, p1 - p0))], (y - 0.1, 0.22), color=colors["push"])
                    if r0 and r1:
                        ax.broken_barh([(r0 - t0, max(1e-3, r1 - r0))], (y + 0.15, 0.22), color=colors["pull"])
        for s, units in st["servers"].items():
            y = len(rows)
            rows.append(s)
            for u in units:
                arr = list(u["arrived"].values())
                a0, a1 = min(a[0] for a in arr), max(a[1] for a in arr)
                ax.broken_barh([(a0 - t0, max(1e-3, a1 - a0))], (y - 0.4, 0.25), color=colors["recv"], alpha=0.5)
                ax.plot([u["sum"][1] - t0], [y], "|", color=colors["sum"], ms=6)
                if u["sent"]:
                    ax.plot([max(t for _, t in u["sent"]) - t0], [y + 0.25], "|", color=colors["send"], ms=6)
        ax.set_yticks(range(len(rows)), rows)
        ax.invert_yaxis()
        ax.set_title(f"{name}: round {st['round']}", fontsize=10)
        ax.set_xlabel("seconds from the step's start")
        if col == 0:
            from matplotlib.patches import Patch

            ax.legend(handles=[Patch(color=colors[k], label=lbl) for k, lbl in (
                ("compute", "forward / optimizer"), ("bucket", "bucket handed over -> reduced"),
                ("push", "chunk push (into socket)"), ("pull", "chunk result in"),
                ("recv", "server: first header -> last payload")) ] +
                [plt.Line2D([], [], color=colors["sum"], marker="|", ls="", label="server: sum done"),
                 plt.Line2D([], [], color=colors["send"], marker="|", ls="", label="server: last result sent")],
                fontsize=7, loc="lower right")
        ax2 = axes[1][col]
        r = rates.get(name) or {}
        for host, series in r.get("series", {}).items():
            ts = [t - t0 for t in r["t"]]
            ax2.plot(ts, series, label=host, lw=1)
        if r.get("series"):
            ax2.axhline(r["rate_mb_s"], color="grey", ls="--", lw=0.8)
            ax2.legend(fontsize=7, ncol=2)
        ax2.set_xlim(ax.get_xlim())
        ax2.set_ylabel("MB/s (link counters)")
        ax2.set_xlabel("seconds from the step's start")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
