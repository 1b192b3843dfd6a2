"""The link estimator: bandwidth and RTT of one connection from noisy, biased samples."""

from __future__ import annotations

import random

import pytest

from swarm.link.estimator import LinkEstimator

MBPS = 1e6 / 8  # bytes per second in one Mbit/s
TICK = 0.01  # one TCP_INFO reading every 10 ms


def feed(est: LinkEstimator, rate: float, start: float, seconds: float, rng: random.Random) -> list:
    """TCP_INFO delivery rates around `rate` (+-10 %, the odd ACK-compression spike at 3x, some
    app-limited readings far below); returns (time, estimate) after each reading."""
    trace = []
    for i in range(round(seconds / TICK)):
        now = start + i * TICK
        roll = rng.random()
        if roll < 0.03:
            est.on_tcp_info(0.03, 3 * rate, now)
        elif roll < 0.2:
            est.on_tcp_info(0.03, 0.1 * rate, now, app_limited=True)
        else:
            est.on_tcp_info(0.03, rate * rng.uniform(0.9, 1.1), now)
        trace.append((now, est.bandwidth))
    return trace


def settled_after(trace: list, truth: float, tolerance: float = 0.15) -> float:
    """Seconds from the trace's start until the estimate stays within tolerance of the truth."""
    start = trace[0][0]
    settled = start
    for now, bw in trace:
        if bw is None or abs(bw - truth) > tolerance * truth:
            settled = now + TICK
    return settled - start


def test_no_estimate_before_a_sample():
    est = LinkEstimator()
    assert (est.bandwidth, est.rtt, est.samples) == (None, None, 0)


def test_bandwidth_converges_on_noisy_delivery_rates():
    est = LinkEstimator()
    trace = feed(est, 5 * MBPS, 0.0, 3.0, random.Random(1))
    assert settled_after(trace, 5 * MBPS) < 0.5


def test_bandwidth_follows_a_link_that_speeds_up_then_slows_down():
    est = LinkEstimator()
    rng = random.Random(2)
    feed(est, 5 * MBPS, 0.0, 3.0, rng)
    up = feed(est, 20 * MBPS, 3.0, 3.0, rng)
    down = feed(est, 5 * MBPS, 6.0, 3.0, rng)
    assert settled_after(up, 20 * MBPS) <= 0.3  # once a fifth of the window is new
    assert settled_after(down, 5 * MBPS) <= est.window_s  # once the fast samples have aged out
    assert est.bandwidth == pytest.approx(5 * MBPS, rel=0.15)


def test_a_lone_spike_does_not_set_the_estimate():
    est = LinkEstimator()
    for i in range(10):
        est.on_tcp_info(None, 5 * MBPS, i * TICK)
    est.on_tcp_info(None, 50 * MBPS, 10 * TICK)
    assert est.bandwidth == 5 * MBPS


def test_app_limited_delivery_rates_are_not_bandwidth_samples():
    est = LinkEstimator()
    est.on_tcp_info(0.03, 5 * MBPS, 0.0)
    for i in range(1, 300):  # an idle sender: three seconds of low, app-limited readings
        est.on_tcp_info(0.03, 0.2 * MBPS, i * TICK, app_limited=True)
    assert est.bandwidth == 5 * MBPS
    assert est.bandwidth_samples == 1


def test_the_estimate_holds_when_samples_stop():
    est = LinkEstimator()
    est.on_tcp_info(None, 20 * MBPS, 0.0)
    est.on_ping(0.03, 60.0)
    assert est.bandwidth == 20 * MBPS


def test_after_an_idle_spell_the_first_sample_replaces_the_stale_estimate():
    est = LinkEstimator()
    est.on_tcp_info(None, 20 * MBPS, 0.0)
    est.on_tcp_info(None, 5 * MBPS, 60.0)
    assert est.bandwidth == 5 * MBPS


def test_back_to_back_blocking_writes_measure_the_link():
    est = LinkEstimator()
    est.on_delivery(256_000, 0.0, 0.4, 0.4)  # first write: the link was idle before it
    assert est.on_delivery(256_000, 0.4005, 0.8005, 0.8005)
    assert est.bandwidth == pytest.approx(640_000, rel=0.01)


def test_the_first_write_after_idle_is_not_a_bandwidth_sample():
    # it lands in an empty socket buffer and congestion window at memory speed
    est = LinkEstimator()
    est.on_delivery(256_000, 0.0, 0.4, 0.4)
    assert not est.on_delivery(256_000, 1.0, 1.1, 1.1)
    assert est.bandwidth is None


def test_a_small_write_is_not_a_bandwidth_sample():
    est = LinkEstimator()
    est.on_delivery(256_000, 0.0, 0.4, 0.4)
    assert not est.on_delivery(8_000, 0.4, 0.41, 0.41)


def test_a_write_that_never_blocked_is_not_a_bandwidth_sample():
    est = LinkEstimator()
    est.on_delivery(256_000, 0.0, 0.4, 0.4)
    assert not est.on_delivery(256_000, 0.4, 0.4001, 0.4001)  # 2.5 GB/s: it fit in the buffer
    assert not est.on_delivery(256_000, 0.4001, 0.8001, 0.8001)  # previous one left it idle


def test_rtt_follows_a_latency_change_within_a_dozen_samples():
    est = LinkEstimator()
    for i in range(20):
        est.on_ping(0.030, i * 0.1)
    for i in range(20, 32):
        est.on_tcp_info(0.060, None, i * 0.1)
    assert est.rtt == pytest.approx(0.060, rel=0.05)


def test_min_rtt_remembers_the_propagation_delay_for_its_window():
    est = LinkEstimator(min_rtt_window_s=10.0)
    est.on_ping(0.030, 0.0)
    est.on_ping(0.080, 5.0)  # queueing on top of 30 ms
    assert est.min_rtt == 0.030
    est.on_ping(0.050, 10.5)
    assert est.min_rtt == 0.050


def test_pings_that_queued_behind_unacknowledged_bytes_leave_the_minimum_alone():
    est = LinkEstimator(min_rtt_window_s=10.0)
    est.on_ping(0.200, 0.0, queued=True)
    assert est.min_rtt == 0.200  # no clear ping yet: the best there is
    est.on_ping(0.030, 1.0)
    est.on_ping(0.250, 5.0, queued=True)  # a prompt keeps the link busy for longer than
    est.on_ping(0.180, 15.0, queued=True)  # the window: every ping waits behind it
    assert est.min_rtt == 0.030 and est.rtt > 0.1  # the smoothed RTT sees the queue
    est.on_ping(0.050, 16.0)  # a clear ping again, after the window: it sets the minimum
    assert est.min_rtt == 0.050


def test_the_kernels_minimum_rtt_is_the_minimum_when_tcp_info_gives_one():
    est = LinkEstimator()
    est.on_tcp_info(0.200, None, 0.0, min_rtt_s=0.031)
    assert est.min_rtt == 0.031 and est.rtt == 0.200
    est.on_tcp_info(0.180, None, 1.0)  # an older kernel: its smoothed RTT is all there is
    assert est.min_rtt == 0.031


def test_samples_counts_each_accepted_reading():
    est = LinkEstimator()
    est.on_tcp_info(0.03, 5 * MBPS, 0.0)
    est.on_ping(0.03, 0.1)
    est.on_tcp_info(0.03, 1 * MBPS, 0.2, app_limited=True)
    assert (est.samples, est.rtt_samples, est.bandwidth_samples) == (4, 3, 1)


def test_delivery_acks_measure_the_path_rate_when_the_pipe_stays_busy():
    """Frames of 16 KiB every 10 ms into a 1 MB/s path: acknowledgements pace at the path's rate."""
    est = LinkEstimator()
    rate, size = 1_000_000, 16 * 1024
    sent = []
    for i in range(40):  # the sender fills a buffer ahead of the path: always 4 frames unacked
        sent.append(est.on_frame_sent(size))
        if i >= 3:
            est.on_acked(sent[i - 3], (i - 3 + 1) * size / rate + 0.015)
    assert est.ack_samples > 20
    assert est.bandwidth == pytest.approx(rate, rel=0.02)


def test_a_frame_sent_into_an_empty_pipe_gives_no_bandwidth_sample():
    est = LinkEstimator()
    for i in range(10):  # one frame at a time, each acknowledged before the next: idle between
        frame = est.on_frame_sent(64 * 1024)
        assert not est.on_acked(frame, i * 1.0 + 0.5)
    assert est.bandwidth is None


def test_tcp_info_blind_behind_a_proxy_is_dropped_in_favour_of_pings_and_acks():
    """A relay ends the TCP connection: the kernel sees loopback (50 us, 1 GB/s); pings, 30 ms."""
    est = LinkEstimator()
    est.on_tcp_info(0.00005, 1e9, 0.0)
    assert est.bandwidth == 1e9 and not est.tcp_blind
    est.on_ping(0.030, 0.1)
    assert est.tcp_blind and est.bandwidth is None  # nothing trustworthy is left
    est.on_tcp_info(0.00005, 1e9, 0.2)
    assert est.bandwidth is None and est.rtt == pytest.approx(0.030)
    frames = [est.on_frame_sent(32 * 1024) for _ in range(2)]
    est.on_acked(frames[0], 0.30)
    frames.append(est.on_frame_sent(32 * 1024))  # sent while frame 1 is still in flight
    est.on_acked(frames[1], 0.35)
    est.on_acked(frames[2], 0.40)  # 64 KiB delivered since frame 0's ack: 32 KiB per 50 ms
    assert est.bandwidth == pytest.approx(32 * 1024 / 0.05)


def test_tcp_info_that_agrees_with_pings_is_kept():
    est = LinkEstimator()
    est.on_ping(0.031, 0.0)
    est.on_tcp_info(0.030, 5e5, 0.1)
    assert not est.tcp_blind and est.bandwidth == 5e5


def test_arrival_spreads_measure_the_link_while_idle_acks_read_low():
    """Small chunks with idle gaps: acknowledgements read a quarter of the link, the next hop's
    arrival spreads read the link."""
    est = LinkEstimator()
    rng = random.Random(3)
    for i in range(30):
        now = i * 0.03
        est._add_rate(0.25 * 5 * MBPS * rng.uniform(0.9, 1.1), now, "app")  # app-limited acks
        assert est.on_arrival(9000, 9000 / (5 * MBPS) * rng.uniform(0.95, 1.05), now)
    assert est.arrival_samples == 30
    assert est.bandwidth == pytest.approx(5 * MBPS, rel=0.06)


def test_a_few_arrival_spreads_do_not_yet_outvote_the_other_samples():
    est = LinkEstimator(min_arrivals=3)
    for i in range(10):
        est.on_tcp_info(0.03, 2 * MBPS, i * 0.01)
    est.on_arrival(9000, 9000 / (5 * MBPS), 0.1)
    est.on_arrival(9000, 9000 / (5 * MBPS), 0.11)
    assert est.bandwidth == pytest.approx(2 * MBPS)
    est.on_arrival(9000, 9000 / (5 * MBPS), 0.12)
    assert est.bandwidth == pytest.approx(5 * MBPS)


def test_spreads_too_small_to_time_are_not_samples():
    est = LinkEstimator()
    assert not est.on_arrival(1200, 0.002, 0.0)  # one decode token
    assert not est.on_arrival(64 * 1024, 0.0005, 0.0)  # under a millisecond
    assert est.bandwidth is None and est.arrival_samples == 0
