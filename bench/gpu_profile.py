"""Measure (graph features, GPU utilisation) rows on a GPU machine.

    python -m bench.gpu_profile --out gpu_profile.csv [--seconds 20] [--batches 16,32,64] [--pairs same]
    python -m bench.gpu_profile --evaluate gpu_profile.csv

For each model of a small zoo (a ResNet-style CNN, a VGG-style CNN, an MLP
recommender, an LSTM language model, a Transformer encoder) at several batch
sizes it trains for a while alone, then in pairs (two processes sharing GPU 0),
and samples NVML every 100 ms: SM utilisation, memory-bandwidth utilisation,
memory used, and the training throughput (steps/s).  The jobs of a group are
built and warmed up first, then timed together over the same window (a
barrier), and only the NVML samples inside that window count.  Each row carries the
model's torch.fx features (``scheduler.predictors.utilisation.graph_features``),
so ``UtilisationPredictor.from_rows(csv)`` trains on it directly, and the pair
rows give measured co-location slowdowns (throughput in the pair / alone).

``--evaluate`` holds the co-location predictor the scheduler uses (trained on
Lucid's measurements) against the measured pairs: its error, and whether the
``colocation_gain`` filter would admit each pair as the measurement says.

The whole path runs without a GPU too (``--device cpu`` with a simulated NVML,
and the tests); :class:`NvmlSampler` takes the NVML module as an argument, so a
fake stands in for it.
"""

from __future__ import annotations

import argparse
import csv
import itertools
import math
import multiprocessing as mp
import queue
import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from scheduler.predictors.utilisation import MIX, graph_features

COLUMNS = ["model", "batch_size", "partner", "partner_batch_size", "flops", "params", "activation_bytes",
           *(f"mix_{k}" for k in MIX), "sm_percent", "mem_percent", "memory_used_bytes", "steps_per_s",
           "speed_vs_alone"]


@dataclass(frozen=True)
class ModelSpec:
    name: str
    build: Callable[[], Any]
    example: Callable[[int], Any]  # batch size -> example input
    target: Callable[[int], Any]   # batch size -> target for the loss


def zoo() -> list[ModelSpec]:
    """The profiled models (small enough to build on a CPU for feature extraction)."""
    import torch
    import torch.nn as nn

    def cnn(widths: Sequence[int], blocks: int) -> nn.Module:
        layers: list[nn.Module] = []
        c = 3
        for w in widths:
            for _ in range(blocks):
                layers += [nn.Conv2d(c, w, 3, padding=1), nn.BatchNorm2d(w), nn.ReLU()]
                c = w
            layers.append(nn.MaxPool2d(2))
        layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c, 100)]
        return nn.Sequential(*layers)

    class LM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(10000, 256)
            self.rnn = nn.LSTM(256, 512, num_layers=2, batch_first=True)
            self.out = nn.Linear(512, 10000)

        def forward(self, x):
            h, _ = self.rnn(self.emb(x))
            return self.out(h)

    class Encoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(10000, 256)
            self.attn = nn.MultiheadAttention(256, 8, batch_first=True)
            self.ff = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256))
            self.norm = nn.LayerNorm(256)
            self.out = nn.Linear(256, 10000)

        def forward(self, x):
            h = self.emb(x)
            a, _ = self.attn(h, h, h)
            h = self.norm(h + a)
            return self.out(self.norm(h + self.ff(h)))

    img = lambda b: torch.randn(b, 3, 64, 64)  # noqa: E731
    cls = lambda b: torch.randint(0, 100, (b,))  # noqa: E731
    tok = lambda b: torch.randint(0, 10000, (b, 32))  # noqa: E731
    return [
        ModelSpec("resnetish", lambda: cnn([64, 128, 256], 2), img, cls),
        ModelSpec("vggish", lambda: cnn([64, 128, 256, 512], 2), img, cls),
        ModelSpec("mlp_recommender", lambda: nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 1024),
                                                            nn.ReLU(), nn.Linear(1024, 100)),
                  lambda b: torch.randn(b, 512), cls),
        ModelSpec("lstm_lm", LM, tok, lambda b: torch.randint(0, 10000, (b, 32))),
        ModelSpec("transformer", Encoder, tok, lambda b: torch.randint(0, 10000, (b, 32))),
    ]


def plan(models: Sequence[str], batches: Sequence[int], pairs: bool | str = True) -> list[tuple[tuple[str, int], ...]]:
    """The runs: every (model, batch) alone, then every unordered pair of them (``pairs="same"``: only
    pairs of one batch size; False or ``"none"``: no pairs)."""
    singles = [((m, b),) for m in models for b in batches]
    if not pairs or pairs == "none":
        return singles
    combos = [tuple(p) for p in itertools.combinations([s[0] for s in singles], 2)]
    if pairs == "same":
        combos = [c for c in combos if c[0][1] == c[1][1]]
    return singles + combos


class NvmlSampler:
    """Samples one GPU's utilisation in a thread; ``nvml`` is the pynvml module (or a fake).
    Each sample is (time.time(), SM %, memory-controller %, memory used in bytes)."""

    def __init__(self, nvml: Any, index: int = 0, period_s: float = 0.1) -> None:
        self.nvml = nvml
        self.period = period_s
        nvml.nvmlInit()
        self.handle = nvml.nvmlDeviceGetHandleByIndex(index)
        self.samples: list[tuple[float, float, float, float]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def sample(self) -> tuple[float, float, float, float]:
        u = self.nvml.nvmlDeviceGetUtilizationRates(self.handle)
        m = self.nvml.nvmlDeviceGetMemoryInfo(self.handle)
        return time.time(), float(u.gpu), float(u.memory), float(m.used)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append(self.sample())
            self._stop.wait(self.period)

    def __enter__(self) -> "NvmlSampler":
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join()


def summarise(samples: Sequence[tuple[float, float, float, float]], start: float = -math.inf,
              end: float = math.inf) -> tuple[float, float, float]:
    """Median SM %, median memory-controller %, most memory used, over the samples taken in
    [``start``, ``end``] (the window in which every job of the group was timed)."""
    s = [x for x in samples if start <= x[0] <= end]
    if not s:
        raise ValueError("no NVML samples in the timed window")
    return (statistics.median(x[1] for x in s), statistics.median(x[2] for x in s), max(x[3] for x in s))


WARMUP_STEPS = 5  # untimed: cuDNN's algorithm search, the allocator's first blocks, lazy CUDA modules


def _train(name: str, batch: int, seconds: float, q: Any, start: Any, device: str = "cuda") -> None:
    """One job of a group: build, warm up, wait for the others (``start``, a barrier), then train for
    ``seconds`` and report (name, batch, steps/s, window start, window end); on an error, the error's
    text in the place of the rate."""
    try:
        import torch
        import torch.nn.functional as F

        spec = next(m for m in zoo() if m.name == name)
        model = spec.build().to(device)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        x, y = spec.example(batch).to(device), spec.target(batch).to(device)

        def step() -> None:
            out = model(x)
            loss = F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
            if device.startswith("cuda"):
                torch.cuda.synchronize()

        for _ in range(WARMUP_STEPS):
            step()
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which fails the group with it
        start.abort()
        q.put((name, batch, f"{type(exc).__name__}: {exc}", 0.0, 0.0))
        return
    try:
        start.wait(timeout=600)  # every job of the group is warm: they are timed together
    except threading.BrokenBarrierError:
        q.put((name, batch, "another job of the group failed", 0.0, 0.0))
        return
    steps, t0 = 0, time.time()
    while time.time() < t0 + seconds:
        step()
        steps += 1
    t1 = time.time()
    q.put((name, batch, steps / (t1 - t0), t0, t1))


def run_group(group: tuple[tuple[str, int], ...], seconds: float, nvml: Any, device: str = "cuda",
              period_s: float = 0.1, target: Callable[..., None] = _train,
              ) -> tuple[list[float], tuple[float, float, float]]:
    """Train the group's jobs at once, one process each, timed over the same window; their steps/s and
    the GPU's (SM %, memory %, memory used) in that window.  RuntimeError when a job fails, or when its
    process dies without a word (killed for memory, say): then at once, not at the deadline."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    start = ctx.Barrier(len(group))
    procs = [ctx.Process(target=target, args=(m, b, seconds, q, start, device)) for m, b in group]
    got: dict[tuple[str, int], tuple[Any, float, float]] = {}
    deadline = time.monotonic() + seconds + 900
    with NvmlSampler(nvml, period_s=period_s) as s:
        for p in procs:
            p.start()
        try:
            while len(got) < len(procs):
                try:
                    m, b, rate, t0, t1 = q.get(timeout=1.0)
                    got[(m, b)] = (rate, t0, t1)
                    continue
                except queue.Empty:
                    pass
                dead = [(g, p.exitcode) for g, p in zip(group, procs) if g not in got and p.exitcode is not None]
                if dead:
                    start.abort()  # its partners stop waiting for it
                    raise RuntimeError("; ".join(f"{g}: the process ended with {code} and no result"
                                                 for g, code in dead))
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{group}: no result within {seconds + 900:.0f} s")
        finally:
            for p in procs:
                p.join(timeout=60)
                if p.is_alive():
                    p.kill()
    errors = [f"{g}: {got[g][0]}" for g in group if isinstance(got[g][0], str)]
    if errors:
        raise RuntimeError("; ".join(errors))
    window = (max(got[g][1] for g in group), min(got[g][2] for g in group))
    return [float(got[g][0]) for g in group], summarise(s.samples, *window)


def feature_rows(models: Sequence[ModelSpec], batches: Sequence[int]) -> dict[tuple[str, int], dict[str, float]]:
    """torch.fx features of every (model, batch), on the CPU."""
    out = {}
    for spec in models:
        net = spec.build()
        for b in batches:
            out[(spec.name, b)] = graph_features(net, spec.example(b), b)
    return out


def write_rows(path: str, rows: Sequence[dict[str, Any]]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        for r in rows:
            w.writerow({k: r.get(k, "") for k in COLUMNS})


def _int(v: Any) -> int:
    return int(float(v))


def solo_profiles(rows: Sequence[dict[str, Any]]) -> dict[tuple[str, int], Any]:
    """(model, batch) -> its :class:`~scheduler.predictors.colocation.SoloProfile` from the rows of it
    running alone (what a node's NVML telemetry would give the scheduler)."""
    from scheduler.predictors.colocation import SoloProfile

    out = {}
    for r in rows:
        if not r.get("partner"):
            out[(r["model"], _int(r["batch_size"]))] = SoloProfile(
                gpu_util=float(r["sm_percent"]), gmem_util=float(r["mem_percent"]),
                gmem_mib=float(r["memory_used_bytes"]) / 2**20, batch_size=_int(r["batch_size"]), model=r["model"])
    return out


def measured_pairs(rows: Sequence[dict[str, Any]]) -> list[tuple[tuple[str, int], tuple[str, int], float, float]]:
    """Every measured pair once: (job a, job b, a's speed next to b, b's speed next to a), speeds
    against each job alone."""
    side = {}
    for r in rows:
        if r.get("partner") and r.get("speed_vs_alone") not in ("", None):
            side[((r["model"], _int(r["batch_size"])), (r["partner"], _int(r["partner_batch_size"])))] = \
                float(r["speed_vs_alone"])
    return [(a, b, v, side[(b, a)]) for (a, b), v in side.items() if (b, a) in side and a < b]


def evaluate(rows: Sequence[dict[str, Any]], predictor: Any, min_gain: float = 0.1,
             min_resident_speed: float = 0.5) -> dict[str, Any]:
    """The co-location predictor (trained elsewhere) against measured pairs: each job's predicted speed
    next to its partner from the two solo profiles, the error, and whether the ``colocation_gain``
    filter (the profile's defaults: combined speed >= 1 + ``min_gain``, the job already there keeps
    >= ``min_resident_speed``) would admit the newcomer as the measurement says, each job of a pair
    taken once as the newcomer."""
    solo = solo_profiles(rows)

    def admit(new: float, resident: float) -> bool:
        return new + resident >= 1.0 + min_gain and resident >= min_resident_speed

    out = []
    for a, b, sa, sb in measured_pairs(rows):
        pa, pb = predictor.predict_one(solo[a], solo[b])
        out.append({"a": f"{a[0]}@{a[1]}", "b": f"{b[0]}@{b[1]}", "measured": (sa, sb), "predicted": (pa, pb),
                    # (b joins a, a joins b)
                    "measured_admit": (admit(sb, sa), admit(sa, sb)),
                    "predicted_admit": (admit(pb, pa), admit(pa, pb))})
    errs = [abs(p - m) / m for r in out for p, m in zip(r["predicted"], r["measured"])]
    decisions = [(m, p) for r in out for m, p in zip(r["measured_admit"], r["predicted_admit"])]
    return {"pairs": out,
            "mape": statistics.mean(errs) if errs else None,
            "decisions": len(decisions),
            "agree": sum(m == p for m, p in decisions),
            "false_admit": sum(p and not m for m, p in decisions),
            "false_reject": sum(m and not p for m, p in decisions)}


def read_rows(path: str) -> list[dict[str, Any]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def main(argv: Sequence[str] | None = None) -> int:  # pragma: no cover - needs a GPU
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="gpu_profile.csv", help="the CSV, rewritten after every group")
    ap.add_argument("--seconds", type=float, default=20.0, help="timed seconds of each group")
    ap.add_argument("--batches", default="16,32,64")
    ap.add_argument("--models", default="", help="a comma-separated subset of the zoo (default: all)")
    ap.add_argument("--pairs", choices=("all", "same", "none"), default="all",
                    help="pairs of every two runs, of one batch size only, or none")
    ap.add_argument("--no-pairs", action="store_true", help="the same as --pairs none")
    ap.add_argument("--device", default="cuda", help="torch device (cpu: a dry run of the whole path)")
    ap.add_argument("--evaluate", metavar="CSV",
                    help="measure nothing: the co-location predictor (Lucid-trained) against CSV's pairs")
    a = ap.parse_args(argv)
    if a.evaluate:
        from scheduler.predictors.colocation import CoLocationPredictor

        res = evaluate(read_rows(a.evaluate), CoLocationPredictor.from_data())
        for r in res["pairs"]:
            print(f"{r['a']:>22s} + {r['b']:<22s} measured {r['measured'][0]:.2f} {r['measured'][1]:.2f}  "
                  f"predicted {r['predicted'][0]:.2f} {r['predicted'][1]:.2f}  "
                  f"admit measured {''.join('yn'[not x] for x in r['measured_admit'])} "
                  f"predicted {''.join('yn'[not x] for x in r['predicted_admit'])}")
        print(f"MAPE {res['mape']:.3f}; the gain filter decides as measured {res['agree']} times of "
              f"{res['decisions']} (false admits {res['false_admit']}, false rejects {res['false_reject']})")
        return 0
    if a.device.startswith("cuda"):
        import pynvml
        nvml: Any = pynvml
    else:
        from nodesvc.gpu import SimulatedNvml
        nvml = SimulatedNvml(1, load=lambda i: (0.0, []))

    batches = [int(b) for b in a.batches.split(",")]
    wanted = [m for m in a.models.split(",") if m]
    models = [m for m in zoo() if not wanted or m.name in wanted]
    if wanted and len(models) != len(wanted):
        ap.error(f"--models: unknown model in {a.models!r}; the zoo has {', '.join(m.name for m in zoo())}")
    try:
        feats = feature_rows(models, batches)
    except Exception as exc:  # noqa: BLE001 - another torch's fx: the measurements are still worth having
        print(f"graph features failed ({type(exc).__name__}: {exc}); rows without them", file=sys.stderr, flush=True)
        feats = {(m.name, b): {} for m in models for b in batches}
    alone: dict[tuple[str, int], float] = {}
    rows: list[dict[str, Any]] = []
    failed = 0
    for group in plan([m.name for m in models], batches, pairs="none" if a.no_pairs else a.pairs):
        try:
            tput, (sm, mem, used) = run_group(group, a.seconds, nvml, a.device)
        except RuntimeError as exc:  # an out-of-memory job, say: the other groups still run
            failed += 1
            print(f"{group}: FAILED: {exc}", file=sys.stderr, flush=True)
            continue
        for i, (m, b) in enumerate(group):
            partner = group[1 - i] if len(group) == 2 else ("", "")
            if len(group) == 1:
                alone[(m, b)] = tput[i]
            speed = tput[i] / alone[(m, b)] if alone.get((m, b)) else ""
            rows.append({**feats[(m, b)], "model": m, "batch_size": b, "partner": partner[0],
                         "partner_batch_size": partner[1], "sm_percent": sm, "mem_percent": mem,
                         "memory_used_bytes": used, "steps_per_s": tput[i], "speed_vs_alone": speed})
        write_rows(a.out, rows)  # what a killed run measured is kept
        print(group, [round(t, 2) for t in tput], sm, mem, file=sys.stderr, flush=True)
    return 1 if failed else 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
