"""Slurm's JSON as records (scheduler.slurm.squeue): real shapes, later shapes, and fuzzing."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler.slurm.squeue import (
    GresRequest, SlurmJsonError, expand_hostlist, parse_gres, parse_job, parse_jobs, parse_nodes,
)
from tests.scheduler.slurm.slurm_json import job_json, node_json


def test_held_pending_job():
    j = parse_job(job_json(7, comment="model=LM bs=20", tres_per_node="gres:gpu:2"))
    assert (j.job_id, j.state, j.held, j.pending, j.running, j.terminal) == ("7", "PENDING", True, True, False, False)
    assert j.gpus() == 2 and j.memory_mb == 2000 and j.comment == "model=LM bs=20"


def test_running_job_spread_over_nodes():
    j = parse_job(job_json(9, job_state="RUNNING", priority=4294901759, nodes="n[2-3]", node_count=2, cpus=8,
                           memory_per_node=90000, memory_per_cpu=None, tres_per_node="gres:gpu:4",
                           required_nodes="n2,n3", restart_cnt=2))
    assert j.nodes == ("n2", "n3") and j.required_nodes == ("n2", "n3")
    assert j.gpus() == 8 and j.memory_mb == 90000 and j.restart_count == 2 and j.running and not j.held


def test_gpu_requests_per_job_per_task_and_typed():
    assert parse_job(job_json(1, tres_per_node="", tres_per_job="gres:gpu:2")).gpus() == 2
    assert parse_job(job_json(1, tres_per_node="", tres_per_task="gres:gpu:1", tasks=4)).gpus() == 4
    assert parse_job(job_json(1, tres_per_node="gres:gpu:a100:3,gres:nic:1")).gpus() == 3
    assert parse_job(job_json(1, tres_per_node="gres/gpu:2")).gpus() == 2  # 23.x spelling
    assert parse_job(job_json(1, tres_per_node="")).gpus() == 0


def test_later_versions_wrapped_numbers_and_lists():
    j = parse_job(job_json(3, job_state=["RUNNING", "REQUEUED"], priority={"set": True, "infinite": False,
                                                                             "number": 5},
                           memory_per_node={"set": True, "infinite": False, "number": 4096},
                           exit_code={"status": ["SUCCESS"], "return_code": {"set": True, "number": 0}}))
    assert j.state == "RUNNING" and j.priority == 5 and j.memory_mb == 4096


@pytest.mark.parametrize("value,minutes", [
    (30, 30), (None, None), (0, None), (0xFFFFFFFE, None), (0xFFFFFFFF, None),
    ({"set": True, "infinite": False, "number": 45}, 45), ({"set": True, "infinite": True, "number": 0}, None),
    ({"set": False, "infinite": False, "number": 0}, None),
])
def test_time_limit_in_every_shape(value, minutes):
    assert parse_job(job_json(4, time_limit=value)).time_limit_min == minutes
    assert parse_job(job_json(4)).time_limit_min is None  # absent: none


def test_a_time_limit_that_is_not_a_number_names_the_field():
    with pytest.raises(SlurmJsonError, match="job 4: time_limit"):
        parse_job(job_json(4, time_limit="1:00:00"))


def test_nodes():
    nodes = parse_nodes({"nodes": [
        node_json("n1"), node_json("n2", state="idle", state_flags=["DRAIN"], reason="maintenance"),
        node_json("n3", state="down", state_flags=["NOT_RESPONDING"]), node_json("n4", state="mixed"),
        node_json("n5", state="idle", state_flags=["NOT_RESPONDING"]), node_json("n1")]})
    by = {n.name: n for n in nodes}
    assert len(nodes) == 5 and by["n1"].gpus == 8 and by["n1"].memory_mb == 256000
    assert [n.name for n in nodes if n.usable] == ["n1", "n4", "n5"]  # not responding alone is not a loss yet
    assert [n.name for n in nodes if n.down] == ["n3"]


@pytest.mark.parametrize("text,names", [
    ("n[1-3]", ("n1", "n2", "n3")), ("n[1-3,5],gpu7", ("n1", "n2", "n3", "n5", "gpu7")),
    ("node[08-10]", ("node08", "node09", "node10")), ("r[1-2]n[1-2]", ("r1n1", "r1n2", "r2n1", "r2n2")),
    ("", ()), ("(null)", ()), ("a,a", ("a",)),
])
def test_hostlists(text, names):
    assert expand_hostlist(text) == names


@pytest.mark.parametrize("text", ["n[1-", "n1]", "n[3-1]", "n[a-b]"])
def test_bad_hostlists(text):
    with pytest.raises(SlurmJsonError):
        expand_hostlist(text)


def test_gres_text():
    assert parse_gres("gpu:4(S:0-1),shard:16") == (GresRequest("gpu", "", 4), GresRequest("shard", "", 16))
    assert parse_gres("gres:gpu:a100:2") == (GresRequest("gpu", "a100", 2),)
    assert parse_gres("shard:(null):0(IDX:N/A)") == (GresRequest("shard", "", 0),)
    assert str(GresRequest("gpu", "a100", 2)) == "gpu:a100:2"


@pytest.mark.parametrize("bad,words", [
    ({"jobs": "x"}, "jobs"), ({"jobs": [{"job_id": "7"}]}, "job_id"), ({"jobs": [job_json(1, job_state=3)]}, "job_state"),
    ({"jobs": [job_json(1, cpus="many")]}, "cpus"), ({"jobs": [job_json(1, tres_per_node="gres:gpu:x:y:z")]}, "gres"),
    ({"jobs": [job_json(1, nodes="n[1-")]}, "hostlist"),
])
def test_bad_json_names_the_field(bad, words):
    with pytest.raises(SlurmJsonError) as exc:
        parse_jobs(bad)
    assert words in str(exc.value)


def test_an_error_with_an_empty_list_is_not_an_empty_queue():
    # slurmctld down: squeue --json exits 0 with this; taking it as "no jobs" would end every job
    down = {"meta": {}, "errors": [{"description": "Failed while looking for jobs", "error_number": -1,
                                    "error": "Unspecified error", "source": "slurm_load_jobs"}], "jobs": []}
    with pytest.raises(SlurmJsonError, match="slurm_load_jobs: Unspecified error"):
        parse_jobs(down)
    with pytest.raises(SlurmJsonError, match="Slurm reports an error"):
        parse_nodes({**down, "nodes": []})
    assert parse_jobs({"meta": {}, "errors": [], "jobs": []}) == []


def test_text_input_and_not_json():
    assert parse_jobs(json.dumps({"jobs": [job_json(4)]}))[0].job_id == "4"
    with pytest.raises(SlurmJsonError):
        parse_jobs("squeue: error: Unable to contact slurm controller")


scalars = st.one_of(st.none(), st.booleans(), st.integers(-5, 1 << 33), st.floats(allow_nan=True), st.text(max_size=12),
                    st.lists(st.text(max_size=5), max_size=3), st.dictionaries(st.sampled_from(["set", "number", "infinite"]),
                                                                                  st.one_of(st.booleans(), st.integers())))
job_keys = list(job_json(1))


@settings(max_examples=300)
@given(st.dictionaries(st.sampled_from(job_keys), scalars, max_size=12), st.integers(1, 1 << 31))
def test_fuzzed_job_records_parse_or_raise_slurm_json_error(over, jid):
    rec = {**job_json(jid), **over}
    try:
        j = parse_job(rec)
    except SlurmJsonError as exc:
        assert str(exc)
    else:
        assert j.job_id and j.gpus() >= 0


@settings(max_examples=200)
@given(st.dictionaries(st.sampled_from(list(node_json("n"))), scalars, max_size=8))
def test_fuzzed_node_records_parse_or_raise_slurm_json_error(over):
    try:
        parse_nodes({"nodes": [{**node_json("n1"), **over}]})
    except SlurmJsonError as exc:
        assert str(exc)
