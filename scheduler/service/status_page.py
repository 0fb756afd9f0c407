"""The read-only status page: one self-refreshing HTML document, rendered on the server.

No JavaScript is needed: a ``<meta http-equiv="refresh">`` reloads it, so it
works in any browser and in ``chromium --dump-dom``.  Every value is escaped.
"""

from __future__ import annotations

import html
import time
import urllib.parse
from typing import Any


def _b(n: int | float | None) -> str:
    if n is None:
        return "-"
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _e(v: Any) -> str:
    return html.escape("-" if v is None else str(v))


_CSS = """
body{font-family:system-ui,sans-serif;margin:1.2em;color:#222;background:#fafafa}
h1{font-size:1.3em;margin:0 0 .3em}h2{font-size:1.05em;margin:1.2em 0 .4em}
table{border-collapse:collapse;font-size:.88em;background:#fff}
th,td{border:1px solid #ddd;padding:.25em .6em;text-align:left;vertical-align:top}
th{background:#eee}.online{color:#060}.offline{color:#a00}.failed{color:#a00}.running{color:#06c}
.done{color:#060}.queued{color:#a60}.summary span{display:inline-block;margin-right:1.4em}
.muted{color:#777}
"""


DENIED = ("<!doctype html><html lang='en'><head><meta charset='utf-8'><title>dlshare scheduler</title></head>"
          "<body><h1>dlshare scheduler</h1><p id='denied'>the status page needs the token: open "
          "<code>/?token=&lt;token&gt;</code> (the token is in the service's <code>&lt;db&gt;.token</code> file, "
          "or printed by <code>dlshare up</code>)</p></body></html>")


def render(cluster: dict[str, Any], jobs: list[dict[str, Any]], token: str, refresh_s: int = 3) -> str:
    q = urllib.parse.urlencode({"token": token, "refresh": refresh_s})
    counts = cluster.get("jobs_by_state", {})
    agg = cluster.get("aggregation", {})
    out = [
        "<!doctype html><html lang='en'><head><meta charset='utf-8'>",
        f"<meta http-equiv='refresh' content='{int(refresh_s)};url=/?{html.escape(q)}'>",
        "<meta name='referrer' content='no-referrer'>",
        "<title>dlshare scheduler</title>",
        f"<style>{_CSS}</style></head><body>",
        "<h1>dlshare scheduler</h1>",
        f"<p class='muted'>profile <b id='profile'>{_e(cluster.get('profile'))}</b> &middot; "
        f"updated {_e(time.strftime('%H:%M:%S', time.localtime(cluster.get('ts', time.time()))))} "
        f"&middot; refreshes every {int(refresh_s)} s</p>",
        "<p class='summary' id='summary'>",
        f"<span>nodes online <b id='nodes-online'>{sum(1 for n in cluster['nodes'] if n['status'] == 'online')}"
        f"</b>/{len(cluster['nodes'])}</span>",
        f"<span>GPUs in use <b id='gpus'>{cluster['gpus_allocated']}/{cluster['gpus_total']}</b></span>",
        f"<span>CPUs allocated <b id='cpus'>{cluster['cpus_allocated']:.1f}/{cluster['cpus_total']:.0f}</b></span>",
        f"<span>memory lent <b id='lent'>{_b(cluster['memory_lent_bytes'])}</b> "
        f"(lendable {_b(cluster['memory_lendable_bytes'])}; promised to jobs "
        f"{_b(cluster.get('memory_promised_bytes', 0))})</span>",
        f"<span>aggregation <b id='agg'>{agg.get('servers', 0)} servers, {agg.get('jobs', 0)} jobs, "
        f"{agg.get('busy_cores', 0):.2f} of {agg.get('pool_cores', 0):.0f} pool cores busy, "
        f"{_b(agg.get('bytes_in_per_s', 0))}/s in</b></span>",
        "<span>jobs " + ", ".join(f"<b class='{_e(s)}'>{_e(s)} {c}</b>" for s, c in sorted(counts.items())) + "</span>",
        "</p>",
        "<h2>Nodes</h2><table id='nodes'><tr><th>node</th><th>status</th><th>CPU</th><th>CPUs allocated</th>"
        "<th>memory avail / total</th><th>allocated</th><th>reserved, unused</th><th>lendable / lent</th>"
        "<th>borrows from</th><th>GPUs</th><th>jobs</th></tr>",
    ]
    for n in cluster["nodes"]:
        gpus = "<br>".join(
            f"{g['index']}: {_e(g['name'])} {_e(g['util_percent'])}% [{_e(', '.join(g['jobs']) or 'idle')}]"
            for g in n["gpus"]) or f"<span class='muted'>{_e(n.get('gpu_reason') or 'none')}</span>"
        out.append(
            f"<tr data-node='{_e(n['id'])}'><td>{_e(n['id'])}</td><td class='{_e(n['status'])}'>{_e(n['status'])}</td>"
            f"<td>{_e(n['cpu_percent'])}% of {n['cpu_count']}</td><td>{n['cpus_allocated']:.1f}</td>"
            f"<td>{_b(n['memory_available_bytes'])} / {_b(n['memory_total_bytes'])}</td>"
            f"<td>{_b(n['memory_allocated_bytes'])}</td><td>{_b(n['reserved_unused_bytes'])}</td>"
            f"<td>{_b(n['lendable_bytes'])} / {_b(n['lent_bytes'])}</td>"
            f"<td>{_e(', '.join(f'{d} {_b(b)}' for d, b in sorted((n.get('borrowed_from') or {}).items())) or '-')}"
            f"</td><td>{gpus}</td>"
            f"<td>{_e(', '.join(n['jobs']) or '-')}</td></tr>")
    out.append("</table>")
    out.append("<h2>Jobs</h2><table id='jobs'><tr><th>job</th><th>name</th><th>kind</th><th>state</th><th>node</th>"
               "<th>GPUs (#index when placed)</th><th>CPUs</th><th>memory</th><th>attained service</th><th>reason</th></tr>")
    for j in reversed(jobs):
        a = j.get("allocation") or {}
        s = j["spec"]
        out.append(
            f"<tr data-job='{_e(j['id'])}'><td>{_e(j['id'])}</td><td>{_e(s.get('name') or s.get('model'))}</td>"
            f"<td>{_e(s.get('kind'))}</td><td class='{_e(j['state'])}'>{_e(j['state'])}</td>"
            f"<td>{_e(a.get('node'))}</td><td>{_e(('#' + ',#'.join(map(str, a['gpus']))) if a.get('gpus') else s.get('gpus'))}</td>"
            f"<td>{_e(a.get('cpus', s.get('cpus')))}</td><td>{_b(a.get('memory_bytes', s.get('memory_bytes')))}</td>"
            f"<td>{j.get('attained_service', 0):.1f} s</td><td>{_e(j.get('reason'))}</td></tr>")
    out.append("</table></body></html>")
    return "\n".join(out)
