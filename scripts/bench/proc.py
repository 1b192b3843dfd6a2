"""What a process costs (CPU seconds, memory, from /proc) and what it runs on."""

from __future__ import annotations

import os
import platform
from pathlib import Path

# /proc/PID/status fields the benchmarks report, in kB there, in bytes here
MEMORY_FIELDS = ("VmRSS", "RssAnon", "RssFile", "VmHWM")
ISA_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16")


def cpu_seconds(*pids: int, children: bool = False) -> float:
    """User + system CPU seconds of processes `pids` so far, all their threads (and with
    `children`, their live child processes: a node's DHT daemon); a process gone counts 0."""
    total = 0.0
    for pid in pids:
        for p in process_tree(pid) if children else [pid]:
            try:
                fields = Path(f"/proc/{p}/stat").read_text().rpartition(")")[2].split()
            except OSError:
                continue
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime
    return total


def process_tree(pid: int) -> list[int]:
    """`pid` and every live process below it, children of any of its threads (Linux /proc)."""
    out = [pid]
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            kids = [int(k) for k in Path(f"/proc/{pid}/task/{tid}/children").read_text().split()]
        except OSError:
            continue
        for kid in kids:
            out += process_tree(kid)
    return out


def memory(pid: int | str = "self") -> dict[str, int]:
    """VmRSS, RssAnon, RssFile and VmHWM of a process, in bytes (those it has)."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in MEMORY_FIELDS:
            out[key] = int(value.split()[0]) * 1024
    return out


def cpu_name() -> str:
    """The CPU's model name, as /proc/cpuinfo gives it."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def cpu_flags(wanted: tuple[str, ...] = ISA_FLAGS) -> list[str]:
    """Which of `wanted` (the extensions that pick swarm's kernels) this CPU has."""
    from swarm.model.kernels import cpu_flags as have  # the node's own reading of /proc/cpuinfo

    flags = have()
    return [f for f in wanted if f in flags]
