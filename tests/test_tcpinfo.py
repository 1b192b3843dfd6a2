"""TCP_INFO parsing and TCP_NOTSENT_LOWAT, checked against the header layout and real sockets."""

from __future__ import annotations

import ctypes
import socket
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from swarm.link.tcpinfo import (
    get_notsent_lowat,
    parse_tcp_info,
    read_tcp_info,
    set_notsent_lowat,
)

linux_only = pytest.mark.skipif(sys.platform != "linux", reason="TCP_INFO layout is Linux's")

u8, u32, u64 = ctypes.c_uint8, ctypes.c_uint32, ctypes.c_uint64


class LinuxTcpInfo(ctypes.Structure):
    """struct tcp_info transcribed from linux/tcp.h; ctypes works out the offsets."""

    _fields_ = [
        ("state", u8),
        ("ca_state", u8),
        ("retransmits", u8),
        ("probes", u8),
        ("backoff", u8),
        ("options", u8),
        ("wscale", u8),
        ("app_limited_bits", u8),
        *[
            (name, u32)
            for name in (
                "rto ato snd_mss rcv_mss unacked sacked lost retrans fackets last_data_sent"
                " last_ack_sent last_data_recv last_ack_recv pmtu rcv_ssthresh rtt rttvar"
                " snd_ssthresh snd_cwnd advmss reordering rcv_rtt rcv_space total_retrans"
            ).split()
        ],
        ("pacing_rate", u64),
        ("max_pacing_rate", u64),
        ("bytes_acked", u64),
        ("bytes_received", u64),
        ("segs_out", u32),
        ("segs_in", u32),
        ("notsent_bytes", u32),
        ("min_rtt", u32),
        ("data_segs_in", u32),
        ("data_segs_out", u32),
        ("delivery_rate", u64),
        ("busy_time", u64),
        ("rwnd_limited", u64),
        ("sndbuf_limited", u64),
        ("delivered", u32),
        ("delivered_ce", u32),
        ("bytes_sent", u64),
        ("bytes_retrans", u64),
    ]


def test_fields_are_read_at_the_offsets_of_the_linux_header():
    info = LinuxTcpInfo(
        state=1,
        app_limited_bits=1,
        rto=204_000,
        snd_mss=1448,
        unacked=7,
        rtt=31_250,
        rttvar=4_000,
        snd_cwnd=42,
        total_retrans=3,
        pacing_rate=9_000_000,
        bytes_acked=123_456_789,
        notsent_bytes=16_384,
        min_rtt=30_000,
        delivery_rate=625_000,
        busy_time=2_000_000,
        bytes_sent=987_654_321,
    )
    parsed = parse_tcp_info(bytes(info))
    assert (parsed.state, parsed.snd_mss, parsed.unacked, parsed.snd_cwnd) == (1, 1448, 7, 42)
    assert (parsed.rto_s, parsed.rtt_s, parsed.rttvar_s) == (0.204, 0.03125, 0.004)
    assert (parsed.total_retrans, parsed.pacing_rate_Bps) == (3, 9_000_000)
    assert (parsed.bytes_acked, parsed.bytes_sent) == (123_456_789, 987_654_321)
    assert (parsed.notsent_bytes, parsed.min_rtt_s) == (16_384, 0.03)
    assert (parsed.delivery_rate_Bps, parsed.delivery_rate_app_limited) == (625_000, True)
    assert parsed.busy_time_s == 2.0


def test_fields_an_older_kernel_does_not_return_are_none():
    info = LinuxTcpInfo(rtt=31_250, notsent_bytes=5)
    parsed = parse_tcp_info(bytes(info)[: LinuxTcpInfo.min_rtt.offset])
    assert parsed.rtt_s == 0.03125 and parsed.notsent_bytes == 5
    assert parsed.min_rtt_s is None and parsed.delivery_rate_Bps is None


def test_a_buffer_too_short_for_the_rtt_is_refused():
    with pytest.raises(ValueError, match="too short"):
        parse_tcp_info(b"\0" * 40)


@contextmanager
def loopback_pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    with socket.create_server(("127.0.0.1", 0)) as server:
        client = socket.create_connection(server.getsockname())
        peer, _ = server.accept()
    with client, peer:
        yield client, peer


def receive_exactly(sock: socket.socket, n: int) -> None:
    while n:
        n -= len(sock.recv(min(n, 1 << 20)))


@linux_only
def test_a_real_connection_reports_its_rtt_and_bytes_after_traffic():
    with loopback_pair() as (client, peer):
        client.sendall(b"x" * 1_000_000)
        receive_exactly(peer, 1_000_000)
        time.sleep(0.02)  # let the last ACK land
        info = read_tcp_info(client)
    assert info is not None
    assert info.state == 1  # TCP_ESTABLISHED
    assert info.rtt_s > 0
    assert info.bytes_sent == 1_000_000
    assert info.bytes_acked == 1_000_001  # the SYN counts as one
    assert info.notsent_bytes == 0 and info.delivery_rate_Bps > 0


def test_a_closed_socket_has_no_figures_rather_than_an_error():
    """A node's uplink reads TCP_INFO after each write; a peer task may have closed the
    connection in between, and that must not raise (it once took a node down)."""
    with loopback_pair() as (client, _):
        client.close()
        assert read_tcp_info(client) is None


@linux_only
def test_notsent_lowat_is_set_and_read_back():
    with loopback_pair() as (client, _):
        assert get_notsent_lowat(client) == 0  # unset: the sysctl default applies
        assert set_notsent_lowat(client, 16 * 1024)
        assert get_notsent_lowat(client) == 16 * 1024


def fill_until_blocked(sock: socket.socket) -> int:
    """Write to a non-reading peer until the socket stops taking bytes; returns bytes taken."""
    sock.setblocking(False)
    chunk = b"y" * 65536
    taken = 0
    for _ in range(1000):
        try:
            taken += sock.send(chunk)
        except BlockingIOError:
            time.sleep(0.01)  # give in-flight bytes a chance to be ACKed into the peer's buffer
            try:
                taken += sock.send(chunk)
            except BlockingIOError:
                return taken
    raise AssertionError("the socket never stopped taking bytes")


@linux_only
def test_notsent_lowat_bounds_the_bytes_the_kernel_holds_unsent():
    lowat = 16 * 1024
    with loopback_pair() as (default, _peer1), loopback_pair() as (capped, _peer2):
        assert set_notsent_lowat(capped, lowat)
        taken_default = fill_until_blocked(default)
        taken_capped = fill_until_blocked(capped)
        unsent_default = read_tcp_info(default).notsent_bytes
        unsent_capped = read_tcp_info(capped).notsent_bytes
    # the kernel checks the cap before each skb, so it may overshoot by one skb (64 KiB here)
    assert unsent_capped <= lowat + 64 * 1024
    assert unsent_default > 8 * (lowat + 64 * 1024)
    assert taken_capped < taken_default / 4
