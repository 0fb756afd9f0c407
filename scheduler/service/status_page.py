"""The read-only status page: one self-refreshing HTML document, rendered on the server.

No JavaScript is needed: a ``<meta http-equiv="refresh">`` reloads it, so it
works in any browser and in ``chromium --dump-dom``.  The cluster's history is drawn as inline
SVG charts (:mod:`scheduler.service.charts`).  Every value is escaped.  The token is asked for
once (:func:`login_page`) and kept in an HttpOnly, SameSite=Strict cookie: no page or link
carries it.
"""

from __future__ import annotations

import html
import time
import urllib.parse
from typing import Any

from scheduler.service.charts import duration, line_chart


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
.charts{display:flex;flex-wrap:wrap;gap:.6em}.cell{background:#fff;border:1px solid #ddd}
svg.chart text{font-size:11px;fill:#444}svg.chart .title{font-weight:600;fill:#222}
svg.chart .grid{stroke:#e4e4e4}.windows{font-size:.8em;font-weight:normal;margin-left:1em}
.windows a{margin-right:.5em}.windows a.current{font-weight:bold;text-decoration:none}
form.inline{display:inline;margin-left:.6em}.code{font-weight:600;color:#a60}.head{margin-bottom:.6em}
"""


COOKIE = "dlshare_token"

WINDOWS = {"15m": 900, "1h": 3600, "6h": 6 * 3600, "24h": 86400}


def login_page(message: str = "") -> str:
    """The form that asks for the token once (POST /login sets an HttpOnly cookie); no token ever
    travels in a URL."""
    note = f"<p id='login-error' class='failed'>{_e(message)}</p>" if message else ""
    return ("<!doctype html><html lang='en'><head><meta charset='utf-8'><title>dlshare scheduler</title>"
            "<meta name='referrer' content='no-referrer'>"
            f"<style>{_CSS}</style></head><body><h1>dlshare scheduler</h1>{note}"
            "<form id='login' method='post' action='/login'><p>The status page needs your token (`dlshare token "
            "create`, or the service's <code>&lt;db&gt;.token</code>, or the one <code>dlshare up</code> prints). "
            "It is kept in a cookie this browser sends only to this page (HttpOnly, SameSite=Strict).</p>"
            "<label>token <input type='password' name='token' autocomplete='off' required autofocus size='48'></label> "
            "<button type='submit'>open</button></form></body></html>")


def _charts(history: dict[str, Any] | None, now: float, window: str, refresh_s: int) -> str:
    """The history as charts over ``window``, with links to the other windows."""
    span = WINDOWS.get(window, 3600)
    links = " ".join(
        f"<a href='/?{html.escape(urllib.parse.urlencode({'refresh': refresh_s, 'window': w}))}'"
        + (" class='current'" if w == window else "") + f">{w}</a>" for w in WINDOWS)
    if not history or not history.get("ts"):
        return f"<h2>Over time</h2><p class='muted' id='no-history'>no history yet (one point every few seconds)</p>"
    ts = history["ts"]
    # A history younger than the window is drawn over its own span (at least a minute), not squeezed
    # into the window's right edge.
    span = max(60.0, min(span, now - ts[0]))

    def col(k: str) -> list:
        return history.get(k) or [None] * len(ts)

    charts = [
        ("chart-gpus", "GPUs", [("gpus_total", "total", col("gpus_total")),
                                ("gpus_allocated", "allocated", col("gpus_allocated"))], "count"),
        ("chart-gpu-util", "GPU utilisation", [("gpu_util_percent", "mean", col("gpu_util_percent"))], "percent"),
        ("chart-cpus", "CPU cores", [("cpus_total", "total", col("cpus_total")),
                                     ("cpus_allocated", "allocated", col("cpus_allocated")),
                                     ("cpus_used", "used", col("cpus_used"))], "count"),
        ("chart-memory", "Host memory", [("memory_total_bytes", "total", col("memory_total_bytes")),
                                         ("memory_allocated_bytes", "allocated", col("memory_allocated_bytes")),
                                         ("memory_used_bytes", "used", col("memory_used_bytes"))], "bytes"),
        ("chart-lent", "Remote memory", [("memory_lendable_bytes", "lendable", col("memory_lendable_bytes")),
                                         ("memory_lent_bytes", "lent", col("memory_lent_bytes")),
                                         ("memory_promised_bytes", "promised to jobs", col("memory_promised_bytes"))],
         "bytes"),
        ("chart-queue", "Jobs", [("jobs_waiting", "waiting", col("jobs_waiting")),
                                 ("jobs_running", "running", col("jobs_running"))], "count"),
        ("chart-wait", "Wait of waiting jobs", [("wait_longest_s", "longest", col("wait_longest_s")),
                                                ("wait_mean_s", "mean", col("wait_mean_s"))], "seconds"),
        ("chart-agg", "Aggregation pool cores", [("agg_pool_cores", "held", col("agg_pool_cores")),
                                                 ("agg_busy_cores", "busy", col("agg_busy_cores"))], "count"),
    ]
    body = "".join(f"<div class='cell'>{line_chart(cid, title, ts, series, unit, now, span)}</div>"
                   for cid, title, series, unit in charts)
    return (f"<h2>Over time <span class='windows'>{links}</span></h2>"
            f"<div id='charts' class='charts' data-window='{span}'>{body}</div>")


def render(cluster: dict[str, Any], jobs: list[dict[str, Any]], refresh_s: int = 3,
           history: dict[str, Any] | None = None, window: str = "1h", user: str = "") -> str:
    """The page: the cluster now, its history as charts over ``window`` (15m, 1h, 6h, 24h), the
    nodes and the jobs (``jobs`` as the API gives them, with their ``waiting`` blocks)."""
    q = urllib.parse.urlencode({"refresh": refresh_s, "window": window})
    counts = cluster.get("jobs_by_state", {})
    agg = cluster.get("aggregation", {})
    out = [
        "<!doctype html><html lang='en'><head><meta charset='utf-8'>",
        f"<meta http-equiv='refresh' content='{int(refresh_s)};url=/?{html.escape(q)}'>",
        "<meta name='referrer' content='no-referrer'>",
        "<title>dlshare scheduler</title>",
        f"<style>{_CSS}</style></head><body>",
        "<h1>dlshare scheduler</h1>",
        f"<div class='muted head'><span>profile <b id='profile'>{_e(cluster.get('profile'))}</b> &middot; "
        f"updated {_e(time.strftime('%H:%M:%S', time.localtime(cluster.get('ts', time.time()))))} "
        f"&middot; refreshes every {int(refresh_s)} s"
        + (f" &middot; {_e(user)}</span> <form class='inline' method='post' action='/logout'><button>log out"
           f"</button></form>" if user else "</span>") + "</div>",
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
        _charts(history, cluster.get("ts", time.time()), window, refresh_s),
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
    out.append("<h2>Jobs</h2><table id='jobs'><tr><th>job</th><th>user</th><th>name</th><th>kind</th><th>state</th>"
               "<th>node</th><th>GPUs (#index when placed)</th><th>CPUs</th><th>memory</th><th>attained service</th>"
               "<th>queue</th><th>starts</th><th>reason</th></tr>")
    now = cluster.get("ts", time.time())
    for j in reversed(jobs):
        a = j.get("allocation") or {}
        s = j["spec"]
        w = j.get("waiting") or {}
        pos = f"{w['position']} of {w['queue_length']}" if w else "-"
        est = w.get("estimated_start")
        starts = "-" if not w else ("unknown" if est is None else "now" if est <= now + 1 else
                                    "in " + duration(est - now))
        code = f"<b class='code'>{_e(w['code'])}</b> " if w else ""
        out.append(
            f"<tr data-job='{_e(j['id'])}'><td>{_e(j['id'])}</td><td>{_e(j.get('user') or '-')}</td>"
            f"<td>{_e(s.get('name') or s.get('model'))}</td>"
            f"<td>{_e(s.get('kind'))}</td><td class='{_e(j['state'])}'>{_e(j['state'])}</td>"
            f"<td>{_e(a.get('node'))}</td><td>{_e(('#' + ',#'.join(map(str, a['gpus']))) if a.get('gpus') else s.get('gpus'))}</td>"
            f"<td>{_e(a.get('cpus', s.get('cpus')))}</td><td>{_b(a.get('memory_bytes', s.get('memory_bytes')))}</td>"
            f"<td>{j.get('attained_service', 0):.1f} s</td><td class='position'>{_e(pos)}</td>"
            f"<td class='starts'>{_e(starts)}</td><td class='reason'>{code}{_e(j.get('reason'))}</td></tr>")
    out.append("</table></body></html>")
    return "\n".join(out)
