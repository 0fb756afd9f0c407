"""A mixed GPU/CPU trace (the Philly format with ``num_cpus`` and ``memory_gb``) parses strictly
and simulates: CPU-only jobs run on the cores the GPU jobs leave, through the same core."""

import pytest

from scheduler import Allocate, Place
from scheduler.sim import Cluster, simulate
from scheduler.trace import GB, TraceError, parse_trace

HEADER = "job_id,arrival_s,model,batch_size,num_gpus,total_steps,isolated_duration_s,num_cpus,memory_gb\n"
MIXED = HEADER + """g1,0,ResNet-18,32,2,100,3600,,
c1,0,decode-imagenet,0,0,0,1800,4,16
c2,10,decode-imagenet,0,0,0,1800,4,16
c3,20,tokenize,0,0,0,600,8,8
g2,30,ResNet-50,64,1,100,1200,6,100
"""


def test_the_mixed_format_parses_cpu_rows_and_requests():
    jobs = {j.id: j for j in parse_trace(MIXED, "mixed.csv")}
    assert jobs["c1"].gpus == 0 and jobs["c1"].cpus == 4.0 and jobs["c1"].memory_bytes == 16 * GB
    assert jobs["g1"].cpus == 0.0 and jobs["g1"].memory_bytes == 0  # empty: the plugin decides
    assert jobs["g2"].cpus == 6.0 and jobs["g2"].memory_bytes == 100 * GB


@pytest.mark.parametrize("text, words", [
    (HEADER + "c,0,prep,0,0,0,60,0,1\n", "needs num_cpus > 0"),
    (HEADER + "c,0,prep,0,0,0,60,-1,1\n", "num_cpus"),
    (HEADER.replace(",memory_gb", "") + "c,0,prep,0,0,0,60,2\n", "give both"),
    ("job_id,arrival_s,model,batch_size,num_gpus,total_steps,isolated_duration_s\nc,0,prep,0,0,0,60\n",
     "CPU-only rows need"),
])
def test_bad_mixed_rows_name_the_row_and_column(text, words):
    with pytest.raises(TraceError, match=words):
        parse_trace(text, "mixed.csv")


def test_a_mixed_trace_simulates_cpu_jobs_beside_gpu_jobs():
    trace = parse_trace(MIXED, "mixed.csv")
    decisions = []
    # Two nodes of 2 GPUs, 8 cores, 100 GB: c3 (8 cores) waits until the cores are free.
    r = simulate(trace, Cluster.parse("2x2:8:100"), "fifo", on_decision=decisions.append)
    assert r.metrics()["jobs"] == 5 and r.failed == 0
    placed = {d.job: d for d in decisions if isinstance(d, Place)}
    assert set(placed) == {"g1", "g2", "c1", "c2", "c3"}
    assert placed["c1"].gpus == () and placed["c3"].gpus == ()
    allocs = {(d.job, d.node): d for d in decisions if isinstance(d, Allocate)}
    assert allocs[("c1", placed["c1"].node)].cpus == 4.0
    assert allocs[("c1", placed["c1"].node)].memory_bytes == 16 * GB
    # g1 takes node A's GPUs and c1, c2 its 8 cores (fewest free GPUs first); c3 takes all of
    # B's cores; g2 (1 GPU, asks for 6 cores) fits nowhere until c3 leaves B's cores.
    a = placed["g1"].node
    assert placed["c1"].node == placed["c2"].node == a and placed["c3"].node != a
    assert placed["c3"].stimulus_id == "arrive:c3"
    assert placed["g2"].stimulus_id == "finish:c3" and placed["g2"].node == placed["c3"].node
