"""Data-plane addresses: the one parser for "host:port" (a record's addr, a route hop, a flag)."""

from __future__ import annotations

import ipaddress


def parse_host_port(text: str, *, any_port: bool = False) -> tuple[str, int]:
    """Split "host:port" or "[v6]:port" into (host, port); raise ValueError on anything else.

    The port must be 1-65535, or 0 as well with `any_port` (a listener asking for any free port).
    The last colon splits, so an unbracketed IPv6 host ("::1:7000") parses too.
    """
    host, sep, port = text.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not (port.isascii() and port.isdigit()):
        raise ValueError(f"address {text[:80]!r} is not host:port")
    number = int(port)
    if not (0 if any_port else 1) <= number <= 65535:
        raise ValueError(f"address {text[:80]!r} has port {number}, outside 1-65535")
    return host, number


def join_host_port(host: str, port: int) -> str:
    """The inverse of parse_host_port: brackets an IPv6 host."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def source_host(sockaddr) -> str:
    """The address a connection is counted under: its IPv4 address, or its IPv6 /64."""
    try:
        ip = ipaddress.ip_address(sockaddr[0].split("%")[0])
    except (ValueError, IndexError, TypeError, AttributeError):
        return "?"
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network((ip, 64), strict=False))
    return str(ip)
