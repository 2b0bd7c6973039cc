"""The load a rebalance judges (`proxy.fleet.balance.load`, and what each session costs its
worker: `worker.session_load`), its policy (`proxy.fleet.balance.rebalance`) and the
autoscaler's (`proxy.fleet.balance.autoscale`), pure: who is hot, who is stalled, who sheds which
sessions to whom, when the count grows or shrinks, and that nothing flaps (a sustained
streak, a cool-down, a bucket of moves, the bounds, the sessions that carry the load
kept, a moved session left to settle and never sent back)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import pytest

from gym_proxy.coordinator.contract.loop_lag import LoopLag
from gym_proxy.proxy.config import ConfigError, config_from_args
from gym_proxy.proxy.data_path.routing import Router, WorkerRoute
from gym_proxy.proxy.fleet.balance.autoscale import ScaleBounds, ScalePolicy
from gym_proxy.proxy.fleet.balance.load import LoadTracker, WorkerLoad
from gym_proxy.proxy.fleet.balance.rebalance import (
    Cost,
    RebalancePolicy,
    Shed,
    Thresholds,
    carriers,
)
from gym_proxy.worker.session_load import SessionLoad

pytestmark = pytest.mark.fast


@dataclass
class Look:
    owner: str
    slot: int
    in_flight: int = 0
    served: int = 0
    ping_seconds: float | None = 0.001
    loop_lag_seconds: float = 0.0
    silent_for: float = 0.0
    taking: bool = True


def loads(*busy: float, lag: dict[int, float] | None = None) -> dict[str, WorkerLoad]:
    lag = lag or {}
    return {
        f"w{i}": WorkerLoad(f"w{i}", i, busy=b, lag=lag.get(i, 0.0), lag_peak=lag.get(i, 0.0))
        for i, b in enumerate(busy)
    }


def test_busy_is_averaged_and_a_burst_does_not_make_a_hot_worker():
    tracker = LoadTracker(ping_interval=1.0, half_life=3.0)
    tracker.sample([Look("a", 0, in_flight=0)], 0.0)
    tracker.sample([Look("a", 0, in_flight=10)], 0.25)
    assert 0 < tracker.loads["a"].busy < 1  # one quarter second of 10 is not 10
    for i in range(2, 160):  # 40 s of it
        tracker.sample([Look("a", 0, in_flight=10)], i * 0.25)
    assert tracker.loads["a"].busy == pytest.approx(10, abs=0.1)


def test_lag_grows_while_a_ping_waits_and_its_peak_decays():
    tracker = LoadTracker(ping_interval=1.0, half_life=3.0)
    tracker.sample([Look("a", 0, silent_for=0.5)], 0.0)
    assert tracker.loads["a"].lag == pytest.approx(0.001)  # the last round trip
    tracker.sample([Look("a", 0, silent_for=3.5)], 3.0)  # its ping has waited 2.5 s
    assert tracker.loads["a"].lag == pytest.approx(2.5)
    tracker.sample([Look("a", 0, silent_for=0.2)], 6.0)  # it answered
    load = tracker.loads["a"]
    assert load.lag == pytest.approx(0.001) and load.lag_peak == pytest.approx(1.25)


def test_a_worker_gone_is_forgotten():
    tracker = LoadTracker(ping_interval=1.0)
    tracker.sample([Look("a", 0), Look("b", 1)], 0.0)
    tracker.sample([Look("b", 1)], 0.25)
    assert set(tracker.loads) == {"b"}


def test_a_worker_hot_for_the_sustain_sheds_to_the_least_busy():
    policy = RebalancePolicy(Thresholds(sustain=3.0))
    now = loads(8, 1, 0.5)
    assert policy.judge(now, 0.0) == []  # hot, not yet for long enough
    assert policy.judge(now, 2.0) == []
    (shed,) = policy.judge(now, 3.0)
    assert shed.source == "w0" and shed.reason == "hot"
    assert shed.targets == ("w2", "w1")  # least busy first
    assert shed.share == pytest.approx((8 - 0.5) / 8)  # its excess over the others' median


def test_a_break_in_the_streak_starts_it_again():
    policy = RebalancePolicy(Thresholds(sustain=3.0))
    policy.judge(loads(8, 1), 0.0)
    policy.judge(loads(1, 1), 2.0)  # cooled for a moment
    assert policy.judge(loads(8, 1), 4.0) == []
    assert policy.judge(loads(8, 1), 7.0) != []


@pytest.mark.parametrize(
    "busy",
    [
        (3, 2, 2),  # under the ratio
        (1.5, 0, 0),  # under min_busy, whatever the others
        (4, 4, 4),  # an even load: nobody sheds, ever
    ],
)
def test_no_shed_without_a_margin(busy):
    policy = RebalancePolicy(Thresholds(sustain=0.0))
    assert all(policy.judge(loads(*busy), t) == [] for t in range(20))


def test_after_a_shed_the_targets_rest_for_the_cooldown_and_the_source_for_the_sustain():
    policy = RebalancePolicy(Thresholds(sustain=3.0, cooldown=10.0))
    policy.judge(loads(8, 1, 1), 0.0)
    (shed,) = policy.judge(loads(8, 1, 1), 3.0)
    policy.shed(shed, ["w1"], 3.0)
    assert policy.judge(loads(8, 1, 1), 5.0) == []  # the source rests
    (again,) = policy.judge(loads(8, 1, 1), 9.0)  # still hot: it sheds more, to w2 only
    assert again.source == "w0" and again.targets == ("w2",)
    # w1 took sessions and got hot: it rests, so nothing bounces back.
    assert [s.source for s in policy.judge(loads(1, 8, 1), 10.0)] == []
    assert [s.source for s in policy.judge(loads(1, 8, 1), 13.0)] == ["w1"]


def test_a_stalled_worker_sheds_every_idle_session_and_stays_stalled_between_stalls():
    policy = RebalancePolicy(Thresholds(stall=1.0, sustain=3.0))
    (shed,) = policy.judge(loads(0, 0, lag={0: 1.5}), 0.0)
    assert shed.reason == "stalled" and shed.share == 1.0 and set(shed.targets) == {"w1"}
    assert policy.stalled == {"w0"}
    policy.shed(shed, ["w1"], 0.0)
    assert policy.judge(loads(0, 0, lag={0: 0.7}), 1.0) == []  # resting; still stalled
    assert policy.stalled == {"w0"}  # 0.7 is not under half the threshold
    (again,) = policy.judge(loads(0, 0, lag={0: 0.7}), 3.0)  # sheds what turned idle
    assert again.reason == "stalled"
    policy.judge(loads(0, 0, lag={0: 0.4}), 4.0)
    assert policy.stalled == set()


def test_no_target_no_shed_and_never_to_a_stalled_or_draining_worker():
    policy = RebalancePolicy(Thresholds(stall=1.0, sustain=0.0))
    assert policy.judge(loads(0, 0, lag={0: 2.0, 1: 2.0}), 0.0) == []  # all stalled
    both = loads(8, 1, 0)
    both["w2"].taking = False  # draining, or not answering
    (shed,) = policy.judge(both, 1.0)
    assert shed.targets == ("w1",)


def test_the_bucket_caps_moves_per_second():
    policy = RebalancePolicy(Thresholds(max_moves=4.0))
    assert policy.budget(0.0) == 4
    policy.spend(4)
    assert policy.budget(0.5) == 2
    policy.spend(2)
    assert policy.budget(10.0) == 4  # never more than one second's worth


def test_new_sessions_skip_a_stalled_worker_unless_all_are():
    router = Router()
    stalled, calm = WorkerRoute("a", 0, "/a"), WorkerRoute("b", 1, "/b", in_flight=5)
    router.add_worker(stalled)
    router.add_worker(calm)
    stalled.stalled = True
    assert {router.least_loaded().owner for _ in range(4)} == {"b"}
    calm.stalled = True
    assert router.least_loaded().owner == "a"  # fewest in flight, stalled as they all are


def scale(**kw: float) -> ScalePolicy:
    bounds = {"least": 1, "most": 3, "up_after": 10.0, "down_after": 60.0, "cooldown": 5.0}
    return ScalePolicy(ScaleBounds(**{**bounds, **kw}))  # type: ignore[arg-type]


def test_grow_only_when_every_worker_stays_busy_and_never_past_max():
    policy = scale()
    assert policy.judge(loads(5, 5), set(), 2, 0.0) == (0, "")
    assert policy.judge(loads(5, 1), set(), 2, 5.0) == (0, "")  # one is not busy: a break
    assert policy.judge(loads(5, 5), set(), 2, 6.0) == (0, "")
    step, why = policy.judge(loads(5, 5), set(), 2, 16.0)
    assert step == 1 and "every worker busy" in why
    policy.scaled(16.0)
    assert all(policy.judge(loads(9, 9, 9), set(), 3, t)[0] == 0 for t in range(17, 200, 5))


def test_a_stalled_worker_counts_as_busy():
    policy = scale(up_after=0.0)
    assert policy.judge(loads(5, 0), {"w1"}, 2, 0.0)[0] == 1


def test_shrink_only_after_a_long_idle_and_never_under_min():
    policy = scale()
    assert policy.judge(loads(0.1, 0.1), set(), 2, 0.0) == (0, "")
    assert policy.judge(loads(0.1, 0.1), set(), 2, 59.0) == (0, "")
    assert policy.judge(loads(0.1, 0.1), set(), 2, 60.0)[0] == -1
    policy.scaled(60.0)
    assert all(policy.judge(loads(0), set(), 1, t)[0] == 0 for t in range(61, 300, 5))


def test_after_a_resize_the_streak_starts_again_after_the_cooldown():
    policy = scale(up_after=0.0)
    assert policy.judge(loads(5, 5), set(), 2, 0.0)[0] == 1
    policy.scaled(0.0)
    assert policy.judge(loads(5, 5, 5), set(), 3 - 1, 4.0) == (0, "")  # resting
    assert policy.judge(loads(5, 5, 5), set(), 2, 6.0)[0] == 1


def test_a_count_outside_the_bounds_comes_back_inside():
    assert scale().judge(loads(0), set(), 5, 0.0)[0] == -1  # an operator's resize past max
    assert scale(least=2).judge(loads(0), set(), 1, 0.0)[0] == 1


@pytest.mark.parametrize(
    "args, error",
    [
        (["--workers", "4", "--max-workers", "3"], "--workers 4 must lie within"),
        (["--workers", "1", "--min-workers", "2", "--max-workers", "3"], "must lie within"),
        (["--rebalance-ratio", "1"], "--rebalance-ratio must be over 1"),
        (["--max-workers", "2", "--scale-down-busy", "5"], "--scale-down-busy must be under"),
    ],
)
def test_bad_bounds_are_one_line_errors(args, error):
    with pytest.raises(ConfigError, match=error):
        config_from_args(args)


@pytest.mark.parametrize(
    "args, error",
    [
        (["--min-workers", "2"], "--min-workers needs --max-workers"),
        (["--scale-up-busy", "8"], "--scale-up-busy needs --max-workers"),
        (["--scale-down-after", "5"], "--scale-down-after needs --max-workers"),
        (["--rebalance-ratio", "3"], "--rebalance-ratio needs --rebalance"),
        (["--stall-threshold", "2"], "--stall-threshold needs --rebalance"),
        (["--rebalance-max-moves", "5"], "--rebalance-max-moves needs --rebalance"),
        (["--worker-cpus", "2"], "--worker-cpus needs --worker-placement ray"),
        (["--min-workers", "3", "--max-workers", "2"], "--min-workers 3 is over --max-workers 2"),
    ],
)
def test_a_flag_that_acts_only_with_another_is_refused_without_it(args, error):
    """Accepted without it, it would do nothing (issue 56: `--min-workers 2` alone ran one
    worker and said nothing); the line names the flag it needs."""
    with pytest.raises(ConfigError, match=f"^{error}$"):
        config_from_args(args)


def test_autoscaling_without_workers_starts_at_the_minimum():
    config = config_from_args(["--min-workers", "3", "--max-workers", "6"])
    assert (config.workers, config.min_workers, config.max_workers) == (3, 3, 6)
    given = config_from_args(["--workers", "4", "--min-workers", "3", "--max-workers", "6"])
    assert given.workers == 4


def test_a_loop_blocked_in_stretches_is_hot_by_its_delay_not_under_an_even_delay():
    policy = RebalancePolicy(Thresholds(sustain=0.0))
    (shed,) = policy.judge(loads(1, 0.2, 0.2, lag={0: 0.09, 1: 0.004, 2: 0.005}), 0.0)
    assert shed.source == "w0" and shed.reason == "hot" and "delay 90 ms" in shed.why
    assert set(shed.targets) == {"w1", "w2"} and shed.share > 0.9
    even = RebalancePolicy(Thresholds(sustain=0.0))  # the whole machine slow: all late
    assert even.judge(loads(1, 1, 1, lag={0: 0.2, 1: 0.15, 2: 0.18}), 0.0) == []


def test_a_hot_worker_never_sheds_to_another_hot_one():
    policy = RebalancePolicy(Thresholds(sustain=0.0))
    sheds = policy.judge(loads(3, 1.2, 0.2, 0.2, lag={1: 0.09, 2: 0.004, 3: 0.004}), 0.0)
    assert {s.source for s in sheds} == {"w0", "w1"}  # by requests, and by delay
    assert all(set(s.targets) <= {"w2", "w3"} for s in sheds), sheds


def test_a_ratio_of_zero_turns_the_hot_rule_off_and_leaves_the_stall_rule():
    assert config_from_args(["--rebalance", "--rebalance-ratio", "0"]).rebalance_ratio == 0
    policy = RebalancePolicy(Thresholds(ratio=0.0, sustain=0.0))
    assert policy.judge(loads(8, 0, 0, lag={0: 0.09}), 0.0) == []  # hot by both measures
    (shed,) = policy.judge(loads(1, 0, 0, lag={0: 2.0}), 1.0)
    assert shed.source == "w0" and shed.reason == "stalled"


def test_the_answer_time_is_in_flight_over_arrivals():
    tracker = LoadTracker(ping_interval=1.0, half_life=3.0)
    tracker.sample([Look("a", 0, in_flight=2, served=0)], 0.0)
    assert tracker.loads["a"].answer_seconds is None  # nothing has come yet
    for i in range(1, 160):  # 40 s of 2 in flight, 10 requests a second: 0.2 s each
        tracker.sample([Look("a", 0, in_flight=2, served=i * 10 // 4)], i * 0.25)
    assert tracker.loads["a"].answer_seconds == pytest.approx(0.2, rel=0.05)
    for i in range(160, 320):  # none come: no answer time to tell
        tracker.sample([Look("a", 0, in_flight=0, served=397)], i * 0.25)
    assert tracker.loads["a"].answer_seconds is None


def test_a_stall_the_worker_measured_counts_when_its_pings_were_answered_in_time():
    """Blocks as long as the ping interval, back to back: each ping lands between two
    and is answered at once; the worker's own measure, in its pong, tells the stall."""
    tracker = LoadTracker(ping_interval=1.0, half_life=3.0)
    tracker.sample([Look("a", 0, ping_seconds=0.002, loop_lag_seconds=0.95)], 0.0)
    assert tracker.loads["a"].lag == pytest.approx(0.95)


async def test_each_reader_of_a_loop_lag_sees_every_stall():
    lag = LoopLag(("scrape", "ping"))
    lag.start()
    await asyncio.sleep(0.05)  # the sampler waits for its next sample, due in 0.1 s
    time.sleep(0.7)  # noqa: ASYNC251 -- a stall of the loop is what is measured
    await asyncio.sleep(0.05)  # it wakes, 0.65 s late
    lag.stop()
    assert lag.take_worst("ping") >= 0.5
    assert lag.take_worst("scrape") >= 0.5  # not taken by the other reader
    lag.last = 0.0
    assert lag.take_worst("ping") == 0.0  # taken: none since


def test_a_shed_never_goes_to_a_worker_hot_by_the_other_measure():
    """Two hot workers (NeMo Gym#3039's heavy calls on two of four): w1 is hot by its
    requests, w0 blocks its loop 70 ms at a time; w0 takes none of w1's sessions, where
    they would wait behind its blocks, and the others' median, not their mean, tells w0
    is hot (the mean of the others counts w1's delay)."""
    policy = RebalancePolicy(Thresholds(sustain=0.0))
    now = loads(0.5, 3, 0.2, 0.2, lag={0: 0.07, 1: 0.09, 2: 0.02, 3: 0.02})
    sheds = {s.source: s for s in policy.judge(now, 0.0)}
    assert set(sheds) == {"w0", "w1"}
    assert all(set(s.targets) == {"w2", "w3"} for s in sheds.values()), sheds


def test_a_stalled_worker_never_sheds_to_a_hot_one():
    policy = RebalancePolicy(Thresholds(stall=1.0, sustain=10.0))
    (shed,) = policy.judge(loads(0, 5, 0.2, lag={0: 1.5}), 0.0)
    assert shed.reason == "stalled" and shed.targets == ("w2",)


def shed_of(*targets: str, share: float = 1.0) -> Shed:
    return Shed("w0", 0, targets, share, "hot", "test")


def test_a_session_that_carries_the_load_is_kept_however_idle():
    """One session blocks the loop a third of the time; the others wait behind it, and
    were still unread in the socket when the loop was late: it carries the loop's delay,
    and moved it would take it along. With the load spread evenly none carries it."""
    costs = {"culprit": Cost(delay=1.2, busy=1.3), "a": Cost(0.0, 0.002), "b": Cost(0.0, 0.003)}
    assert set(carriers(costs)) == {"culprit"}
    policy = RebalancePolicy()
    plan, kept = policy.plan(shed_of("w1", "w2"), ["culprit", "a", "b"], costs, 10, 0.0)
    assert plan == {"w1": ["a"], "w2": ["b"]} and set(kept) == {"culprit"}
    assert "carries 100% of the loop's delay" in kept["culprit"]
    even = {str(i): Cost(0.1, 0.2) for i in range(6)}
    assert carriers(even) == {}
    heavy = {"h": Cost(0.0, 3.0), **{str(i): Cost(0.0, 0.1) for i in range(8)}}
    assert set(carriers(heavy)) == {"h"}  # the requests' time: 3 s against 0.8 s


def test_a_moved_session_settles_and_never_goes_back_to_a_worker_that_shed_it():
    policy = RebalancePolicy(Thresholds(settle=30.0))
    costs: dict[str, Cost] = {}
    policy.moved("w0", {"s": "w1"}, 0.0)
    shed = Shed("w1", 1, ("w0", "w2"), 1.0, "hot", "test")
    assert policy.plan(shed, ["s"], costs, 10, 29.0)[0] == {}  # settling
    assert policy.plan(shed, ["s"], costs, 10, 31.0)[0] == {"w2": ["s"]}  # never to w0
    back = Shed("w1", 1, ("w0",), 1.0, "hot", "test")
    assert policy.plan(back, ["s"], costs, 10, 31.0)[0] == {}


def test_the_least_costly_idle_sessions_go_first_within_the_share_and_the_budget():
    policy = RebalancePolicy()
    costs = {"a": Cost(0.0, 0.3), "b": Cost(0.0, 0.1), "c": Cost(0.0, 0.2), "d": Cost()}
    plan, _ = policy.plan(shed_of("w1", share=0.5), ["a", "b", "c", "d"], costs, 10, 0.0)
    assert plan == {"w1": ["d", "b"]}
    plan, _ = policy.plan(shed_of("w1"), ["a", "b", "c", "d"], costs, 3, 0.0)
    assert plan == {"w1": ["d", "b", "c"]}


@dataclass
class Flight:
    session_id: str | None
    admitted_at: float
    key: str | None = None


def test_the_loops_delay_is_charged_to_the_requests_it_held_when_it_was_due():
    """The sampler due at 10.0 woke at 10.3: the request admitted before (and gone at
    10.3, in the same loop turn) blocked it; the one admitted at 10.31, read once the
    loop was free, waited behind it and is charged nothing of the delay."""
    load = SessionLoad()
    culprit, victim = Flight("culprit", 9.95), Flight("victim", 10.31)
    load.ended(culprit, 10.3)
    load.sampled(10.0, 10.3, [victim])
    load.ended(victim, 10.312)
    delay, busy = load.recent(10.312, [])
    assert delay == {"culprit": pytest.approx(0.3, abs=1e-3)}
    assert busy == {"culprit": pytest.approx(0.35, abs=1e-3), "victim": pytest.approx(0.002)}
    running = Flight("long", 10.0)  # counted up to now while it runs
    assert load.recent(11.0, [running])[1]["long"] == pytest.approx(1.0)
    later = load.recent(10.312 + 3.0, [])[0]  # halved over the half-life
    assert later["culprit"] == pytest.approx(0.15, abs=1e-3)
