"""Measure (graph features, GPU utilisation) rows on a GPU machine.

    python -m bench.gpu_profile --out gpu_profile.csv [--seconds 20] [--batches 16,32,64]

For each model of a small zoo (a ResNet-style CNN, a VGG-style CNN, an MLP
recommender, an LSTM language model, a Transformer encoder) at several batch
sizes it trains for a while alone, then in pairs (two processes sharing GPU 0),
and samples NVML every 100 ms: SM utilisation, memory-bandwidth utilisation,
memory used, and the training throughput (steps/s).  Each row carries the
model's torch.fx features (``scheduler.predictors.utilisation.graph_features``),
so ``UtilisationPredictor.from_rows(csv)`` trains on it directly, and the pair
rows give measured co-location slowdowns (throughput in the pair / alone).

Everything but the NVML sampling and the CUDA runs is plain CPU code
(:func:`zoo`, :func:`plan`, :func:`summarise`, :func:`write_rows`) and is tested
without a GPU; :class:`NvmlSampler` takes the NVML module as an argument, so a
fake stands in for it in tests.
"""

from __future__ import annotations

import argparse
import csv
import itertools
import multiprocessing as mp
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


def plan(models: Sequence[str], batches: Sequence[int], pairs: bool = True) -> list[tuple[tuple[str, int], ...]]:
    """The runs: every (model, batch) alone, then every unordered pair of them."""
    singles = [((m, b),) for m in models for b in batches]
    if not pairs:
        return singles
    combos = [tuple(p) for p in itertools.combinations([s[0] for s in singles], 2)]
    return singles + combos


class NvmlSampler:
    """Samples one GPU's utilisation in a thread; ``nvml`` is the pynvml module (or a fake)."""

    def __init__(self, nvml: Any, index: int = 0, period_s: float = 0.1) -> None:
        self.nvml = nvml
        self.period = period_s
        nvml.nvmlInit()
        self.handle = nvml.nvmlDeviceGetHandleByIndex(index)
        self.samples: list[tuple[float, float, float]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def sample(self) -> tuple[float, float, float]:
        u = self.nvml.nvmlDeviceGetUtilizationRates(self.handle)
        m = self.nvml.nvmlDeviceGetMemoryInfo(self.handle)
        return float(u.gpu), float(u.memory), float(m.used)

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


def summarise(samples: Sequence[tuple[float, float, float]], skip: int = 5) -> tuple[float, float, float]:
    """Median SM %, memory %, bytes used, after the warm-up samples."""
    s = list(samples[skip:]) or list(samples)
    if not s:
        raise ValueError("no NVML samples")
    return (statistics.median(x[0] for x in s), statistics.median(x[1] for x in s), max(x[2] for x in s))


def _train(name: str, batch: int, seconds: float, q: Any) -> None:  # pragma: no cover - needs a GPU
    import torch
    import torch.nn.functional as F

    spec = next(m for m in zoo() if m.name == name)
    model = spec.build().cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = spec.example(batch).cuda(), spec.target(batch).cuda()
    steps, t0 = 0, None
    end = time.time() + seconds
    while time.time() < end:
        out = model(x)
        loss = F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        torch.cuda.synchronize()
        steps += 1
        if steps == 5:
            t0 = time.time()
    q.put((name, batch, (steps - 5) / (time.time() - t0) if t0 else 0.0))


def run_group(group: tuple[tuple[str, int], ...], seconds: float, nvml: Any) -> tuple[list[float], tuple[float, float, float]]:  # pragma: no cover
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_train, args=(m, b, seconds, q)) for m, b in group]
    with NvmlSampler(nvml) as s:
        for p in procs:
            p.start()
        for p in procs:
            p.join()
    got = {(m, b): t for m, b, t in (q.get() for _ in procs)}
    return [got[g] for g in group], summarise(s.samples)


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


def main(argv: Sequence[str] | None = None) -> int:  # pragma: no cover - needs a GPU
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="gpu_profile.csv")
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--batches", default="16,32,64")
    ap.add_argument("--no-pairs", action="store_true")
    a = ap.parse_args(argv)
    import pynvml

    batches = [int(b) for b in a.batches.split(",")]
    models = zoo()
    feats = feature_rows(models, batches)
    alone: dict[tuple[str, int], float] = {}
    rows = []
    for group in plan([m.name for m in models], batches, pairs=not a.no_pairs):
        tput, (sm, mem, used) = run_group(group, a.seconds, pynvml)
        for i, (m, b) in enumerate(group):
            partner = group[1 - i] if len(group) == 2 else ("", "")
            if len(group) == 1:
                alone[(m, b)] = tput[i]
            rows.append({"model": m, "batch_size": b, "partner": partner[0], "partner_batch_size": partner[1],
                         **feats[(m, b)], "sm_percent": sm, "mem_percent": mem, "memory_used_bytes": used,
                         "steps_per_s": tput[i], "speed_vs_alone": tput[i] / alone[(m, b)] if alone.get((m, b)) else ""})
        print(group, tput, sm, mem, file=sys.stderr)
    write_rows(a.out, rows)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
