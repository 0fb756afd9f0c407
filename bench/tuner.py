"""The batch-size tuner (scheduler.plugins.tuner) replayed on Lucid's measured co-locations.

Each Lucid pair of models, with each job's AMP setting fixed, was measured at
several batch-size combinations (32/64/128): those are the tuner's arms, and
an arm's reward is the pair's combined samples/s there, ``speed1 x solo
samples/s of job 1 at its batch size + speed2 x ...`` (lucid/colocation.csv
joined with lucid/solo.csv).  Every round the environment answers with that
value times a seeded noise factor (standard deviation 5%, the run-to-run
variation the tuner assumes).

For each group and each arm as the declared default, over ``seeds``:

* ``gain_vs_default``: throughput of the tuner's choice after ``rounds``
  rounds over the default's (true values);
* ``of_best``: its choice over the best arm's;
* ``regret``: mean over the first ``rounds`` rounds of (best - played) / best,
  beside the same for always running the default.
"""

from __future__ import annotations

import numpy as np

from scheduler.plugins.tuner import BatchSizeTuner


def lucid_arms(colocation: str | None = None, solo: str | None = None) -> dict[tuple, dict[tuple[int, int], float]]:
    """(model1, dataset1, amp1, model2, dataset2, amp2) -> {(bs1, bs2): combined samples/s}."""
    from scheduler import data

    alone = {(r["model"], r["dataset"], r["batchsize"], r["amp"]): r["speed"] for r in data.lucid_solo(solo)}
    groups: dict[tuple, dict[tuple[int, int], list[float]]] = {}
    for r in data.lucid_colocation(colocation):
        k1 = (r["model1"], r["dataset1"], r["batchsize1"], r["amp1"])
        k2 = (r["model2"], r["dataset2"], r["batchsize2"], r["amp2"])
        if k1 not in alone or k2 not in alone:
            continue
        g = (r["model1"], r["dataset1"], r["amp1"], r["model2"], r["dataset2"], r["amp2"])
        thr = r["speed1"] * alone[k1] + r["speed2"] * alone[k2]
        groups.setdefault(g, {}).setdefault((r["batchsize1"], r["batchsize2"]), []).append(thr)
    return {g: {a: float(np.mean(v)) for a, v in arms.items()} for g, arms in groups.items() if len(arms) >= 2}


def evaluate(rounds: int = 15, seeds: tuple[int, ...] = (0, 1, 2), noise: float = 0.05,
             colocation: str | None = None, solo: str | None = None) -> dict:
    groups = lucid_arms(colocation, solo)
    gain, of_best, regret, regret_default, found = [], [], [], [], []
    for arms in groups.values():
        names = sorted(arms)
        best = max(arms.values())
        for default in names:
            for seed in seeds:
                rng = np.random.default_rng(seed)
                t = BatchSizeTuner(names, default)
                played = []
                for _ in range(rounds):
                    a = t.next()
                    played.append(arms[a])
                    t.observe(a, arms[a] * max(0.0, 1.0 + noise * rng.standard_normal()))
                choice = arms[t.best()]
                gain.append(choice / arms[default])
                of_best.append(choice / best)
                found.append(choice >= best - 1e-12)
                regret.append(float(np.mean([(best - p) / best for p in played])))
                regret_default.append((best - arms[default]) / best)
    return {"groups": len(groups), "arms_per_group": float(np.mean([len(a) for a in groups.values()])),
            "rounds": rounds, "seeds": list(seeds), "noise": noise, "runs": len(gain),
            "gain_vs_default": float(np.mean(gain)), "gain_vs_default_p10": float(np.percentile(gain, 10)),
            "of_best": float(np.mean(of_best)), "found_best": float(np.mean(found)),
            "regret": float(np.mean(regret)), "regret_default": float(np.mean(regret_default)),
            "worst_of_best": float(np.min(of_best))}
