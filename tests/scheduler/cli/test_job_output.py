"""What `dlshare job list|show|events` print for people: the list fits the terminal whatever the
ids and reasons (fuzzed), -o wide cuts nothing, show reads like kubectl describe."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler.cli.job_output import ago, cut, describe, event_message, events_table, job_table, until

NOW = 1_800_000_000.0


def job(jid="train-1", state="queued", gpus=8, reason=None, waiting=None, alloc=None, user="alice"):
    return {"id": jid, "state": state, "reason": reason, "waiting": waiting, "allocation": alloc, "user": user,
            "account": "vision", "submitted_at": NOW - 300, "started_at": None, "finished_at": None,
            "exit_code": None, "attained_service": 0.0, "attempts": 0,
            "spec": {"name": "resnet", "model": "resnet50", "batch_size": 64, "gpus": gpus, "cpus": 2.0,
                     "memory_bytes": 4 << 30, "command": ["python", "train.py"]}}


WAIT = {"code": "Resources", "reason": "needs 8 GPUs on 2 nodes; 1 free", "position": 2, "queue_length": 5,
        "nodes": "0/2 nodes are available: 2 needs 8 GPUs; 1 free in the cluster", "since": NOW - 120,
        "estimated_start": NOW + 720, "estimated_at": NOW - 1}
RUNNING = {"node": "gpu-node-17", "gpus": [0, 1], "cpus": 6.0, "memory_bytes": 24 << 30,
           "shards": [{"node": "gpu-node-17", "gpus": [0, 1]}], "remote_memory_bytes": 0}


def test_the_list_shows_a_gpu_count_the_node_and_the_reason_in_80_columns():
    jobs = [job("a-very-long-job-identifier-from-a-launcher-0001", waiting=WAIT, reason=WAIT["reason"]),
            job("r1", "running", 2, alloc=RUNNING)]
    out = job_table(jobs, NOW, 80).splitlines()
    assert out[0].split() == ["JOB", "STATE", "GPUS", "NODE", "AGE", "REASON"]
    assert all(len(x) <= 80 for x in out), out
    assert out[1].startswith("a-very-long-job-ide…  queued   8     -") and "Resources: needs 8 GPUs" in out[1]
    assert out[2].split() == ["r1", "running", "2", "gpu-node-17", "5m"]  # a count, not GPU indices
    wide = job_table(jobs, NOW, 80, wide=True).splitlines()
    assert "a-very-long-job-identifier-from-a-launcher-0001" in wide[1] and "2/5" in wide[1] and "in 12m" in wide[1]
    assert wide[1].endswith("Resources: needs 8 GPUs on 2 nodes; 1 free")  # wide cuts nothing


@settings(max_examples=150, deadline=None)
@given(ids=st.lists(st.text(st.characters(min_codepoint=33, max_codepoint=126), min_size=1, max_size=128),
                    min_size=1, max_size=6),
       reason=st.text(max_size=300), width=st.integers(40, 200), nodes=st.integers(0, 12))
def test_the_list_never_runs_past_the_terminal(ids, reason, width, nodes):
    shards = [{"node": f"node-{i:04d}", "gpus": [0]} for i in range(nodes)]
    jobs = [job(i, "running" if nodes else "queued", reason=reason,
                alloc={**RUNNING, "shards": shards} if nodes else None) for i in ids]
    lines = job_table(jobs, NOW, width).splitlines()
    assert len(lines) == len(ids) + 1 and all(len(x) <= width for x in lines)


def test_show_reads_like_kubectl_describe_with_the_events():
    events = [{"seq": 1, "ts": NOW - 300, "kind": "submitted", "node": None,
               "data": {"gpus": 8, "cpus": 2.0, "user": "alice"}},
              {"seq": 2, "ts": NOW - 299, "kind": "waiting", "node": None,
               "data": {"code": "Resources", "reason": "needs 8 GPUs on 2 nodes; 0 free", "position": 3}},
              {"seq": 3, "ts": NOW - 120, "kind": "waiting", "node": None, "data": WAIT}]
    text = describe(job(waiting=WAIT, reason=WAIT["reason"]), events, NOW)
    for line in ("Job:             train-1", "User:            alice (account vision)", "State:           queued",
                 "Reason:          Resources: needs 8 GPUs on 2 nodes; 1 free", "Position:        2 of 5",
                 "Requested:       8 GPUs, 2 CPUs, 4.0 GiB", "Command:         python train.py"):
        assert line in text, text
    assert "Estimated start: in 12m (" in text and "Nodes:           0/2 nodes are available" in text
    tail = text.split("Events:\n")[1].splitlines()
    assert tail[0].split() == ["AGE", "KIND", "NODE", "MESSAGE"] and "8 GPUs, 2 CPUs by alice" in tail[1]
    assert tail[2].endswith("Resources: needs 8 GPUs on 2 nodes; 0 free (position 3)")
    ran = describe(job(state="done", alloc=RUNNING, reason=None), [], NOW)
    assert "Placed:    gpu-node-17 GPU 0,1, 6 CPUs, 24.0 GiB" in ran and "  <none>" in ran
    assert "Estimated start" not in ran


def test_event_lines_and_times():
    placed = {"kind": "placed", "node": "n1", "data": {"gpus": [0, 1], "cpus": 3, "memory_bytes": 1 << 30,
                                                       "nodes": ["n1"], "resumed": True, "colocated_with": ["b"],
                                                       "remote_memory_bytes": 2 << 30}}
    assert event_message(placed) == "on n1 GPU 0,1, 3 CPUs, 1.0 GiB + 2.0 GiB lent (resumed), sharing with b"
    assert event_message({"kind": "exited", "data": {"exit_code": 3, "why": "oom"}}) == "exit code 3: oom"
    assert event_message({"kind": "preempted", "data": {"why": "for j7"}}) == "for j7"
    assert event_message({"kind": "node_online", "data": {"cpus": 4}}) == '{"cpus": 4}'
    assert "KIND" in events_table([], NOW)
    assert (ago(NOW - 30, NOW), ago(NOW - 600, NOW), ago(NOW - 3 * 3600, NOW), ago(NOW - 5 * 86400, NOW)) == \
        ("30s", "10m", "3h", "5d")
    assert (until(None, NOW), until(NOW, NOW), until(NOW + 90, NOW)) == ("unknown", "now", "in 90s")
    assert cut("abcdef", 4) == "abc…" and cut("ab", 4) == "ab" and cut("ab", 0) == ""


def test_a_reason_or_name_cannot_break_a_line_or_drive_the_terminal():
    nasty = job("x", reason="start failed:\nline two\x1b[31mred", waiting=None)
    nasty["spec"]["name"] = "evil\x1b]0;title\x07"
    out = job_table([nasty], NOW, 200, wide=True)
    assert len(out.splitlines()) == 2 and "\x1b" not in out and "start failed: line two?[31mred" in out
    assert "\x1b" not in describe(nasty, [], NOW)
