"""The benchmarks' cluster of real donor daemons (bench/memory.py): what it reports about them."""

from __future__ import annotations

from bench.memory import Cluster
from nodesvc.bus.procs import wait_until


def test_a_donor_killed_keeps_the_cpu_it_used_in_the_clusters_count(tmp_path):
    """A run's donor CPU is the difference of two readings; a donor killed in between must not take
    what it had used out of the second one (the paging bench's kill runs read negative before)."""
    cluster = Cluster(2, 16 << 20, tmp_path)
    try:
        # each daemon spends well over 0.1 CPU-s starting (Python, the bus, the slab server)
        wait_until(lambda: all(c > 0.1 for c in _each(cluster)), timeout=60, what="both donors started")
        before = cluster.cpu_s()
        victim = next(iter(cluster.procs))
        cluster.kill9(victim)
        assert cluster.procs[victim].poll() is not None
        after = cluster.cpu_s()
        assert after >= before
        # and a donor started again adds to the count, not in the dead one's place
        cluster.restart_dead()
        wait_until(lambda: cluster.cpu_s() > after + 0.05, timeout=60, what="the restarted donor counted")
    finally:
        cluster.close()


def _each(cluster: Cluster) -> list[float]:
    import psutil

    out = []
    for p in cluster.procs.values():
        t = psutil.Process(p.pid).cpu_times()
        out.append(t.user + t.system)
    return out
