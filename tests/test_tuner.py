"""How speculative decoding sizes its rounds from what they cost (swarm/client/tuner.py): a
round's cost fitted so that noise cannot pin rounds short, and a route's Tuner carried from one
reply to the next."""

from __future__ import annotations

import random

from swarm.client.tuner import Tuner, TunerPool


def measured(acceptance: float = 0.77) -> Tuner:
    tuner = Tuner(acceptance)
    tuner.timed(1, 0.109)  # a plain step through 3 hops at 40 ms
    for _ in range(10):
        tuner.observe(10, round(10 * acceptance))
    return tuner


def test_a_cost_two_noisy_rounds_suggest_fades_while_rounds_of_one_size_follow():
    tuner = measured()
    tuner.timed(7, 0.136)  # 26 ms more than the next, a round trip's jitter at 40 ms a hop
    tuner.timed(3, 0.110)
    noisy = tuner.plan(20)[0]
    assert tuner.fitted and noisy <= 2  # taken at its word: 5-6.5 ms a token
    for _ in range(20):
        tuner.timed(2, 0.103)  # what rounds of that size then cost
    assert tuner.per_token < 0.3 * (0.136 - 0.110) / 4
    assert tuner.plan(20)[0] > noisy  # longer rounds are tried again, and timed


def test_many_rounds_of_several_sizes_find_what_a_token_costs():
    tuner, rng = measured(), random.Random(5)
    for _ in range(200):
        n = rng.randint(2, 8)
        tuner.timed(n, 0.100 + 0.004 * n + rng.gauss(0, 0.002))
    assert 0.003 < tuner.per_token < 0.0045
    assert 0.095 < tuner.latency < 0.115


def test_a_costly_token_keeps_rounds_short():
    cheap, costly = measured(0.85), measured(0.85)
    for n in (2, 5, 8) * 30:
        cheap.timed(n, 0.1 + 0.0005 * n)
        costly.timed(n, 0.1 + 0.03 * n)
    assert costly.plan(20)[0] < cheap.plan(20)[0]


def test_the_next_reply_on_a_route_starts_from_what_the_last_measured():
    pool = TunerPool()
    first = pool.take("route")
    assert not first.fitted  # nothing measured on this route yet
    for n in (2, 6) * 5:
        first.timed(n, 0.1 + 0.002 * n)
    first.observe(5, 4)
    first.off_since = 12
    first.produced(True, 10, 0.5)
    pool.give("route", first)
    second = pool.take("route")
    assert second.fitted and second.per_token == first.per_token
    assert second.acceptance() == first.acceptance()
    assert second.off_since == -1 and second.rounds_pay()  # this reply's text: not judged yet
    assert pool.take("route") is not second  # replies at once each get their own
    assert not pool.take("another route").fitted


def test_the_pool_forgets_the_routes_least_recently_used():
    pool = TunerPool()
    for i in range(TunerPool.MOST + 1):
        tuner = Tuner()
        tuner.timed(1, 0.01 * (i + 1))
        pool.give(i, tuner)
    assert pool.take(0).step_s is None
    assert pool.take(TunerPool.MOST).step_s is not None


def loopback(acceptance: float = 0.7) -> Tuner:
    """A route whose rounds cost compute, not wire: 21 ms a plain step, 2.8 ms a token more."""
    tuner = Tuner(acceptance)
    tuner.stages = 3
    tuner.timed(1, 0.021)
    for n in (2, 4, 3, 6) * 5:
        tuner.timed(n, 0.021 + 0.0028 * (n - 1))
    for _ in range(10):
        tuner.observe(10, round(10 * acceptance))
    return tuner


def test_rounds_answered_a_whole_round_behind_the_one_ahead_are_not_sent_ahead():
    tuner = loopback()
    assert tuner.plan(20)[1] > 1  # unmeasured: the hops are taken to work at once
    for _ in range(3):
        tuner.spaced(2, 0.020, queued=True)  # on shared cores each waited a whole round
    assert tuner.plan(20)[1] == 1
    assert tuner.plan(20)[0] >= 2  # one round at a time, carrying more drafts


def test_rounds_answered_close_behind_the_one_ahead_are_sent_ahead():
    tuner = measured(0.9)
    tuner.stages = 3
    for n in (4, 8, 12) * 5:
        tuner.timed(n, 0.109 + 0.003 * (n - 1))
    for _ in range(3):
        tuner.spaced(4, 0.004, queued=True)  # the hops at once: a few ms apart
    assert tuner.plan(20)[1] > 1


def test_a_round_that_may_have_come_on_its_own_time_only_bounds_what_one_behind_adds():
    tuner = loopback()
    tuner.spaced(3, 0.006, queued=True)
    tuner.spaced(3, 0.116, queued=False)  # its own round trip explains it: no measure of cost
    assert tuner.behind(3) < 0.010
    tuner.spaced(3, 0.002, queued=False)  # but it came sooner than was thought possible
    assert tuner.behind(3) < 0.003


def test_a_probe_whose_drafts_are_all_rejected_turns_rounds_off_again_at_once():
    tuner = loopback(acceptance=0.0)
    assert tuner.plan(10) == (0, 1)  # drafts never right: plain steps
    assert tuner.plan(10 + Tuner.PROBE_EVERY) == (2, 1)  # tried again: texts change
    assert tuner.plan(10 + Tuner.PROBE_EVERY) == (0, 1)  # nothing beside the probe
    tuner.observe(1, 0)  # its first draft was wrong
    assert [tuner.plan(11 + Tuner.PROBE_EVERY + i) for i in range(5)] == [(0, 1)] * 5
    assert tuner.acceptance() < 0.05  # as measured before the probe, not the probe's hope


def test_a_probe_with_a_draft_accepted_lets_rounds_go_on():
    tuner = loopback(acceptance=0.0)
    tuner.plan(10)
    tuner.plan(10 + Tuner.PROBE_EVERY)
    tuner.observe(2, 2)  # both drafts right: the text changed
    assert tuner.plan(13 + Tuner.PROBE_EVERY)[0] > 0


def failed_probe(tuner: Tuner, produced: int) -> int:
    """Off from `produced`, the next probe sent and all its drafts rejected: the token count
    when its answer came (off again from there)."""
    at = next(n for n in range(produced, produced + 1000) if tuner.plan(n) == (2, 1))
    tuner.observe(1, 0)
    tuner.plan(at + 1)
    return at + 1


def test_each_failed_probe_doubles_the_tokens_to_the_next_up_to_a_limit():
    tuner = loopback(acceptance=0.0)
    tuner.plan(10)
    off = [10]
    for _ in range(4):
        off.append(failed_probe(tuner, off[-1]))
    waits = [b - a - 1 for a, b in zip(off, off[1:])]  # tokens off before each probe
    assert waits == [32, 64, 128, 128]


def test_a_probe_with_a_draft_accepted_brings_the_next_probe_back_to_32_tokens():
    tuner = loopback(acceptance=0.0)
    tuner.plan(10)
    at = failed_probe(tuner, failed_probe(tuner, 10))
    assert tuner.probe_every == 4 * Tuner.PROBE_EVERY
    at = next(n for n in range(at, at + 1000) if tuner.plan(n) == (2, 1))
    tuner.observe(2, 1)
    assert tuner.probe_every == Tuner.PROBE_EVERY


def test_a_drafter_that_costs_what_a_round_saves_is_not_used():
    free, costly = loopback(0.4), loopback(0.4)
    for _ in range(10):
        free.drafted(3, 0.00015)  # prompt lookup: a search
        costly.drafted(3, 0.012)  # a draft model a quarter of the served one's size
    assert free.plan(20)[0] > 0
    assert costly.plan(20) == (0, 1)


def long_trip(acceptance: float) -> Tuner:
    """Measured through 3 hops at 40 ms: a round trip ~100 ms, 1.5 ms a token, rounds sent
    behind another answered 3 ms after it."""
    tuner = measured(acceptance)
    tuner.stages = 3
    for n in (2, 4, 6) * 10:
        tuner.timed(n, 0.100 + 0.0015 * (n - 1))
    for _ in range(5):
        tuner.spaced(4, 0.003, queued=True)
    return tuner


def test_over_a_long_round_trip_rounds_seldom_read_still_go_in_flight():
    # a run longer than the rounds in flight costs a whole round trip more; a round behind
    # them costs 3 ms where it is read, and its stale work is done before the next round comes
    k, m = long_trip(0.7).plan(20)
    assert m * (k + 1) >= 12


def test_stale_rounds_cost_where_the_round_trip_is_short_enough_to_meet_them():
    tuner = loopback()
    tuner.stages = 3
    assert tuner._stale(1, 0.003) == 0.0
    assert tuner._stale(4, 0.020) > 0.05


def test_until_a_tokens_cost_is_measured_rounds_are_of_two_sizes_and_not_the_longest():
    tuner = Tuner(0.7)
    assert tuner.plan(0) == (2, 1)  # nothing timed: not even the round trip
    tuner.timed(1, 0.100)
    sizes = {tuner.plan(i)[0] for i in range(1, 5)}
    assert len(sizes) == 2 and max(sizes) < 15  # 16 rows of an 8B model: 50 ms a link


def test_rounds_of_two_sizes_timed_fit_the_cost_a_token():
    tuner = Tuner(0.7)
    tuner.timed(1, 0.100)
    for i in range(6):
        k = tuner.plan(i)[0]
        tuner.timed(k + 1, 0.100 + 0.010 * k)
    assert tuner.fitted and 0.005 < tuner.per_token < 0.011
