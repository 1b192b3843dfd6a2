"""The node's command line: link options reach the scheduler as the README says."""

from __future__ import annotations

import pytest

from swarm.link.options import LinkOptions
from swarm.link.scheduler import LinkScheduler, Volume
from swarm.node.compute import ComputeQueue
from swarm.node.config import parse_args


def test_the_link_defaults_are_the_capped_molink_pacing_slow_links_only():
    config = parse_args(["--layers", "0:10"])
    options = LinkScheduler(config.link).options
    assert config.link.policy == "molink"
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
    assert (config.compute.min_pass_tokens, config.compute.gather_s) == (32, 0.4)
    assert (config.compute.prefill_nice, config.dht_nice) == (3, 10)


def test_the_link_flags_default_to_the_link_options_own_defaults():
    assert parse_args(["--layers", "0:10"]).link == LinkOptions()


def test_nice_steps_are_0_to_19(capsys):
    assert parse_args(["--layers", "0:10", "--dht-nice", "0"]).dht_nice == 0
    for flag in ("--dht-nice", "--prefill-nice"):
        with pytest.raises(SystemExit):
            parse_args(["--layers", "0:10", flag, "20"])
        assert "must be 0..19" in capsys.readouterr().err


def test_input_terms_are_auto_unless_one_or_two_is_asked_for(capsys):
    assert parse_args(["--layers", "0:10"]).input_terms is None
    assert parse_args(["--layers", "0:10", "--input-terms", "auto"]).input_terms is None
    assert parse_args(["--layers", "0:10", "--input-terms", "1"]).input_terms == 1
    with pytest.raises(SystemExit):
        parse_args(["--layers", "0:10", "--input-terms", "3"])
    assert "auto, 1 or 2" in capsys.readouterr().err


def test_pacing_and_a_timed_chunk_floor_are_asked_for_in_milliseconds():
    argv = ["--layers", "0:10", "--link-pacing", "--link-pace-lead-ms", "15"]
    options = LinkScheduler(parse_args([*argv, "--link-min-chunk-ms", "40"]).link).options
    assert options.pace_lead_s == pytest.approx(0.015)
    assert options.min_chunk_s == pytest.approx(0.04)
    assert options.pace_slow_s == 0  # on: every link
    off = LinkScheduler(parse_args([*argv, "--no-link-pacing"]).link).options
    assert off.pace_lead_s is None
    auto = ["--link-pacing", "auto", "--link-pace-slow-ms", "25"]
    options = LinkScheduler(parse_args(["--layers", "0:10", *auto]).link).options
    assert options.pace_lead_s == pytest.approx(0.010)
    assert options.pace_slow_s == pytest.approx(0.025)


@pytest.mark.parametrize("bad", [["--link-pace-lead-ms", "-1"], ["--link-min-chunk-ms", "nan"]])
def test_negative_or_unreadable_milliseconds_are_refused(bad, capsys):
    with pytest.raises(SystemExit):
        parse_args(["--layers", "0:10", *bad])
    assert "must be a number >= 0" in capsys.readouterr().err


def test_the_prefill_order_is_one_of_the_schedulers(capsys):
    config = parse_args(["--layers", "0:10", "--link-prefill-order", "arrival"])
    assert LinkScheduler(config.link).options.prefill_order == "arrival"
    with pytest.raises(SystemExit):
        parse_args(["--layers", "0:10", "--link-prefill-order", "random"])
    assert "invalid choice" in capsys.readouterr().err


def test_prompt_passes_compute_shortest_first_unless_asked_to_take_turns(capsys):
    assert parse_args(["--layers", "0:10"]).compute.prefill_order == "shortest"
    config = parse_args(["--layers", "0:10", "--prefill-compute-order", "round-robin"])
    queue = ComputeQueue(
        config.compute.lanes, config.compute.prefill_nice, config.compute.prefill_order
    )
    assert queue.prefill_order == "round-robin"
    with pytest.raises(SystemExit):
        parse_args(["--layers", "0:10", "--prefill-compute-order", "arrival"])
    assert "invalid choice" in capsys.readouterr().err


EVERY_FLAG = [
    *("--model", "m.gguf", "--initial-peers", "/ip4/1.2.3.4/tcp/1/p2p/Qm", "--host", "0.0.0.0"),
    *("--port", "7000", "--public-address", "h:1", "--dht-host", "0.0.0.0", "--dht-nice", "5"),
    *("--max-sessions", "3", "--max-cache-tokens", "900", "--max-session-tokens", "300"),
    *("--max-frame", "4096", "--wire-dtype", "float32", "--threads", "2", "--announce-ttl", "9"),
    *("--session-idle", "8", "--connection-idle", "7", "--grace", "6", "--link-policy", "fifo"),
    *("--link-max-wait", "5", "--link-prefill-order", "arrival", "--link-inflight-gain", "1.5"),
    *("--link-inflight-floor-chunks", "3", "--link-pacing", "on", "--link-pace-slow-ms", "20"),
    *("--link-pace-lead-ms", "5", "--link-min-chunk-ms", "4", "--prefill-pass-tokens", "48"),
    *("--prefill-min-pass-tokens", "16", "--prefill-gather-ms", "250", "--compute-lanes", "1"),
    *("--prefill-nice", "4", "--prefill-compute-order", "round-robin", "--weights", "int8"),
]


def test_every_flag_reaches_its_field_with_durations_in_seconds():
    c = parse_args(["--layers", "2:5", *EVERY_FLAG])
    assert (c.start, c.end, c.model, c.initial_peers) == (
        2,
        5,
        "m.gguf",
        ("/ip4/1.2.3.4/tcp/1/p2p/Qm",),
    )
    assert (c.host, c.port, c.public_address, c.dht_host, c.dht_nice) == (
        "0.0.0.0",
        7000,
        "h:1",
        "0.0.0.0",
        5,
    )
    assert (c.wire_dtype, c.threads, c.weights) == ("float32", 2, "int8")
    lim = c.limits
    assert (lim.max_sessions, lim.max_cache_tokens, lim.max_session_tokens, lim.max_frame) == (
        3,
        900,
        300,
        4096,
    )
    assert (lim.announce_ttl_s, lim.session_idle_s, lim.connection_idle_s, lim.grace_s) == (
        9,
        8,
        7,
        6,
    )
    link = c.link
    assert (link.policy, link.max_wait, link.prefill_order, link.inflight_gain) == (
        "fifo",
        5,
        "arrival",
        1.5,
    )
    assert (link.inflight_floor_chunks, link.pacing) == (3, "on")
    assert (link.pace_slow_s, link.pace_lead_s, link.min_chunk_s) == pytest.approx(
        (0.020, 0.005, 0.004)
    )
    comp = c.compute
    assert (comp.pass_tokens, comp.min_pass_tokens, comp.lanes, comp.prefill_nice) == (48, 16, 1, 4)
    assert comp.gather_s == pytest.approx(0.25) and comp.prefill_order == "round-robin"


def test_the_tuning_knobs_have_their_own_help_section(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    sections = capsys.readouterr().out.split("\nnode:")[1]  # past the usage line
    basics, tuning = sections.split("tuning (experiments")
    assert "--layers" in basics and "--max-sessions" in basics
    for flag in ("--link-policy", "--link-pace-lead-ms", "--prefill-gather-ms", "--dht-nice"):
        assert flag in tuning and flag not in basics


def test_a_record_ttl_the_swarm_would_refuse_is_an_error(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--layers", "0:10", "--announce-ttl", "3600"])
    assert "--announce-ttl" in capsys.readouterr().err
    assert parse_args(["--layers", "0:10", "--announce-ttl", "300"]).limits.announce_ttl_s == 300
