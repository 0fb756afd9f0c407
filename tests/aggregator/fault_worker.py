"""A worker for the fault tests: do some rounds, say "ready", then hang until killed."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np  # noqa: E402

from aggregator import Client  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--agg", required=True)
    ap.add_argument("--job", required=True)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--rounds", type=int, default=1)
    a = ap.parse_args()
    c = Client(a.agg.split(","), a.job, a.rank, a.world)
    for _ in range(a.rounds):
        c.allreduce(np.full(1000, float(a.rank), np.float32))
    print("ready", flush=True)
    time.sleep(120)
    return 0


if __name__ == "__main__":
    sys.exit(main())
