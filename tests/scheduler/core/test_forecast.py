"""Start estimates (scheduler.forecast): the queue replayed forward through the same core gives the
starts the core really makes when the jobs run as long as the prior says; the live core is left as
it was; the duration prior's mean residual life."""

import heapq
import math
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scheduler import (
    Job, JobArrived, JobFinished, Node, NodeLost, Place, Preempt, SchedulerState, Tick, Wakeup, load_profile, snapshot,
)
from scheduler.forecast import MIN_REMAINING_S, DurationPrior, Replay, elapsed_of, forecast
from scheduler.model import GiB, JobState


def core(profile="fifo", nodes=2, gpus=4) -> SchedulerState:
    return SchedulerState(load_profile(profile), [Node(f"n{i}", gpus, 16, 256 * GiB) for i in range(nodes)],
                          rng=random.Random(0))


def test_the_prior_gives_the_mean_residual_life_and_learns():
    p = DurationPrior([100, 200, 600])
    assert p.remaining(0) == pytest.approx(300)
    assert p.remaining(150) == pytest.approx(400 - 150)  # mean of 200 and 600, less what ran
    assert p.remaining(600) == 600  # past every sample: as long again
    assert p.remaining(599.5) == pytest.approx(0.5) or p.remaining(599.5) == MIN_REMAINING_S
    p.add(1000)
    assert p.remaining(600) == pytest.approx(400) and len(p) == 4
    assert DurationPrior([]).remaining(30) == 30 and DurationPrior([]).remaining(0) == MIN_REMAINING_S
    with pytest.raises(ValueError):
        DurationPrior([1], weight=0)


@settings(max_examples=60, deadline=None)
@given(samples=st.lists(st.floats(0.5, 1e7, allow_nan=False), min_size=1, max_size=40),
       elapsed=st.floats(0, 2e7, allow_nan=False), bad=st.lists(st.sampled_from([math.nan, math.inf, -1.0, 0.0])))
def test_the_prior_is_finite_and_exact_for_any_sample(samples, elapsed, bad):
    p = DurationPrior(samples + bad)  # junk samples are ignored
    r = p.remaining(elapsed)
    assert math.isfinite(r) and r >= MIN_REMAINING_S
    longer = [s for s in samples if s > elapsed]
    if longer and sum(longer) / len(longer) - elapsed >= MIN_REMAINING_S:
        assert r == pytest.approx(sum(longer) / len(longer) - elapsed, rel=1e-9, abs=1e-6)


def drive(state: SchedulerState, duration: float, until: float = 1e7) -> dict[str, float]:
    """The core run for real (no arrivals): each job runs ``duration`` seconds of work at speed 1,
    Ticks where it asks for them.  Returns each job's first start from here on."""
    starts: dict[str, float] = {}
    heap: list = []
    ver: dict[str, int] = {}
    n = 0

    def end_at(jid: str, t: float) -> None:
        nonlocal n
        rec = state.records[jid]
        ver[jid] = ver.get(jid, 0) + 1
        # its end as the replay computes it (t plus what is left), to the last bit: an end that meets a Tick
        # in one and misses it by a rounding in the other would be decided in another order
        heapq.heappush(heap, (t + (duration - elapsed_of(rec, t)), n, jid, ver[jid]))
        n += 1

    for jid, rec in state.running.items():
        end_at(jid, state.now)
    if state.passes.wakeup_at is not None:
        heapq.heappush(heap, (state.passes.wakeup_at, -1, "", 0))
    while heap and heap[0][0] < until and state.waiting:
        t = heap[0][0]
        evs = []
        while heap and heap[0][0] == t:
            _, _, jid, v = heapq.heappop(heap)
            if not jid:
                evs.append(Tick(f"t{t}", t))
            elif ver.get(jid) == v and jid in state.running:
                ver[jid] += 1
                evs.append(JobFinished(f"f{jid}", t, jid))
        if not evs:
            continue
        for d in state.handle_batch(evs)[0]:
            if isinstance(d, Place):
                starts.setdefault(d.job, t)
                end_at(d.job, t)
            elif isinstance(d, Preempt):
                ver[d.job] = ver.get(d.job, 0) + 1
            elif isinstance(d, Wakeup):
                n += 1
                heapq.heappush(heap, (d.at, n, "", 0))
    return starts


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sizes=st.lists(st.sampled_from([1, 1, 2, 3, 4, 8]), min_size=2, max_size=12),
       order=st.sampled_from(["fifo", "las", "tiresias", "gittins"]))
def test_with_an_exact_prior_the_forecast_is_what_the_core_then_does(sizes, order):
    duration = 1000.0
    live = core(order)
    live.handle(*[JobArrived(f"a{i}", 0.0, Job(f"j{i}", "ResNet-18", 32, gpus=g)) for i, g in enumerate(sizes)])
    waiting = set(live.waiting)
    before = snapshot.dump(live)
    f = forecast(live, DurationPrior([duration]))
    assert snapshot.dump(live) == before  # the live core did not move
    real = drive(live, duration)
    assert set(f.starts) == waiting and f.complete
    assert {j: pytest.approx(real[j], abs=1e-6) for j in waiting} == f.starts


def test_a_job_that_can_never_start_is_left_out_and_the_forecast_says_it_is_incomplete():
    live = core(nodes=2)
    live.handle(JobArrived("a", 0.0, Job("big", "LM", 20, gpus=8)), JobArrived("b", 0.0, Job("x", "LM", 20, gpus=8)))
    live.handle(NodeLost("lost", 10.0, "n1"))
    f = forecast(live, DurationPrior([600.0]), horizon_s=86400.0)
    assert f.starts == {} and not f.complete and f.until <= 10.0 + 86400.0
    assert live.job("big").job.state is JobState.PREEMPTED  # requeued by the lost node, untouched since


def test_the_prior_decides_when_a_long_running_job_is_expected_to_end():
    live = core(nodes=1)
    live.handle(JobArrived("a", 0.0, Job("r", "LM", 20, gpus=4)))
    live.handle(JobArrived("b", 5000.0, Job("w", "LM", 20, gpus=4)))
    prior = DurationPrior([1000.0, 10_000.0])
    assert forecast(live, prior).starts == {"w": pytest.approx(10_000.0)}  # it outlived the short sample
    assert forecast(live, DurationPrior([100.0])).starts == {"w": pytest.approx(10_000.0)}  # as long again


def test_the_prior_learns_per_job_type_with_the_samples_weighing_what_they_are_told():
    p = DurationPrior([100.0, 10_000.0], prior_weight=2.0, weight=2.0, per_type=True)
    assert p.remaining(0) == pytest.approx(5050)  # nothing learned yet: the samples alone
    p.add(60.0, "ResNet-18@32")
    # Its own table: the samples weigh 2 in all (1 each), the run 2: (100 + 10000 + 2 * 60) / 4.
    assert p.remaining(0, "ResNet-18@32") == pytest.approx((100 + 10_000 + 120) / 4)
    assert p.remaining(0, "LM@20") == pytest.approx((100 + 10_000 + 120) / 4)  # the global table learned too
    fresh = DurationPrior([100.0, 10_000.0], prior_weight=2.0, weight=2.0, per_type=True)
    fresh.add(60.0, "LM@20")
    assert fresh.remaining(0, "ResNet-18@32") == fresh.remaining(0)  # an unseen type reads the global one
    with pytest.raises(ValueError):
        DurationPrior([1.0], prior_weight=0)


def test_a_replay_run_in_slices_gives_the_forecast_run_at_once():
    live = core("tiresias", nodes=2)
    live.handle(*[JobArrived(f"a{i}", 0.0, Job(f"j{i}", "ResNet-18", 32, gpus=g)) for i, g in
                  enumerate([4, 2, 2, 8, 1, 3, 4, 1])])
    prior = DurationPrior([600.0, 3600.0, 7200.0])
    whole = forecast(live, prior)
    sliced = Replay(live, prior)
    steps = 0
    while not sliced.step(1):
        steps += 1
    assert sliced.result() == whole and steps >= 2 and whole.complete
