"""What the Linux kernel knows about a TCP connection, and how much unsent data it may hold.

`read_tcp_info` parses `struct tcp_info` (linux/tcp.h) from getsockopt(TCP_INFO). Fields newer than
the running kernel are None. Off Linux it returns None and callers fall back to app-level samples.

`set_notsent_lowat` caps the bytes a socket keeps queued but not yet sent: a write then completes
when its bytes have nearly left the host, not when they entered a multi-megabyte send buffer, so
a decode step queued after a prefill chunk waits behind at most ~lowat bytes in the kernel.
"""

from __future__ import annotations

import socket
import struct
import sys
from dataclasses import dataclass

# linux/tcp.h; Python only exposes the name on builds whose headers had it
TCP_NOTSENT_LOWAT = getattr(socket, "TCP_NOTSENT_LOWAT", 25 if sys.platform == "linux" else None)
TCP_INFO = getattr(socket, "TCP_INFO", None) if sys.platform == "linux" else None
TCP_INFO_BUFFER = 256

_U8 = struct.Struct("=B")
_U32 = struct.Struct("=I")
_U64 = struct.Struct("=Q")

# Byte offsets in struct tcp_info, in header order: u8 x8, u32 x24 (to total_retrans at 100),
# then u64 pacing_rate at 104 ...; the struct is naturally aligned, so no padding appears.
_OFF_STATE = 0
_OFF_APP_LIMITED = 7  # bit 0: tcpi_delivery_rate_app_limited (first bit-field, little-endian ABI)
_OFF_RTO = 8
_OFF_SND_MSS = 16
_OFF_UNACKED = 24
_OFF_LOST = 32
_OFF_RETRANS = 36
_OFF_RTT = 68
_OFF_RTTVAR = 72
_OFF_SND_CWND = 80
_OFF_TOTAL_RETRANS = 100
_OFF_PACING_RATE = 104
_OFF_BYTES_ACKED = 120
_OFF_NOTSENT = 144
_OFF_MIN_RTT = 148
_OFF_DELIVERY_RATE = 160
_OFF_BUSY_TIME = 168
_OFF_RWND_LIMITED = 176
_OFF_SNDBUF_LIMITED = 184
_OFF_BYTES_SENT = 200


@dataclass(frozen=True)
class TcpInfo:
    """A snapshot of one connection. Times in seconds, rates in bytes per second."""

    state: int
    rto_s: float
    snd_mss: int
    unacked: int  # segments in flight
    lost: int
    retrans: int
    rtt_s: float  # kernel's smoothed RTT
    rttvar_s: float
    snd_cwnd: int  # segments
    total_retrans: int
    pacing_rate_Bps: int | None
    bytes_acked: int | None
    notsent_bytes: int | None
    min_rtt_s: float | None
    delivery_rate_Bps: int | None
    delivery_rate_app_limited: bool
    busy_time_s: float | None
    rwnd_limited_s: float | None
    sndbuf_limited_s: float | None
    bytes_sent: int | None


def parse_tcp_info(raw: bytes) -> TcpInfo:
    """Decode the bytes of getsockopt(IPPROTO_TCP, TCP_INFO); older kernels return fewer."""
    if len(raw) < _OFF_TOTAL_RETRANS + 4:
        raise ValueError(f"tcp_info of {len(raw)} bytes is too short to hold the RTT fields")

    def u32(off: int) -> int:
        return _U32.unpack_from(raw, off)[0]

    def u32_opt(off: int) -> int | None:
        return _U32.unpack_from(raw, off)[0] if len(raw) >= off + 4 else None

    def u64_opt(off: int) -> int | None:
        return _U64.unpack_from(raw, off)[0] if len(raw) >= off + 8 else None

    def usec(value: int | None) -> float | None:
        return None if value is None else value / 1e6

    return TcpInfo(
        state=_U8.unpack_from(raw, _OFF_STATE)[0],
        rto_s=u32(_OFF_RTO) / 1e6,
        snd_mss=u32(_OFF_SND_MSS),
        unacked=u32(_OFF_UNACKED),
        lost=u32(_OFF_LOST),
        retrans=u32(_OFF_RETRANS),
        rtt_s=u32(_OFF_RTT) / 1e6,
        rttvar_s=u32(_OFF_RTTVAR) / 1e6,
        snd_cwnd=u32(_OFF_SND_CWND),
        total_retrans=u32(_OFF_TOTAL_RETRANS),
        pacing_rate_Bps=u64_opt(_OFF_PACING_RATE),
        bytes_acked=u64_opt(_OFF_BYTES_ACKED),
        notsent_bytes=u32_opt(_OFF_NOTSENT),
        min_rtt_s=usec(u32_opt(_OFF_MIN_RTT)),
        delivery_rate_Bps=u64_opt(_OFF_DELIVERY_RATE),
        delivery_rate_app_limited=bool(_U8.unpack_from(raw, _OFF_APP_LIMITED)[0] & 1),
        busy_time_s=usec(u64_opt(_OFF_BUSY_TIME)),
        rwnd_limited_s=usec(u64_opt(_OFF_RWND_LIMITED)),
        sndbuf_limited_s=usec(u64_opt(_OFF_SNDBUF_LIMITED)),
        bytes_sent=u64_opt(_OFF_BYTES_SENT),
    )


def read_tcp_info(sock: socket.socket) -> TcpInfo | None:
    """The kernel's view of `sock`, or None where TCP_INFO is not the Linux structure or the
    socket has closed (another task may close a connection between a write and this read)."""
    if TCP_INFO is None:
        return None
    try:
        raw = sock.getsockopt(socket.IPPROTO_TCP, TCP_INFO, TCP_INFO_BUFFER)
    except OSError:
        return None
    return parse_tcp_info(raw)


def set_notsent_lowat(sock: socket.socket, nbytes: int) -> bool:
    """Cap the unsent bytes `sock` holds at about `nbytes`. False where the OS lacks the option."""
    if TCP_NOTSENT_LOWAT is None:
        return False
    if nbytes <= 0:
        raise ValueError(f"notsent lowat must be positive, got {nbytes}")
    sock.setsockopt(socket.IPPROTO_TCP, TCP_NOTSENT_LOWAT, nbytes)
    return True


def get_notsent_lowat(sock: socket.socket) -> int | None:
    """The cap set by `set_notsent_lowat`; 0 when unset (the sysctl default applies), None if
    the OS has no such option."""
    if TCP_NOTSENT_LOWAT is None:
        return None
    return sock.getsockopt(socket.IPPROTO_TCP, TCP_NOTSENT_LOWAT)
