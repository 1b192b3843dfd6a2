"""Compile quantmm.c and attention.c into one shared library per instruction set: `python -m
swarm.model.kernels` (scripts/setup.sh runs it). Needs a C compiler (`cc`, or $CC);
without one, swarm keeps torch's int4/int8 kernels and attention.

A library's name carries a hash of the sources and flags, so a changed source is rebuilt
rather than loaded stale. Libraries go next to the source (`_build/`), or to
~/.cache/swarm/kernels where the package folder is read-only.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

# quantmm.c first: its object code and place in the library stay as they were before
# attention.c and layer.c joined
SOURCES = [Path(__file__).with_name(name) for name in ("quantmm.c", "attention.c", "layer.c")]

# instruction set -> compiler flags, best first; each needs the CPU flags in ISA_CPU_FLAGS
ISA_FLAGS = {
    "avx512vnni": [
        "-mavx2",
        "-mfma",
        "-mf16c",
        "-mavx512f",
        "-mavx512bw",
        "-mavx512vl",
        "-mavx512dq",
        "-mavx512vnni",
    ],
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
}
ISA_CPU_FLAGS = {
    "avx512vnni": {
        "avx2",
        "fma",
        "f16c",
        "avx512f",
        "avx512bw",
        "avx512vl",
        "avx512dq",
        "avx512_vnni",
    },
    "avx2": {"avx2", "fma", "f16c"},
}
COMMON_FLAGS = ["-O3", "-fPIC", "-shared", "-std=gnu11", "-pthread"]


class BuildError(RuntimeError):
    """The C compiler is missing or failed; the message says which and how."""


def compiler() -> str | None:
    cc = os.environ.get("CC", "cc")
    return shutil.which(cc) or shutil.which("gcc") or shutil.which("clang")


def library_name(isa: str) -> str:
    h = hashlib.sha256()
    for source in SOURCES:
        h.update(source.read_bytes())
    h.update(" ".join(COMMON_FLAGS + ISA_FLAGS[isa]).encode())
    return f"quantmm-{isa}-{h.hexdigest()[:12]}.so"


def build_dirs() -> list[Path]:
    return [SOURCES[0].with_name("_build"), Path.home() / ".cache" / "swarm" / "kernels"]


def find(isa: str) -> Path | None:
    """The built library for `isa` if one exists for the current source."""
    name = library_name(isa)
    for d in build_dirs():
        if (d / name).is_file():
            return d / name
    return None


def build(isa: str) -> Path:
    """Compile the library for `isa` (a no-op if it exists) and return its path."""
    if (found := find(isa)) is not None:
        return found
    cc = compiler()
    if cc is None:
        raise BuildError("no C compiler (cc, gcc or clang) on PATH; e.g. apt-get install gcc")
    name, last = library_name(isa), None
    for d in build_dirs():
        try:
            d.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=d, suffix=".so.tmp")
            os.close(fd)
        except OSError as exc:
            last = exc
            continue
        cmd = [cc, *COMMON_FLAGS, *ISA_FLAGS[isa], "-o", tmp, *map(str, SOURCES), "-lm"]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            os.unlink(tmp)
            raise BuildError(f"{' '.join(cmd)} failed:\n{done.stderr.strip()}")
        os.chmod(tmp, 0o755)
        os.replace(tmp, d / name)  # atomic: a process loading it never sees half a file
        for old in d.glob(f"quantmm-{isa}-*.so"):  # builds of earlier sources
            if old.name != name:
                old.unlink(missing_ok=True)
        return d / name
    raise BuildError(f"no writable folder for the kernels ({last})")


def main() -> None:
    failed = False
    for isa in ISA_FLAGS:
        try:
            print(f"swarm kernels ({isa}): {build(isa)}")
        except BuildError as exc:
            print(f"swarm kernels ({isa}) not built: {exc}", file=sys.stderr)
            failed = True
    if failed:
        print("swarm keeps torch's int4/int8 kernels where these are missing", file=sys.stderr)


if __name__ == "__main__":
    main()
