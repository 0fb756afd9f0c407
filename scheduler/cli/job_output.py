"""What ``dlshare job list|show|events`` print for people (pure: the API's JSON in, text out).

``list`` is kubectl's shape: plain columns separated by two spaces, fitted to the terminal (80
columns when there is none): job ids shortened only when they must be, a GPU count, the state, the
node, the age and, for a waiting job, its reason code and words, cut to what is left of the line.
``-o wide`` adds the owner, name, CPUs, memory, service, queue position and estimated start and
cuts nothing.  ``show`` reads like ``kubectl describe``: one field a line, then the job's events.
"""

from __future__ import annotations

import datetime as _dt
import json
from typing import Any

from scheduler.waiting import size


def ago(t: float | None, now: float) -> str:
    """``45s``, ``12m``, ``3h``, ``2d`` (kubectl's AGE)."""
    if t is None:
        return "-"
    s = max(0.0, now - t)
    if s < 120:
        return f"{s:.0f}s"
    if s < 7200:
        return f"{s / 60:.0f}m"
    if s < 172800:
        return f"{s / 3600:.0f}h"
    return f"{s / 86400:.0f}d"


def until(t: float | None, now: float) -> str:
    """An estimated start: ``now``, ``in 12m``, ``unknown``."""
    if t is None:
        return "unknown"
    if t <= now + 1:
        return "now"
    return "in " + ago(now, t)


def clock(t: float | None) -> str:
    if t is None:
        return "-"
    return _dt.datetime.fromtimestamp(t).isoformat(sep=" ", timespec="seconds")


def one_line(text: object) -> str:
    """Text for one terminal line: whitespace runs (newlines too) made one space, control
    characters (a terminal's escape sequences among them) shown as ``?``."""
    t = " ".join(str(text).split())
    return "".join(c if c.isprintable() else "?" for c in t)


def cut(text: str, width: int) -> str:
    """``text`` in at most ``width`` characters, an ellipsis marking a cut."""
    if width <= 0:
        return ""
    return text if len(text) <= width else text[:max(0, width - 1)] + "…"


def _gpus(j: dict[str, Any]) -> str:
    return str(int(j["spec"].get("gpus") or 0))


def _reason(j: dict[str, Any]) -> str:
    w = j.get("waiting")
    if w:
        return f"{w['code']}: {w['reason']}"
    return str(j.get("reason") or "")


def _row(j: dict[str, Any], now: float, wide: bool) -> dict[str, str]:
    a, s, w = j.get("allocation") or {}, j["spec"], j.get("waiting") or {}
    nodes = [sh["node"] for sh in a.get("shards") or []] or ([a["node"]] if a.get("node") else [])
    row = {"JOB": j["id"], "STATE": j["state"], "GPUS": _gpus(j), "NODE": ",".join(nodes) or "-",
           "AGE": ago(j.get("submitted_at"), now), "REASON": one_line(_reason(j))}
    if wide:
        row.update({"USER": j.get("user") or "-", "NAME": one_line(s.get("name") or s.get("model") or "-"),
                    "CPUS": f"{float(a.get('cpus', s.get('cpus')) or 0):g}",
                    "MEMORY": size(a.get("memory_bytes") or s.get("memory_bytes") or 0),
                    "SERVICE": f"{float(j.get('attained_service') or 0):.0f}s",
                    "POSITION": f"{w['position']}/{w['queue_length']}" if w else "-",
                    "STARTS": until(w.get("estimated_start"), now) if w else "-"})
    return row


NARROW = ["JOB", "STATE", "GPUS", "NODE", "AGE", "REASON"]
WIDE = ["JOB", "USER", "NAME", "STATE", "GPUS", "CPUS", "MEMORY", "NODE", "AGE", "SERVICE", "POSITION", "STARTS",
        "REASON"]
ID_MAX = 20  # a longer id is shortened in the narrow list (a unique prefix still names it)
NODE_MAX = 14


def job_table(jobs: list[dict[str, Any]], now: float, width: int = 80, wide: bool = False) -> str:
    """The job list, one line a job, every line at most ``width`` characters (unless ``wide``)."""
    cols = WIDE if wide else NARROW
    rows = [_row(j, now, wide) for j in jobs]
    if not wide:
        for r in rows:
            r["JOB"] = cut(r["JOB"], ID_MAX)
            r["NODE"] = cut(r["NODE"], NODE_MAX)
    widths = {c: max([len(c), *(len(r[c]) for r in rows)]) for c in cols}
    lines = []
    for r in [dict(zip(cols, cols)), *rows]:
        fixed = "  ".join(r[c].ljust(widths[c]) for c in cols[:-1])
        last = r[cols[-1]]
        if not wide:
            fixed = cut(fixed, width)
            last = cut(last, width - len(fixed) - 2)
        lines.append((fixed + "  " + last).rstrip() if last else fixed.rstrip())
    return "\n".join(lines)


def event_message(e: dict[str, Any]) -> str:
    """One line for an event of the job's history."""
    d = e.get("data") or {}
    kind = e["kind"]
    if kind == "submitted":
        owner = f" by {d['user']}" if d.get("user") else ""
        return f"{d.get('gpus', 0)} GPUs, {d.get('cpus') or 0:g} CPUs{owner}"
    if kind == "placed":
        gpus = ",".join(map(str, d.get("gpus") or []))
        where = ", ".join(d.get("nodes") or [e.get("node") or "?"])
        extra = " (resumed)" if d.get("resumed") else ""
        if d.get("colocated_with"):
            extra += f", sharing with {', '.join(d['colocated_with'])}"
        lent = f" + {size(d['remote_memory_bytes'])} lent" if d.get("remote_memory_bytes") else ""
        return (f"on {where}" + (f" GPU {gpus}" if gpus else "") + f", {float(d.get('cpus') or 0):g} CPUs, "
                f"{size(d.get('memory_bytes') or 0)}{lent}{extra}")
    if kind == "waiting":
        return f"{d.get('code')}: {d.get('reason')}" + (f" (position {d['position']})" if d.get("position") else "")
    if kind == "exited":
        return f"exit code {d.get('exit_code')}" + (f": {d['why']}" if d.get("why") else "")
    if "why" in d and len(d) == 1:
        return str(d["why"])
    if kind == "started":
        return "the node started it"
    return json.dumps(d, sort_keys=True) if d else ""


def events_table(events: list[dict[str, Any]], now: float, width: int | None = None, indent: str = "") -> str:
    rows = [("AGE", "KIND", "NODE", "MESSAGE")]
    rows += [(ago(e.get("ts"), now), e["kind"], one_line(e.get("node") or "-"), one_line(event_message(e)))
             for e in events]
    w = [max(len(r[i]) for r in rows) for i in range(3)]
    out = []
    for r in rows:
        line = indent + "  ".join(r[i].ljust(w[i]) for i in range(3)) + "  " + r[3]
        out.append(cut(line, width) if width else line)
    return "\n".join(x.rstrip() for x in out)


def describe(j: dict[str, Any], events: list[dict[str, Any]], now: float, width: int | None = None) -> str:
    """``dlshare job show``: the job, field by field, then its events."""
    s, a, w = j["spec"], j.get("allocation") or {}, j.get("waiting")
    fields: list[tuple[str, str]] = [("Job", j["id"])]
    if s.get("name"):
        fields.append(("Name", str(s["name"])))
    fields.append(("User", (j.get("user") or "-") + (f" (account {j['account']})" if j.get("account") else "")))
    fields.append(("State", j["state"]))
    if w:
        fields += [("Reason", f"{w['code']}: {w['reason']}"), ("Waiting since", f"{clock(w['since'])} "
                                                                                 f"({ago(w['since'], now)})")]
        if w.get("nodes"):
            fields.append(("Nodes", w["nodes"]))
        fields.append(("Position", f"{w['position']} of {w['queue_length']}"))
        est = w.get("estimated_start")
        fields.append(("Estimated start", "unknown (not within the forecast's horizon)" if est is None else
                       f"{until(est, now)} ({clock(est)})"))
    elif j.get("reason"):
        fields.append(("Reason", str(j["reason"])))
    model = s.get("model") or "-"
    fields.append(("Model", f"{model}" + (f", batch {s['batch_size']}" if s.get("batch_size") else "")))
    fields.append(("Requested", f"{int(s.get('gpus') or 0)} GPUs, {float(s.get('cpus') or 0):g} CPUs, "
                                f"{size(s.get('memory_bytes') or 0)}"
                                + (f", {size(s['remote_memory_bytes'])} lent" if s.get("remote_memory_bytes") else "")))
    if a:
        shards = a.get("shards") or [{"node": a.get("node"), "gpus": a.get("gpus") or []}]
        where = "; ".join(f"{sh['node']} GPU {','.join(map(str, sh.get('gpus') or [])) or '-'}" for sh in shards)
        fields.append(("Placed", f"{where}, {float(a.get('cpus') or 0):g} CPUs, {size(a.get('memory_bytes') or 0)}"
                                 + (f" + {size(a['remote_memory_bytes'])} lent" if a.get("remote_memory_bytes") else "")))
    fields.append(("Command", " ".join(s.get("command") or [])))
    fields.append(("Submitted", f"{clock(j.get('submitted_at'))} ({ago(j.get('submitted_at'), now)} ago)"))
    if j.get("started_at"):
        fields.append(("Started", f"{clock(j['started_at'])}"))
    if j.get("finished_at"):
        fields.append(("Finished", f"{clock(j['finished_at'])}" + (f", exit code {j['exit_code']}"
                                                                   if j.get("exit_code") is not None else "")))
    fields.append(("Service", f"{float(j.get('attained_service') or 0):.1f} GPU-s, placed {j.get('attempts', 0)}x"))
    pad = max(len(k) for k, _ in fields) + 2
    lines = [(f"{k}:".ljust(pad) + one_line(v)) for k, v in fields]
    if width:
        lines = [cut(x, width) for x in lines]
    lines.append("Events:")
    lines.append(events_table(events, now, width, indent="  ") if events else "  <none>")
    return "\n".join(lines)


__all__ = ["ago", "cut", "describe", "event_message", "events_table", "job_table", "one_line", "until"]
