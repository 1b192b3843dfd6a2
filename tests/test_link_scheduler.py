"""The outbound link scheduler: MoLink's Algorithm 1, just-in-time chunks, and the simulator."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from devtools.sim import DecodeStream, PrefillArrival, SimLink, simulate
from swarm.link.options import LinkOptions
from swarm.link.scheduler import LinkScheduler, Send, Volume
from swarm.link.stats import LinkStats

DEST = "127.0.0.1:7001"
BW = 1_000_000.0  # bytes/s: 1000 tokens/s at 1000 bytes per token
TD = 0.05  # this node's decode step time


def prefill(session: str = "p", tokens: int = 1000, bytes_per_token: int = 1000) -> Volume:
    return Volume(session, DEST, "prefill", tokens, bytes_per_token)


def decode(session: str = "d", bytes_per_token: int = 1000) -> Volume:
    return Volume(session, DEST, "decode", 1, bytes_per_token)


def bare(*args, **kwargs) -> LinkOptions:
    """The algorithm alone, unless a test asks for more: no in-flight cap and no pacing (the
    defaults, a node's, add both)."""
    alone = {"inflight_gain": 0.0, "pace_lead_s": None, "pace_slow_s": 0.0}
    return LinkOptions(*args, **{**alone, **kwargs})


def scheduler(**kwargs) -> LinkScheduler:
    """A molink scheduler that knows its link (1 MB/s, 30 ms RTT) and T_d = 50 ms."""
    sched = LinkScheduler(bare("molink", **kwargs))
    sched.update_link(DEST, rtt=0.03, bandwidth=BW, now=0.0)
    sched.observe_compute("decode", 1, TD)
    return sched


def send_now(sched: LinkScheduler, now: float, duration: float = 0.0) -> Send:
    send = sched.next_send(now)
    assert send is not None
    sched.sent(send, now, now + duration)
    return send


# --- volumes --------------------------------------------------------------------------------


def test_a_volume_must_name_a_known_phase():
    with pytest.raises(ValueError, match="phase"):
        Volume("s", DEST, "warmup", 1, 1)


def test_a_volume_must_carry_at_least_one_token():
    with pytest.raises(ValueError, match="tokens"):
        Volume("s", DEST, "prefill", 0, 1)


def test_an_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="policy"):
        LinkScheduler(LinkOptions("lifo"))


def test_max_wait_below_one_is_refused():
    # with N = 0 a lone decode volume could never be sent (W < N never holds)
    with pytest.raises(ValueError, match="max_wait"):
        LinkScheduler(LinkOptions(max_wait=0))


# --- Algorithm 1 on hand-made timelines ------------------------------------------------------


def test_an_empty_scheduler_has_nothing_to_send():
    assert LinkScheduler().next_send(0.0) is None


def test_decode_goes_whole_before_a_prefill_queued_earlier():
    sched = scheduler()
    sched.enqueue(prefill(), 0.0)
    vid = sched.enqueue(decode(), 0.0)
    send = send_now(sched, 0.0)
    assert (send.vid, send.phase, send.offset, send.tokens, send.last) == (
        vid,
        "decode",
        0,
        1,
        True,
    )


def test_prefill_goes_whole_once_max_wait_decode_sends_have_passed_it():
    sched = scheduler(max_wait=3)
    p = sched.enqueue(prefill(tokens=500), 0.0)
    for i in range(5):
        sched.enqueue(decode(f"d{i}"), 0.0)
    sends = [send_now(sched, 0.0) for _ in range(3)]
    assert [s.phase for s in sends] == ["decode", "decode", "prefill"]  # W = N = 3 at the third
    assert (sends[2].vid, sends[2].tokens, sends[2].last) == (p, 500, True)
    assert sched.stats()["w_resets"] == 1
    assert sched.waiting_weight == 0


def test_prefill_goes_whole_when_no_decode_session_is_active():
    sched = scheduler()
    sched.enqueue(prefill(tokens=700), 0.0)
    send = send_now(sched, 0.0)
    assert (send.tokens, send.nbytes, send.last) == (700, 700_000, True)
    assert sched.stats()["prefill_whole_idle"] == 1


def test_a_decode_session_silent_past_its_idle_time_no_longer_holds_prefill_back():
    sched = scheduler(session_idle_s=2.0)
    sched.observe_decode_arrival("d", 0.0)
    sched.enqueue(decode(), 0.05)
    send_now(sched, 0.05)
    sched.enqueue(prefill(tokens=700), 3.0)
    assert send_now(sched, 3.0).tokens == 700


def test_decode_never_overtakes_its_own_sessions_prefill():
    sched = scheduler()
    p = sched.enqueue(prefill("s", tokens=300), 0.0)
    sched.observe_decode_arrival("other", 0.0)  # an active session, so the prefill is chunked
    first = send_now(sched, 0.0)
    assert first.vid == p and not first.last
    d = sched.enqueue(decode("s"), 0.01)
    sends = [first]
    while sched.queued:
        sends.append(send_now(sched, 0.01))
    vids = [s.vid for s in sends]
    assert vids.index(d) > max(i for i, v in enumerate(vids) if v == p)


def test_end_session_drops_its_queued_volumes():
    sched = scheduler()
    sched.enqueue(prefill("a"), 0.0)
    sched.enqueue(decode("a"), 0.0)
    kept = sched.enqueue(prefill("b"), 0.0)
    assert sched.end_session("a") == 2
    assert send_now(sched, 0.0).vid == kept


def test_shortest_order_sends_the_prompt_with_fewest_tokens_left_first():
    # a's 1000-token prompt came first, as two volumes; b's 300 tokens, then c's 300, later
    volumes = [
        Volume("a", DEST, "prefill", 500, 1000, 1000),
        Volume("a", DEST, "prefill", 500, 1000, 500),
        Volume("b", DEST, "prefill", 300, 1000),
        Volume("c", DEST, "prefill", 300, 1000),
    ]
    order = {}
    for name in ("arrival", "shortest"):
        sched = scheduler(prefill_order=name)
        vids = [sched.enqueue(v, 0.0) for v in volumes]
        sends = [send_now(sched, 0.0) for _ in volumes]
        order[name] = [vids.index(s.vid) for s in sends]
    assert order["arrival"] == [0, 1, 2, 3]
    assert order["shortest"] == [2, 3, 0, 1]  # b before c, as they tie; a's volumes in order


def test_shortest_order_counts_what_is_left_of_a_prompt_partly_sent():
    sched = scheduler(prefill_order="shortest")
    sched.observe_decode_arrival("d", 0.0)  # a decode session: prompts go in 40-token chunks
    a = sched.enqueue(Volume("a", DEST, "prefill", 100, 1000), 0.0)
    for _ in range(2):
        send_now(sched, 0.0)  # a has 20 tokens left
    sched.enqueue(Volume("b", DEST, "prefill", 30, 1000), 0.0)
    assert send_now(sched, 0.0).vid == a


def test_a_long_prompt_that_has_waited_longer_than_a_newcomer_needs_goes_first():
    # a's 1000 tokens need 1.0 s of link, b's 400 need 0.4 s; a has waited since t = 0
    def first(b_at: float) -> str:
        sched = scheduler(prefill_order="shortest")
        sched.enqueue(Volume("a", DEST, "prefill", 1000, 1000), 0.0)
        sched.enqueue(Volume("b", DEST, "prefill", 400, 1000), b_at)
        return send_now(sched, b_at).session

    assert first(0.2) == "b"  # a: 1.0 - 0.2 = 0.8 s to go, b: 0.4 s
    assert first(0.7) == "a"  # a: 1.0 - 0.7 = 0.3 s


def test_a_volume_cannot_leave_less_of_its_phase_than_it_carries():
    with pytest.raises(ValueError, match="phase_left"):
        Volume("s", DEST, "prefill", 10, 1, 5)
    with pytest.raises(ValueError, match="prefill order"):
        LinkScheduler(LinkOptions(prefill_order="random"))


# --- just-in-time chunk size: MoLink's three cases --------------------------------------------
# margin 0.8, 1 MB/s, 1000 bytes/token: a chunk is 800 tokens per second of T_a.


def test_case_1_decode_starts_with_the_chunk_so_t_a_is_t_d():
    sched = scheduler()
    sched.observe_decode_arrival("d", 10.0)
    sched.enqueue(prefill(), 10.0)
    window = sched.available_time(10.0)
    assert window is not None and window.case == 1
    assert window.t_a == pytest.approx(TD)
    assert send_now(sched, 10.0).tokens == 40  # 0.8 * 1e6 B/s * 0.05 s / 1000 B


def test_case_2_decode_already_running_shortens_t_a_by_its_elapsed_time():
    sched = scheduler()
    sched.observe_decode_arrival("d", 10.0)
    sched.enqueue(prefill(), 10.02)
    window = sched.available_time(10.02)
    assert window is not None and window.case == 2
    assert window.t_a == pytest.approx(TD - 0.02)
    assert send_now(sched, 10.02).tokens == 24  # 0.8 * 1e6 * 0.03 / 1000


def test_case_3_next_decode_comes_one_ring_period_after_the_last():
    sched = scheduler()
    sched.observe_decode_arrival("d", 9.5)
    sched.observe_decode_arrival("d", 10.0)  # period 0.5 s
    sched.enqueue(decode(), 10.05)
    send_now(sched, 10.05, duration=0.001)
    sched.enqueue(prefill(), 10.1)
    window = sched.available_time(10.1)
    # t_f = t_p + ring = (10.0 + T_d) + 0.5; T_a = t_f - t_c
    assert window is not None and window.case == 3
    assert window.t_a == pytest.approx(10.0 + 0.5 + TD - 10.1)
    assert send_now(sched, 10.1).tokens == 360  # 0.8 * 1e6 * 0.45 / 1000


def test_case_3_period_is_the_shortest_recent_interval_so_our_own_delays_do_not_grow_chunks():
    sched = scheduler()
    for t in (0.0, 0.5, 1.5, 2.0):  # the 1.0 s interval was stretched by a big send
        sched.observe_decode_arrival("d", t)
    sched.enqueue(decode(), 2.05)
    send_now(sched, 2.05)
    window = sched.available_time(2.1)
    assert window is not None and window.t_f == pytest.approx(2.0 + 0.5 + TD)


def test_case_3_without_a_period_the_step_cannot_return_before_half_an_rtt():
    sched = scheduler()
    sched.update_link(DEST, rtt=0.2)
    sched.observe_decode_arrival("d", 10.0)  # first step: no period yet
    sched.enqueue(decode(), 10.05)
    send_now(sched, 10.05, duration=0.01)  # left at 10.06
    window = sched.available_time(10.06)
    assert window is not None and window.case == 3
    assert window.t_a == pytest.approx(0.2 / 2 + TD)  # back at 10.16 earliest, then T_d


def test_an_overdue_step_predicts_it_any_moment_so_t_a_is_t_d():
    sched = scheduler()
    sched.observe_decode_arrival("d", 9.5)
    sched.observe_decode_arrival("d", 10.0)
    sched.enqueue(decode(), 10.05)
    send_now(sched, 10.05)
    window = sched.available_time(10.7)  # expected back at 10.5: late
    assert window is not None and window.t_a == pytest.approx(TD)


def test_the_soonest_decode_session_sets_t_a():
    sched = scheduler()
    sched.observe_decode_arrival("slow", 7.0)
    sched.observe_decode_arrival("slow", 9.0)  # period 2 s: back at 11.0
    sched.enqueue(decode("slow"), 9.05)
    send_now(sched, 9.05)
    sched.observe_decode_arrival("fast", 10.0)  # computing: done at 10.05
    window = sched.available_time(10.01)
    assert window is not None and window.session == "fast"


def test_a_chunk_never_falls_below_the_floor_even_when_decode_is_overdue():
    sched = scheduler(min_chunk_tokens=8)
    sched.observe_decode_arrival("d", 10.0)
    sched.enqueue(prefill(), 10.2)  # decode should have finished at 10.05
    assert send_now(sched, 10.2).tokens == 8


def test_the_floor_never_exceeds_what_is_left():
    sched = scheduler(min_chunk_tokens=8)
    sched.observe_decode_arrival("d", 10.0)
    sched.enqueue(prefill(tokens=5), 10.2)
    send = send_now(sched, 10.2)
    assert (send.tokens, send.last) == (5, True)


def test_without_a_bandwidth_estimate_chunks_are_the_floor():
    sched = LinkScheduler(bare(min_chunk_tokens=8))
    sched.observe_compute("decode", 1, TD)
    sched.observe_decode_arrival("d", 10.0)
    sched.enqueue(prefill(), 10.0)
    assert send_now(sched, 10.0).tokens == 8


def test_a_connection_without_estimate_borrows_the_most_cautious_one_on_the_uplink():
    sched = scheduler()
    sched.update_link("other:1", bandwidth=4 * BW)
    sched.observe_decode_arrival("d", 10.0)
    sched.enqueue(Volume("p", "new:2", "prefill", 1000, 1000), 10.0)
    assert send_now(sched, 10.0).tokens == 40


def test_chunks_follow_the_prefill_across_cases_until_it_is_done():
    sched = scheduler()
    sched.observe_decode_arrival("d", 10.0)
    vid = sched.enqueue(prefill(tokens=100), 10.0)
    sends = [send_now(sched, 10.0 + 0.01 * i) for i in range(4)]
    assert [s.vid for s in sends] == [vid] * 4
    assert [s.offset for s in sends] == [0, 40, 72, 96]  # T_a 50, 40, 30 ms; then 4 left
    assert sends[-1].last and sends[-1].tokens == 4


# --- bytes already sent: backlog and the in-flight cap ------------------------------------------
# 1 MB/s and a 30 ms min RTT: 30 kB in flight is simply on its way; the cap is 2 x that, 60 kB.


def test_bytes_queued_beyond_the_pipe_come_off_t_a():
    sched = scheduler()
    sched.update_link(DEST, min_rtt=0.03, in_flight=30_000 + 20_000)  # 20 ms of backlog
    sched.observe_decode_arrival("d", 10.0)
    sched.enqueue(prefill(), 10.0)
    assert sched.backlog(DEST) == pytest.approx(0.02)
    assert send_now(sched, 10.0).tokens == 24  # 0.8 * 1e6 * (0.05 - 0.02) / 1000


def test_a_prefill_chunk_waits_while_the_connection_holds_more_than_the_cap():
    sched = scheduler(inflight_gain=2.0)
    sched.update_link(DEST, min_rtt=0.03, in_flight=55_000)
    sched.observe_decode_arrival("d", 10.0)
    sched.enqueue(prefill(), 10.0)
    assert sched.next_send(10.0) is None and sched.holding  # 55 kB + a floor chunk > 60 kB
    assert sched.stats()["prefill_held"] == 1
    d = sched.enqueue(decode("d"), 10.05)
    assert send_now(sched, 10.05).vid == d  # a decode volume is never held
    sched.update_link(DEST, in_flight=30_000)  # acknowledgements came
    send = send_now(sched, 10.06)
    assert send.phase == "prefill" and not sched.holding


def thin_link_with_a_prompt(
    floor_chunks: int, min_chunk_s: float = 0.0, pace_lead_s: float | None = None, **link: int
) -> LinkScheduler:
    """A capped scheduler (floor chunks of 8 tokens) on a 1 MB/s link with a 1 ms RTT, where a
    decode session computes and a prompt waits; `link`: update_link's figures (bytes in flight)."""
    sched = LinkScheduler(
        bare(
            min_chunk_tokens=8,
            inflight_gain=2.0,
            inflight_floor_chunks=floor_chunks,
            min_chunk_s=min_chunk_s,
            pace_lead_s=pace_lead_s,
        )
    )
    sched.update_link(DEST, rtt=0.001, min_rtt=0.001, bandwidth=BW, **link)
    sched.observe_compute("decode", 1, TD)
    sched.observe_decode_arrival("d", 10.0)
    sched.enqueue(prefill(), 10.0)
    return sched


def test_the_cap_always_allows_a_few_floor_chunks_on_a_thin_link():
    sched = thin_link_with_a_prompt(3, in_flight=16_000)
    assert send_now(sched, 10.0).phase == "prefill"  # 16 kB + 8 kB <= 3 floor chunks (24 kB)
    sched.update_link(DEST, in_flight=17_000)
    assert sched.next_send(10.0) is None and sched.holding


def test_the_cap_counts_prompt_bytes_not_the_decode_frames_beside_them():
    sched = thin_link_with_a_prompt(2, in_flight=8_000 + 3_000)
    assert sched.next_send(10.0) is None  # told no more: all 11 kB count, + 8 kB > 16 kB
    sched.update_link(DEST, prefill_in_flight=8_000)  # 3 kB of it are decode frames
    assert send_now(sched, 10.0).phase == "prefill"  # 8 kB of prompt + 8 kB <= 2 chunks
    sched.update_link(DEST, prefill_in_flight=8_001)
    assert sched.next_send(10.0) is None and sched.holding


def test_the_cap_floor_counts_chunks_when_the_driver_tells_how_many():
    # a 12-token chunk (12 kB) in flight: more than 2 floor chunks' worth of bytes would allow
    # beside it, yet only one chunk, and a floor of 2 is there to keep the link busy
    sched = thin_link_with_a_prompt(2, prefill_in_flight=12_000)
    assert sched.next_send(10.0) is None  # not told the count: 12 kB + 8 kB > 16 kB
    sched.update_link(DEST, prefill_frames=1)
    assert send_now(sched, 10.0).phase == "prefill"  # one chunk of a floor of 2
    sched.update_link(DEST, prefill_in_flight=24_000, prefill_frames=2)
    assert sched.next_send(10.0) is None and sched.holding
    # the byte cap (2 x BW x min RTT, 2 kB here) still bounds what the floor allows beyond
    sched.update_link(DEST, min_rtt=0.02, prefill_in_flight=24_000, prefill_frames=2)
    assert send_now(sched, 10.0).phase == "prefill"  # 24 kB + 8 kB <= 40 kB


def test_the_cap_floor_is_counted_in_the_smallest_chunks_the_link_allows():
    # min_chunk_s 2 ms at 1 MB/s: chunks of 2 tokens, so 3 floor chunks are 6 kB, not 24
    sched = thin_link_with_a_prompt(3, min_chunk_s=0.002, prefill_in_flight=4_000)
    assert send_now(sched, 10.0).phase == "prefill"  # 4 kB + a 2 kB chunk <= 6 kB
    sched.update_link(DEST, prefill_in_flight=4_001)
    assert sched.next_send(10.0) is None and sched.holding


def test_the_cap_floor_holds_a_round_trip_of_chunks_so_the_link_never_waits_for_an_ack():
    # 8 ms chunks on a 10 ms round trip: the first chunk's acknowledgement comes 18 ms after it
    # went, when 2 chunks have drained already; a third keeps the link busy till then
    sched = thin_link_with_a_prompt(2, prefill_in_flight=16_000, prefill_frames=2)
    sched.update_link(DEST, rtt=0.01, min_rtt=0.01)  # cap: 2 x 1 MB/s x 10 ms = 20 kB
    assert send_now(sched, 10.0).phase == "prefill"  # 16 kB + 8 kB > 20 kB, but 2 < 3 chunks
    sched.update_link(DEST, prefill_in_flight=24_000, prefill_frames=3)
    assert sched.next_send(10.0) is None and sched.holding
    # told no count, the floor is the same 3 chunks' bytes
    bytes_only = thin_link_with_a_prompt(2, prefill_in_flight=16_000)
    bytes_only.update_link(DEST, rtt=0.01, min_rtt=0.01)
    assert send_now(bytes_only, 10.0).phase == "prefill"  # 16 kB + 8 kB <= 3 x 8 kB
    bytes_only.update_link(DEST, prefill_in_flight=16_001)
    assert bytes_only.next_send(10.0) is None and bytes_only.holding


def test_a_paced_link_holds_the_floor_chunks_on_top_of_the_cap():
    # cap 2 kB (2 x 1 MB/s x 1 ms); unpaced, two 8 kB chunks in flight stop a third
    plain = thin_link_with_a_prompt(2, prefill_in_flight=9_000, prefill_frames=2)
    assert plain.next_send(10.0) is None and plain.holding
    # paced: the floor's 16 kB come on top of the cap's 2 kB
    sched = thin_link_with_a_prompt(2, pace_lead_s=0.005, prefill_in_flight=9_000, prefill_frames=2)
    assert sched.pacing(DEST)
    assert send_now(sched, 10.0).phase == "prefill"  # 9 kB + 8 kB <= 18 kB
    sched.update_link(DEST, prefill_in_flight=10_001, prefill_frames=3)
    assert sched.next_send(10.0) is None and sched.holding and sched.hold_until is None


def test_nothing_is_held_without_a_decode_session_to_protect():
    sched = scheduler(inflight_gain=2.0)
    sched.update_link(DEST, min_rtt=0.03, in_flight=500_000)
    sched.enqueue(prefill(tokens=700), 0.0)
    assert send_now(sched, 0.0).tokens == 700


def test_without_a_gain_there_is_no_cap():
    sched = scheduler()
    sched.update_link(DEST, min_rtt=0.03, in_flight=500_000)
    sched.observe_decode_arrival("d", 10.0)
    sched.enqueue(prefill(), 10.0)
    assert send_now(sched, 10.0).tokens == 8  # the backlog leaves no T_a: the floor


# --- pacing: the next chunk goes when the link has carried the last --------------------------
# 1 MB/s: a 20-token chunk of 1000-byte tokens takes the link 20 ms.


def paced(**kwargs) -> LinkScheduler:
    sched = scheduler(pace_lead_s=0.005, **kwargs)
    sched.observe_decode_arrival("d", 10.0)  # a decode session to protect, computing till 10.05
    return sched


def test_pacing_holds_a_chunk_until_the_link_has_nearly_carried_the_last():
    sched = paced()
    sched.enqueue(prefill(), 10.0)
    first = send_now(sched, 10.0)
    assert first.tokens == 40  # 0.8 x 1 MB/s x 50 ms
    assert sched.next_send(10.001) is None and sched.holding
    assert sched.hold_until == pytest.approx(10.035)  # 40 ms of bytes, 5 ms of lead
    assert sched.backlog(DEST, 10.02) == pytest.approx(0.02)
    assert sched.next_send(10.034) is None
    second = sched.next_send(10.036)
    assert second is not None and second.offset == 40
    assert sched.stats()["prefill_paced"] == 2


def test_pacing_never_holds_a_decode_volume():
    sched = paced()
    sched.enqueue(prefill(), 10.0)
    send_now(sched, 10.0)
    d = sched.enqueue(decode("d"), 10.01)
    assert send_now(sched, 10.01).vid == d


def test_a_paced_chunk_is_sized_to_the_window_left_after_what_the_link_still_holds():
    sched = paced(min_chunk_tokens=1)
    sched.enqueue(prefill(), 10.0)
    send_now(sched, 10.0)  # 40 tokens, carried by 10.04
    sched.observe_decode_arrival("e", 10.036)  # another session, ready at 10.086
    send = send_now(sched, 10.036)
    # T_a = 10.05 - 10.036 = 14 ms, minus 4 ms still on the link: 10 ms -> 8 tokens at 0.8
    assert send.tokens == 8  # without the 4 ms: 11


def test_auto_pacing_paces_a_link_only_while_its_smallest_chunk_takes_long():
    sched = paced(pace_slow_s=0.010)  # 8 tokens of 1000 bytes: 8 ms at 1 MB/s, not slow
    sched.enqueue(prefill(), 10.0)
    assert send_now(sched, 10.0).tokens == 40
    assert not sched.pacing(DEST)
    assert send_now(sched, 10.001).offset == 40  # no wait for the link to carry the first
    sched.update_link(DEST, bandwidth=BW / 2)  # now 16 ms: the link is slow
    assert sched.pacing(DEST) and sched.stats()["paced_links"] == 1
    assert sched.next_send(10.002) is None and sched.hold_until is not None


def test_pacing_goes_by_its_own_model_and_the_in_flight_cap_stays_the_safety_net():
    sched = paced(inflight_gain=2.0)
    sched.update_link(DEST, min_rtt=0.03, in_flight=30_000 + 20_000)  # 20 ms beyond the pipe
    sched.enqueue(prefill(), 10.0)
    assert sched.backlog(DEST, 10.0) == 0.0  # nothing sent by this scheduler yet
    assert sched.backlog(DEST) == pytest.approx(0.02)  # what acknowledgements alone say
    assert send_now(sched, 10.0).phase == "prefill"  # 50 kB + 8 kB <= 60 kB + 2 x 8 kB
    sched.update_link(DEST, in_flight=68_001)  # an estimate reading high shows up here
    assert sched.next_send(10.04) is None and sched.holding and sched.hold_until is None


def test_a_late_acknowledgement_catches_the_pacing_model_up_with_the_link():
    sched = scheduler(pace_lead_s=0.005, ack_slack_s=0.02)
    sched.update_link(DEST, min_rtt=0.01)
    marks = []
    for i in range(3):  # 60 kB at 10.0: the model has the link empty by 10.06
        sched.enqueue(decode(f"d{i}", bytes_per_token=20_000), 10.0)
        send_now(sched, 10.0)
        marks.append(sched.bytes_sent_to(DEST))
    assert marks == [20_000, 40_000, 60_000] and sched.backlog(DEST, 10.1) == 0.0
    # the first 20 kB were read only now: the 40 kB after them had at most 30 ms to drain
    sched.acked(DEST, marks[0], 10.1)
    assert sched.backlog(DEST, 10.1) == pytest.approx(0.01)
    assert sched.stats()["pace_corrections"] == 1
    sched.acked(DEST, marks[1], 10.1)  # claims less than the model holds: no change
    assert sched.backlog(DEST, 10.1) == pytest.approx(0.01)
    assert sched.backlog(DEST, 10.105) == pytest.approx(0.005)  # and it drains on
    plain = scheduler()
    plain.enqueue(decode(bytes_per_token=20_000), 10.0)
    send_now(plain, 10.0)
    plain.acked(DEST, 0, 10.5)  # not pacing: acknowledgements only feed the cap
    assert plain.stats()["pace_corrections"] == 0


def test_an_acknowledgement_later_than_the_link_model_says_is_counted_as_lag():
    sched = scheduler()  # not pacing: the lag is counted all the same
    sched.update_link(DEST, min_rtt=0.03)
    marks = []
    for i in range(3):  # 20 kB each at 10.0: through the bottleneck at 10.02, .04, .06
        sched.enqueue(decode(f"d{i}", bytes_per_token=20_000), 10.0)
        send_now(sched, 10.0)
        marks.append(sched.bytes_sent_to(DEST))
    sched.acked(DEST, marks[0], 10.05)  # 10.02 + 30 ms: on time
    assert sched.stats()["ack_lag_p50_s"] == pytest.approx(0.0)
    sched.acked(DEST, marks[2], 10.15)  # the second's never came; 10.06 + 30 ms + 60 ms late
    stats = sched.stats()
    assert stats["ack_lag_p50_s"] == pytest.approx(0.03)  # the median of 0 and 60 ms
    assert stats["ack_lag_p99_s"] == pytest.approx(0.0594)
    sched.acked(DEST, marks[1], 10.2)  # a mark already passed: nothing to time
    assert sched.stats()["ack_lag_p99_s"] == pytest.approx(0.0594)


def test_the_link_model_drains_the_bytes_the_sends_put_on_the_wire():
    sched = scheduler()
    sched.update_link(DEST, min_rtt=0.03)
    marks = []
    for i in range(2):  # 20 kB of tensor each, 21 kB with framing: through at 10.021, 10.042
        sched.enqueue(decode(f"d{i}", bytes_per_token=20_000), 10.0)
        send = sched.next_send(10.0)
        sched.sent(send, 10.0, 10.0, wire_bytes=21_000)
        marks.append(sched.bytes_sent_to(DEST))
    assert marks == [21_000, 42_000]
    sched.acked(DEST, marks[1], 10.072)  # 10.042 + 30 ms: on time by the wire bytes
    assert sched.stats()["ack_lag_p50_s"] == pytest.approx(0.0, abs=1e-9)
    assert sched.stats()["bytes_sent_decode"] == 40_000  # the tensors, as before


def test_how_late_the_driver_comes_back_for_a_paced_chunk_is_counted():
    sched = paced()
    sched.enqueue(prefill(), 10.0)
    send_now(sched, 10.0)  # 40 ms of bytes
    assert sched.next_send(10.001) is None and sched.hold_until == pytest.approx(10.035)
    assert sched.next_send(10.02) is None  # woken early (an acknowledgement): not late
    assert sched.stats()["pace_late_p50_s"] == 0.0
    send_now(sched, 10.065)  # 30 ms after the chunk could have gone
    assert sched.stats()["pace_late_p50_s"] == pytest.approx(0.03)


def test_the_time_the_link_idled_while_a_prefill_waited_is_counted():
    sched = paced()
    sched.enqueue(prefill(), 10.0)
    send_now(sched, 10.0)  # 40 tokens: the link has them all carried by 10.04
    assert sched.stats()["prefill_idle_s"] == 0.0  # the first send: nothing before it
    send_now(sched, 10.07)  # came back 30 ms after the link ran dry
    assert sched.stats()["prefill_idle_s"] == pytest.approx(0.03)
    # a prefill that arrives at an idle link has not lost the time before it arrived
    sched = scheduler()
    sched.enqueue(prefill("a", tokens=10), 0.0)
    send_now(sched, 0.0)  # whole (no decode session): carried by 0.01
    sched.enqueue(prefill("b", tokens=10), 0.5)
    send_now(sched, 0.52)
    assert sched.stats()["prefill_idle_s"] == pytest.approx(0.02)


def test_pacing_needs_a_decode_session_to_protect_and_a_pace_lead():
    sched = scheduler(pace_lead_s=0.005)
    sched.enqueue(prefill(tokens=700), 0.0)
    sched.enqueue(prefill("q", tokens=700), 0.0)
    send_now(sched, 0.0)
    assert send_now(sched, 0.0).tokens == 700  # nobody decodes: no hold, whole volumes
    sched = scheduler()
    sched.observe_decode_arrival("d", 10.0)
    sched.enqueue(prefill(), 10.0)
    send_now(sched, 10.0)
    assert send_now(sched, 10.0).phase == "prefill"


def test_the_chunk_floor_follows_the_link_when_given_in_seconds():
    sched = LinkScheduler(bare(min_chunk_tokens=8, min_chunk_s=0.02))
    sched.observe_compute("decode", 1, TD)
    sched.observe_decode_arrival("d", 10.0)
    volume = prefill(bytes_per_token=1152)
    assert sched.floor_tokens(volume) == 8  # no bandwidth estimate yet
    sched.update_link(DEST, bandwidth=125_000)  # 1 Mbps: 20 ms carries 2.2 tokens
    assert sched.floor_tokens(volume) == 2
    sched.enqueue(volume, 10.05)  # decode ready now: T_a = 0, the floor
    assert send_now(sched, 10.05).tokens == 2
    sched.update_link(DEST, bandwidth=2_500_000)  # 20 Mbps: 43 tokens, capped at 8
    assert sched.floor_tokens(volume) == 8
    sched.update_link(DEST, bandwidth=10_000)  # slower than a token per 20 ms: still 1
    assert sched.floor_tokens(volume) == 1


def test_pacing_and_floor_options_are_checked():
    with pytest.raises(ValueError, match="pace_lead_s"):
        LinkScheduler(LinkOptions(pace_lead_s=-0.001))
    with pytest.raises(ValueError, match="min_chunk_s"):
        LinkScheduler(LinkOptions(min_chunk_s=-1))


# --- stats ------------------------------------------------------------------------------------


def test_stats_is_a_flat_dict_of_numbers():
    sched = scheduler()
    sched.enqueue(prefill(), 0.0)
    stats = sched.stats()
    assert stats and all(isinstance(v, float) for v in stats.values())
    assert stats["prefill_queued_volumes"] == 1 and stats["prefill_queued_bytes"] == 1_000_000
    assert stats["bandwidth_Bps"] == BW and stats["rtt_s"] == 0.03


def test_stats_report_decode_queueing_delay_percentiles():
    sched = scheduler()
    for i in range(100):
        sched.enqueue(decode(), float(i))
        send_now(sched, i + i / 1000)  # delays 0, 1, ..., 99 ms
    stats = sched.stats()
    assert stats["decode_delay_p50_s"] == pytest.approx(0.0495)
    assert stats["decode_delay_p99_s"] == pytest.approx(0.09801)
    assert stats["bytes_sent_decode"] == 100_000


def test_the_published_figures_read_back_as_the_same_typed_stats():
    sched = scheduler()
    sched.observe_decode_arrival("d", 10.0)
    sched.enqueue(prefill(), 10.0)
    send_now(sched, 10.0)
    stats = sched.snapshot()
    assert stats.chunks_sent == 1 and stats.last_t_a_case == 1
    assert LinkStats.from_dict(sched.stats()) == stats


def test_a_record_without_some_figures_reads_them_as_zero_and_ignores_unknown_ones():
    stats = LinkStats.from_dict({"sends": 3, "bandwidth_Bps": 1e6, "from_a_newer_node": 7.0})
    assert stats.sends == 3.0 and stats.bandwidth_Bps == 1e6 and stats.rtt_s == 0.0


# --- Algorithm 1 as properties over random interleavings --------------------------------------

SESSIONS = ("a", "b", "c")
op = st.one_of(
    st.tuples(
        st.just("enqueue"),
        st.sampled_from(SESSIONS),
        st.sampled_from(("prefill", "decode")),
        st.integers(1, 120),
        st.sampled_from((1, 3, 1152)),
        st.integers(0, 300),  # the prompt's tokens after this volume
    ),
    st.tuples(st.just("send"), st.floats(0.0, 0.05)),
    st.tuples(st.just("arrive"), st.sampled_from(SESSIONS)),
    st.tuples(st.just("advance"), st.floats(0.0, 0.5)),
    st.tuples(st.just("link"), st.floats(1e3, 1e8)),
    st.tuples(st.just("compute"), st.floats(0.0, 0.2)),
)


@dataclass
class Decision:
    send: Send | None
    eligible_decode: list[int]  # vids, oldest first
    eligible_prefill: list[int]
    left: dict[int, int]  # tokens each eligible volume had left
    phase_left: dict[int, int]  # ... and its phase had left, from there to its end
    waited: dict[int, float]  # how long each eligible volume had been queued
    bandwidth: float | None  # the link's bandwidth as last told


@dataclass
class Run:
    volumes: dict[int, Volume] = field(default_factory=dict)
    decisions: list[Decision] = field(default_factory=list)

    @property
    def sends(self) -> list[Send]:
        return [d.send for d in self.decisions if d.send is not None]


def phase_tokens(volume: Volume, left: int) -> int:
    """Tokens of the volume's phase still to send when `left` of its own are."""
    return max(volume.phase_left, volume.tokens) - volume.tokens + left


def shortest_key(run: Run, d: Decision, vid: int) -> tuple[float, int]:
    if d.bandwidth is None:
        return float(d.phase_left[vid]), vid
    seconds = d.phase_left[vid] * run.volumes[vid].bytes_per_token / d.bandwidth
    return seconds - d.waited[vid], vid


def drive(sched: LinkScheduler, ops: list[tuple]) -> Run:
    """Apply ops, then drain; record what was eligible at every decision (a volume is eligible
    when every earlier volume of its session has been handed out)."""
    run = Run()
    left: dict[int, int] = {}
    enqueued: dict[int, float] = {}
    now = 0.0
    bandwidth = None

    def decide() -> Send | None:
        unfinished = [v for v in sorted(left) if left[v] > 0]
        heads = {}
        for vid in unfinished:
            heads.setdefault(run.volumes[vid].session, vid)
        eligible = sorted(heads.values())
        send = sched.next_send(now)
        run.decisions.append(
            Decision(
                send,
                [v for v in eligible if run.volumes[v].phase == "decode"],
                [v for v in eligible if run.volumes[v].phase == "prefill"],
                {v: left[v] for v in eligible},
                {v: phase_tokens(run.volumes[v], left[v]) for v in eligible},
                {v: now - enqueued[v] for v in eligible},
                bandwidth,
            )
        )
        if send is not None:
            left[send.vid] -= send.tokens
        return send

    for o in ops:
        if o[0] == "enqueue":
            tokens = o[3] if o[2] == "prefill" else 1
            volume = Volume(o[1], DEST, o[2], tokens, o[4], tokens + o[5] if o[5] else 0)
            vid = sched.enqueue(volume, now)
            run.volumes[vid] = volume
            left[vid] = volume.tokens
            enqueued[vid] = now
        elif o[0] == "send":
            send = decide()
            if send is not None:
                sched.sent(send, now, now + o[1])
                now += o[1]
        elif o[0] == "arrive":
            sched.observe_decode_arrival(o[1], now)
        elif o[0] == "advance":
            now += o[1]
        elif o[0] == "link":
            sched.update_link(DEST, rtt=0.03, bandwidth=o[1], now=now)
            bandwidth = o[1]
        elif o[0] == "compute":
            sched.observe_compute("decode", 1, o[1])
    for _ in range(10_000):
        send = decide()
        if send is None:
            break
        sched.sent(send, now, now)
    return run


ops_lists = st.lists(op, max_size=80)
waits = st.integers(1, 5)


@settings(max_examples=150, deadline=None)
@given(ops_lists, waits, st.sampled_from(("arrival", "shortest")))
def test_decode_goes_first_while_the_waiting_weight_is_below_max_wait(ops, n, order):
    run = drive(LinkScheduler(bare("molink", max_wait=n, prefill_order=order)), ops)
    w = 0
    for d in run.decisions:
        if d.eligible_decode and d.eligible_prefill:
            w += 1
        if d.eligible_decode and w < n:
            assert d.send is not None and d.send.vid == d.eligible_decode[0]
            assert d.send.tokens == d.left[d.send.vid]
        elif d.eligible_prefill:
            # arrival: the oldest waiting prefill; shortest: the one whose prompt needs the
            # least link time left less its wait (fewest tokens, without an estimate), the
            # oldest among equals
            first = d.eligible_prefill[0]
            if order == "shortest":
                first = min(d.eligible_prefill, key=lambda v: shortest_key(run, d, v))
            assert d.send is not None and d.send.vid == first
            w = 0
        else:
            assert d.send is None


@settings(max_examples=150, deadline=None)
@given(ops_lists, waits)
def test_no_prefill_waits_behind_more_than_max_wait_decode_sends(ops, n):
    run = drive(LinkScheduler(bare("molink", max_wait=n)), ops)
    passed = 0  # decode sends made while a prefill was waiting, since the last prefill send
    for d in run.decisions:
        if d.send is None:
            continue
        if d.send.phase == "prefill":
            if d.eligible_decode:  # forced by W >= N: the rest of the prefill goes whole
                assert passed == n - 1 and d.send.last
            passed = 0
        elif d.eligible_prefill:
            passed += 1
            assert passed <= n - 1


@settings(max_examples=150, deadline=None)
@given(ops_lists, waits, st.sampled_from(("molink", "fifo", "shortest")))
def test_every_token_of_every_volume_is_sent_exactly_once_in_order_per_session(ops, n, policy):
    if policy == "shortest":
        sched = LinkScheduler(bare("molink", max_wait=n, prefill_order="shortest"))
    else:
        sched = LinkScheduler(bare(policy, max_wait=n))
    run = drive(sched, ops)
    next_token = {vid: 0 for vid in run.volumes}
    last_vid: dict[str, int] = {}
    for s in run.sends:
        assert s.offset == next_token[s.vid], "a gap or a repeat inside a volume"
        assert last_vid.get(s.session, -1) <= s.vid, "a later volume overtook an earlier one"
        next_token[s.vid] += s.tokens
        assert s.last == (next_token[s.vid] == run.volumes[s.vid].tokens)
        last_vid[s.session] = s.vid
    assert next_token == {vid: v.tokens for vid, v in run.volumes.items()}


@settings(max_examples=150, deadline=None)
@given(ops_lists, waits)
def test_chunks_are_whole_tokens_of_their_volume(ops, n):
    run = drive(LinkScheduler(bare("molink", max_wait=n, min_chunk_tokens=4)), ops)
    for s in run.sends:
        volume = run.volumes[s.vid]
        assert s.tokens >= 1
        assert s.nbytes == s.tokens * volume.bytes_per_token
        assert (s.session, s.dest, s.phase) == (volume.session, volume.dest, volume.phase)
        assert s.last or s.tokens >= 4


@settings(max_examples=150, deadline=None)
@given(ops_lists)
def test_fifo_sends_whole_volumes_in_arrival_order(ops):
    run = drive(LinkScheduler(bare("fifo")), ops)
    assert [s.vid for s in run.sends] == sorted(run.volumes)
    assert all(s.offset == 0 and s.last for s in run.sends)


# --- the simulator ----------------------------------------------------------------------------

SLOW = SimLink(bandwidth=625_000, latency=0.015)  # 5 Mbit/s, 30 ms RTT
STEADY = DecodeStream(
    "chat", start=0.0, steps=200, compute_s=0.02, ring_s=0.1, bytes_per_token=1152
)
LONG_PROMPTS = [PrefillArrival(f"prompt{i}", 1.0 + 5 * i, 2000, 1152) for i in range(5)]


def p99(values: list[float]) -> float:
    values = sorted(values)
    return values[round(0.99 * (len(values) - 1))]


def test_sim_molink_cuts_decode_send_delay_far_below_fifo():
    fifo = simulate(LinkScheduler(bare("fifo")), SLOW, [STEADY], LONG_PROMPTS)
    molink = simulate(LinkScheduler(bare("molink")), SLOW, [STEADY], LONG_PROMPTS)
    # fifo: a decode step queued behind a 2.3 MB prompt waits its ~3.7 s on the wire
    assert p99(fifo.decode_delays()) > 1.0
    assert p99(molink.decode_delays()) < 0.5 * p99(fifo.decode_delays())
    assert p99(molink.decode_delays()) < 0.02  # at most one floor chunk: 8 x 1152 B = 15 ms


def test_sim_molink_finishes_prefill_nearly_as_soon_as_fifo():
    fifo = simulate(LinkScheduler(bare("fifo")), SLOW, [STEADY], LONG_PROMPTS)
    molink = simulate(LinkScheduler(bare("molink")), SLOW, [STEADY], LONG_PROMPTS)
    assert molink.prefill_completion() <= 1.1 * fifo.prefill_completion()


def test_sim_molink_sends_prompts_in_chunks_between_decode_steps():
    sched = LinkScheduler(bare("molink"))
    result = simulate(sched, SLOW, [STEADY], LONG_PROMPTS)
    prompt = result.of_phase("prefill")[0]
    assert prompt.sends > 10
    assert sched.stats()["w_resets"] == 0  # chunks leave the decode queue empty: W never builds


def test_sim_shortest_order_lowers_mean_prompt_completion_at_the_same_decode_delay():
    # one 2000-token prompt, then four of 300 while it crosses: arrival order makes them wait
    # ~3.7 s for it; shortest lets them pass and the long one finishes no later
    prompts = [PrefillArrival("long", 1.0, 2000, 1152)]
    prompts += [PrefillArrival(f"short{i}", 1.5 + 0.2 * i, 300, 1152) for i in range(4)]

    def run(order: str):
        result = simulate(
            LinkScheduler(bare("molink", prefill_order=order)), SLOW, [STEADY], prompts
        )
        prefills = result.of_phase("prefill")
        done = {v.session: v.finished + SLOW.latency - v.enqueued for v in prefills}
        return done, result.prefill_completion(), p99(result.decode_delays())

    arrival, arrival_all, arrival_delay = run("arrival")
    shortest, shortest_all, shortest_delay = run("shortest")
    mean = {k: sum(d.values()) / len(d) for k, d in (("a", arrival), ("s", shortest))}
    assert mean["s"] < 0.6 * mean["a"]
    assert shortest_all == pytest.approx(arrival_all, abs=0.05)  # the link never idles
    assert all(shortest[f"short{i}"] < 2.0 for i in range(4))
    assert all(arrival[f"short{i}"] > 3.5 for i in range(4))
    assert shortest_delay == pytest.approx(arrival_delay, abs=0.005)


def test_sim_is_deterministic():
    runs = [simulate(LinkScheduler(bare("molink")), SLOW, [STEADY], LONG_PROMPTS) for _ in range(2)]
    assert runs[0].sends == runs[1].sends


def test_sim_decode_session_is_a_closed_loop_slowed_by_fifo():
    fifo = simulate(LinkScheduler(bare("fifo")), SLOW, [STEADY], LONG_PROMPTS)
    molink = simulate(LinkScheduler(bare("molink")), SLOW, [STEADY], LONG_PROMPTS)
    fifo_done, molink_done = (
        max(v.finished or 0 for v in r.of_phase("decode")) for r in (fifo, molink)
    )
    assert molink_done < fifo_done - 10  # five ~3.7 s stalls are gone


def test_sim_a_bandwidth_overestimate_costs_decode_delay_an_underestimate_only_chunks():
    def run(believed: float) -> tuple[float, float, float]:
        sched = LinkScheduler(bare("molink"))
        link = SimLink(SLOW.bandwidth, SLOW.latency, believed_bandwidth=believed)
        result = simulate(sched, link, [STEADY], LONG_PROMPTS)
        return (
            p99(result.decode_delays()),
            result.prefill_completion(),
            sched.stats()["chunks_sent"],
        )

    true_delay, true_completion, true_chunks = run(SLOW.bandwidth)
    high_delay, _, _ = run(2 * SLOW.bandwidth)
    low_delay, low_completion, low_chunks = run(0.5 * SLOW.bandwidth)
    assert high_delay > 4 * true_delay  # chunks overrun the gap before the next decode step
    assert low_delay <= true_delay and low_chunks > 1.5 * true_chunks
    assert low_completion <= 1.01 * true_completion  # the link stays busy either way


def test_sim_pacing_costs_nothing_on_a_true_estimate_but_idles_the_link_on_a_low_one():
    def run(pace: float | None, believed: float) -> tuple[float, float]:
        link = SimLink(SLOW.bandwidth, SLOW.latency, believed_bandwidth=believed)
        result = simulate(
            LinkScheduler(bare("molink", pace_lead_s=pace)), link, [STEADY], LONG_PROMPTS
        )
        return p99(result.decode_delays()), result.prefill_completion()

    plain_delay, plain_completion = run(None, SLOW.bandwidth)
    paced_delay, paced_completion = run(0.005, SLOW.bandwidth)
    assert paced_completion == pytest.approx(plain_completion, rel=1e-3)
    assert paced_delay == pytest.approx(plain_delay, abs=1e-3)
    # pacing trusts the estimate: at half the truth the link idles while a prompt crosses
    # (the last prompt finished at 23.7 s, then at 34.0 s)
    _, slow_completion = run(0.005, 0.5 * SLOW.bandwidth)
    assert slow_completion > 1.3 * plain_completion


def test_sim_a_capped_prompt_at_real_size_never_leaves_the_link_idle_for_acknowledgements():
    # 8 KiB a token (an 8B model's activations), 40 Mbit/s, 30 ms: a floor chunk takes 13 ms, so
    # two of them drained before the first's acknowledgement came back (idle 0.15 s, the prompt
    # 1.18x fifo's)
    link = SimLink(bandwidth=5_000_000, latency=0.015, acks=True)
    decodes = [DecodeStream(f"chat{i}", 0.05 * i, 300, 0.01, 0.09, 8192) for i in range(2)]
    prompt = [PrefillArrival("prompt", 1.0, 850, 8192)]
    sched = LinkScheduler(LinkOptions(inflight_gain=2.0, inflight_floor_chunks=2))
    molink = simulate(sched, link, decodes, prompt)
    fifo = simulate(LinkScheduler(LinkOptions(policy="fifo")), link, decodes, prompt)
    assert sched.stats()["chunks_sent"] > 50  # in chunks between decode steps, under the cap
    assert sched.stats()["prefill_idle_s"] == pytest.approx(0.0, abs=1e-6)
    assert molink.prefill_completion() < 1.05 * fifo.prefill_completion()
