"""The node's command line: link options reach the scheduler as the README says."""

from __future__ import annotations

import pytest

from swarm.link.options import LinkOptions
from swarm.link.scheduler import LinkScheduler, Volume
from swarm.node.compute import ComputeQueue
from swarm.node.config import parse_args, scheduler_options


def test_the_link_defaults_are_the_capped_molink_pacing_slow_links_only():
    config = parse_args(["--layers", "0:10"])
    options = scheduler_options(config)
    assert config.link_policy == "molink"
    assert options == LinkOptions(
        policy="molink",
        max_wait=30,
        inflight_gain=2.0,
        inflight_floor_chunks=2,
        pace_lead_s=0.010,
        pace_slow_s=0.030,
        min_chunk_s=0.0,
        prefill_order="shortest",
    )
    sched = LinkScheduler(options)
    assert sched.options.inflight_gain == 2.0
    # 8 tokens of 576 float16 activations: 74 ms at 1 Mbps (paced), 15 ms at 5 (not)
    sched.enqueue(Volume("p", "hop", "prefill", 100, 1152), 0.0)
    sched.update_link("hop", bandwidth=1e6 / 8)
    assert sched.pacing("hop")
    sched.update_link("hop", bandwidth=5e6 / 8)
    assert not sched.pacing("hop")
    # a pass waits up to 0.4 s for 32 tokens of a prompt that crosses a slow link in chunks
    assert (config.prefill_min_pass_tokens, config.prefill_gather_s) == (32, 0.4)
    assert (config.prefill_nice, config.dht_nice) == (3, 10)


def test_nice_steps_are_0_to_19(capsys):
    assert parse_args(["--layers", "0:10", "--dht-nice", "0"]).dht_nice == 0
    for flag in ("--dht-nice", "--prefill-nice"):
        with pytest.raises(SystemExit):
            parse_args(["--layers", "0:10", flag, "20"])
        assert "must be 0..19" in capsys.readouterr().err


def test_pacing_and_a_timed_chunk_floor_are_asked_for_in_milliseconds():
    argv = ["--layers", "0:10", "--link-pacing", "--link-pace-lead-ms", "15"]
    options = scheduler_options(parse_args([*argv, "--link-min-chunk-ms", "40"]))
    assert options.pace_lead_s == pytest.approx(0.015)
    assert options.min_chunk_s == pytest.approx(0.04)
    assert options.pace_slow_s == 0  # on: every link
    off = scheduler_options(parse_args([*argv, "--no-link-pacing"]))
    assert off.pace_lead_s is None
    auto = ["--link-pacing", "auto", "--link-pace-slow-ms", "25"]
    options = scheduler_options(parse_args(["--layers", "0:10", *auto]))
    assert options.pace_lead_s == pytest.approx(0.010)
    assert options.pace_slow_s == pytest.approx(0.025)


@pytest.mark.parametrize("bad", [["--link-pace-lead-ms", "-1"], ["--link-min-chunk-ms", "nan"]])
def test_negative_or_unreadable_milliseconds_are_refused(bad, capsys):
    with pytest.raises(SystemExit):
        parse_args(["--layers", "0:10", *bad])
    assert "must be a number >= 0" in capsys.readouterr().err


def test_the_prefill_order_is_one_of_the_schedulers(capsys):
    config = parse_args(["--layers", "0:10", "--link-prefill-order", "arrival"])
    assert LinkScheduler(scheduler_options(config)).options.prefill_order == "arrival"
    with pytest.raises(SystemExit):
        parse_args(["--layers", "0:10", "--link-prefill-order", "random"])
    assert "invalid choice" in capsys.readouterr().err


def test_prompt_passes_compute_shortest_first_unless_asked_to_take_turns(capsys):
    assert parse_args(["--layers", "0:10"]).prefill_compute_order == "shortest"
    config = parse_args(["--layers", "0:10", "--prefill-compute-order", "round-robin"])
    queue = ComputeQueue(config.compute_lanes, config.prefill_nice, config.prefill_compute_order)
    assert queue.prefill_order == "round-robin"
    with pytest.raises(SystemExit):
        parse_args(["--layers", "0:10", "--prefill-compute-order", "arrival"])
    assert "invalid choice" in capsys.readouterr().err
