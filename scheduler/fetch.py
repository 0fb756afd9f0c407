"""``dlshare data fetch``: fill the user cache from each file's public source.

Each file is downloaded from its repository at the pinned commit
(``https://raw.githubusercontent.com/REPO/COMMIT/PATH``) and converted the way
../shared/data/SOURCES.json describes.  Conversions are pure functions of the
downloaded text, tested on local inputs.
"""

from __future__ import annotations

import ast
import csv
import io
import json
import urllib.request
from collections.abc import Callable
from pathlib import Path

GAVEL = ("stanford-futuredata/gavel", "c4fa40097339e9608ab71fd64c8bdea96a5e4a4c")
SYNERGY = ("msr-fiddle/synergy", "1bb2bed6edc9c5f953d0b7f0a40e4fdad053489c")
IADEEP = ("buzy-coder/IADeep", "78ca7f67d8b04989060454d4d75f1d85af4396b1")
ALIBABA = ("alibaba/clusterdata", "7a6c496e4f4b6ce6150be8f881cb051bf2abff42")
LUCID = ("S-Lab-System-Group/Lucid", "63685a3ab7d15d8e940bb47ef98b6d5cca472b13")  # S-Lab License 1.0, non-commercial


def raw_url(repo: str, commit: str, path: str) -> str:
    return f"https://raw.githubusercontent.com/{repo}/{commit}/{path}"


def convert_gavel_trace(text: str, throughputs_v100: dict) -> str:
    """Gavel trace lines (tab-separated: job_type, command, working_directory,
    num_steps_arg, needs_data_dir, total_steps, scale_factor, priority_weight,
    SLO, arrival_time) -> our Philly CSV: sorted by arrival, arrival relative to
    the first, rows without a v100 throughput dropped, isolated duration =
    total_steps / throughput alone."""
    rows = []
    for n, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        f = line.split("\t")
        if len(f) < 10:
            raise ValueError(f"gavel trace line {n}: expected 10 tab-separated fields, got {len(f)}")
        job_type, total_steps, scale, arrival = f[0], int(f[5]), int(f[6]), float(f[9])
        key = str((job_type, scale))
        entry = throughputs_v100.get(key)
        if entry is None or not entry.get("null"):
            continue
        model, bs = job_type, 0
        if " (batch size " in job_type:
            model, rest = job_type.split(" (batch size ")
            bs = int(rest.rstrip(")"))
        rows.append((arrival, model, bs, scale, total_steps, total_steps / entry["null"]))
    rows.sort(key=lambda r: r[0])
    t0 = rows[0][0] if rows else 0.0
    out = io.StringIO()
    w = csv.writer(out, lineterminator="\n")
    w.writerow(["job_id", "arrival_s", "model", "batch_size", "num_gpus", "total_steps", "isolated_duration_s"])
    for i, (a, model, bs, g, steps, dur) in enumerate(rows):
        w.writerow([i, round(a - t0, 3), model, bs, g, steps, round(dur, 3)])
    return out.getvalue()


def convert_synergy_trace(text: str) -> str:
    """Synergy's deploy trace (job id, model, arrival h, iterations, GPUs per
    line; comma- or space-separated) with our header added."""
    out = ["job_id,model,arrival_h,iterations,num_gpus"]
    for n, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        f = [x for x in line.replace(",", " ").split() if x]
        if len(f) != 5:
            raise ValueError(f"synergy trace line {n}: expected 5 fields, got {len(f)}")
        out.append(",".join(f))
    return "\n".join(out) + "\n"


def convert_colocation(text: str, fraction: float = 0.7) -> str:
    """IADeep's interference_util.csv, keeping the first ``fraction`` of its rows
    (the rest are held out for evaluation).

    SOURCES.json says only "a fixed 70% of the rows"; the shared copy is not the
    first 70% (its first row is the upstream file's third), and the selection
    is not published, so a fetched copy has the same size and format but not
    necessarily the same rows."""
    lines = [ln for ln in text.splitlines() if ln.strip()]
    header, body = lines[0], lines[1:]
    keep = int(round(len(body) * fraction))
    return "\n".join([header, *body[:keep]]) + "\n"


def _number_expr(node: ast.AST) -> object:
    """Evaluate a literal, arithmetic on literals, lists, or ``np.array([...])``; nothing else."""
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
        return node.value
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_number_expr(e) for e in node.elts]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        v = _number_expr(node.operand)
        return -v if isinstance(node.op, ast.USub) else v
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub, ast.Mult, ast.Div)):
        a, b = _number_expr(node.left), _number_expr(node.right)
        if not all(isinstance(v, (int, float)) for v in (a, b)):
            raise ValueError("arithmetic on non-numbers")
        if isinstance(node.op, ast.Add):
            return a + b
        if isinstance(node.op, ast.Sub):
            return a - b
        if isinstance(node.op, ast.Mult):
            return a * b
        if b == 0:
            raise ValueError("division by zero")
        return a / b
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "array"
            and len(node.args) == 1):
        return _number_expr(node.args[0])
    raise ValueError(f"not a numeric expression: {ast.dump(node)[:60]}")


def convert_synergy_model(source: str) -> dict:
    """The numbers assigned to ``cpus``, ``mem``, ``batch``, ``iter_time`` and
    ``tput`` in one Synergy model file (parsed with ``ast``, never executed)."""
    tree = ast.parse(source)
    found: dict[str, object] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            for tgt in node.targets:
                name = tgt.attr if isinstance(tgt, ast.Attribute) else getattr(tgt, "id", None)
                if name in ("cpus", "mem", "batch", "iter_time", "tput"):
                    try:
                        found[name] = _number_expr(node.value)
                    except (ValueError, TypeError):
                        continue
    if "tput" not in found:
        raise ValueError("no tput table in model file")
    return found


def assemble_sensitivity(models: dict[str, str]) -> dict:
    """synergy/sensitivity.json from ``{file stem: source}`` of Synergy's model files."""
    out = {}
    for stem, src in sorted(models.items()):
        model, _, gpus = stem.rpartition("_")
        if not model or not (gpus.isascii() and gpus.isdigit()):
            continue
        f = convert_synergy_model(src)
        out[stem] = {"model": model, "num_gpus": int(gpus), "best_cpus": f.get("cpus"), "best_mem_gb": f.get("mem"),
                     "batch_size": f.get("batch"), "iter_time_s": f.get("iter_time"), "throughput": f["tput"]}
    return {"cpu_levels": [1, 2, 3, 4, 5, 6, 9, 12, 24], "mem_levels_gb": [20.83, 62.5, 125, 187.5, 250],
            "note": "throughput[i][j] = normalised training throughput with cpu_levels[i] CPU cores and "
                    "mem_levels_gb[j] GB of host memory (Synergy simulator/jobs/job.py cpu_val/mem_val)",
            "models": out}


def convert_lucid_colocation(text: str) -> str:
    """Lucid's colocate_info.csv -> lucid/colocation.csv: the pandas index column (unnamed)
    dropped.  The shared copy also keeps only 42 of the 56 model pairs (the rest held out for
    evaluation); that choice is not published, so a fetched copy has all 56."""
    rows = list(csv.reader(io.StringIO(text)))
    if not rows:
        raise ValueError("lucid co-location file is empty")
    drop = rows[0] and rows[0][0].strip() in ("", "Unnamed: 0", "index")
    out = io.StringIO()
    w = csv.writer(out, lineterminator="\n")
    for r in rows:
        if r:
            w.writerow(r[1:] if drop else r)
    return out.getvalue()


def _get(url: str, timeout: float = 60.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as resp:  # noqa: S310 - fixed https URLs
        return resp.read().decode()


def fetch(dest: Path, log: Callable[[str], None] = print, get: Callable[[str], str] = _get) -> list[str]:
    """Download and convert every file into ``dest``; returns the files written.
    Synergy's sensitivity tables are assembled from its per-model sources,
    listed through the GitHub contents API."""
    dest.mkdir(parents=True, exist_ok=True)
    written = []

    def put(rel: str, text: str) -> None:
        p = dest / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
        written.append(rel)
        log(f"wrote {p}")

    thr_text = get(raw_url(*GAVEL, "scheduler/simulation_throughputs.json"))
    put("gavel/throughputs.json", thr_text)
    v100 = json.loads(thr_text)["v100"]
    for vc in ("0e4a51", "103959"):
        put(f"philly/vc_{vc}.csv", convert_gavel_trace(get(raw_url(*GAVEL, f"scheduler/traces/msr/seed=0/{vc}.trace")), v100))
    put("philly/runtimes.csv", get(raw_url(*ALIBABA, "cluster-trace-gpu-v2020/analysis/philly_runtime.csv")))
    put("iadeep/colocation_util.csv",
        convert_colocation(get(raw_url(*IADEEP, "iadeep-scheduler-extender/csv/interference_util.csv"))))
    put("iadeep/offline_info.csv", get(raw_url(*IADEEP, "iadeep-scheduler-extender/csv/offline_info.csv")))
    put("lucid/colocation.csv", convert_lucid_colocation(get(raw_url(*LUCID, "simulation/data/colocate_info.csv"))))
    put("lucid/solo.csv", get(raw_url(*LUCID, "simulation/analyzer/single_data.csv")))
    put("synergy/static_100job.csv",
        convert_synergy_trace(get(raw_url(*SYNERGY, "simulator/deploy_trace/static_100job_6_3_1100.0"))))
    listing = json.loads(get(f"https://api.github.com/repos/{SYNERGY[0]}/contents/simulator/models?ref={SYNERGY[1]}"))
    sources = {e["name"][:-3]: get(raw_url(*SYNERGY, f"simulator/models/{e['name']}"))
               for e in listing if e.get("name", "").endswith(".py") and e["name"] != "__init__.py"
               and e["name"][:-3].rpartition("_")[2].isdigit()}
    put("synergy/sensitivity.json", json.dumps(assemble_sensitivity(sources), indent=1) + "\n")
    return written
