"""Fuzz a live tiny-model node over its socket while a legitimate session generates beside it.

Starts two nodes (blocks 0:3 and 3:6 of a random tiny Llama) and throws N random cases at the
first: random bytes, random msgpack, mutated valid messages, bit-flipped frames, huge length
prefixes, truncations, bad tensors on the attacker's own session, bad opens and attaches, and
steps naming the legitimate session's id. Each case is one connection: optional set-up (an own
session), the hostile bytes, then end-of-stream; the node must answer or close. Meanwhile a
client generates greedily, session after session, and checks every token against the unsplit
model. A node that dies or stops answering pings is a crash: the script prints the case, the
node's last error line, and the hex to replay it, then starts fresh nodes and goes on.

  .venv/bin/python scripts/fuzz_node.py --cases 5000 [--seed 1] [--skip-known]

--skip-known leaves out inputs that trigger the crashes already reported, to look past them.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import re
import socket
import struct
import subprocess
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import msgpack
import torch
from bench.proc import memory

from devtools.launch import NodeProcess, start_node, stop_all
from swarm.client.client import Client
from swarm.model.source import open_model
from swarm.model.tiny import TINY, reference_greedy, save_tiny_llama
from swarm.protocol import Attach, Close, Hop, Open, Ping, Step, to_wire
from swarm.wire import DEFAULT_MAX_FRAME, FrameDecoder, encode_frame, pack_tensor

MIB = 1024 * 1024

HIDDEN = TINY["hidden_size"]
SPANS = [(0, 3), (3, 6)]
IDLE = 2.0
EXTRA = [
    "--plaintext",  # the fuzzer writes raw frames; TLS's own hostile cases: tests/test_tls.py
    "--weights",
    "float32",
    "--wire-dtype",
    "float32",
    "--announce-ttl",
    "10",
    "--connection-idle",
    str(IDLE),
]
KINDS = ["open", "opened", "attach", "attached", "step", "result", "close", "ping", "pong"]
KINDS += ["error", "", "STEP", None, 1]
BAD_HOSTS = ["a..b", "x" * 70 + ".example", "\u00e9" * 64, ".", "-", "", "127.0.0.1:1", "::"]


# ---- cases ----------------------------------------------------------------------------------


@dataclass
class Case:
    kind: str
    frames: bytes  # sent in one write after the set-up, then end-of-stream
    setup: str = "none"  # "none", "session" (own, attached) or "unattached" (own, no attach)
    sid: str = ""
    sink_token: str = "s" * 32
    note: str = ""

    def reproducer(self) -> dict:
        return {
            "kind": self.kind,
            "note": self.note,
            "setup": self.setup,
            "sid": self.sid,
            "sink_token": self.sink_token,
            "bytes_hex": self.frames.hex(),
        }


def frame_of(body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + body


def pack(obj) -> bytes:
    return frame_of(msgpack.packb(obj, use_bin_type=True))


class Cases:
    """Random hostile cases against the node at `addr`; `legit_sid()` names the victim session."""

    def __init__(
        self,
        rng: random.Random,
        addr: tuple[str, int],
        peer: str,
        fingerprint: str,
        legit_sid: Callable[[], str],
    ):
        self.rng, self.addr, self.peer = rng, addr, peer
        self.fingerprint, self.legit_sid = fingerprint, legit_sid
        self.makers = [
            (self.random_bytes, 8),
            (self.random_msgpack, 12),
            (self.mutated_message, 20),
            (self.flipped_bits, 8),
            (self.huge_prefix, 4),
            (self.truncated, 6),
            (self.bad_step, 20),
            (self.bad_open, 8),
            (self.bad_attach, 6),
            (self.foreign, 8),
        ]

    def only(self, kinds: list[str]) -> None:
        self.makers = [(m, w) for m, w in self.makers if m.__name__ in kinds]

    def next(self) -> Case:
        makers, weights = zip(*self.makers)
        return self.rng.choices(makers, weights)[0]()

    # random values ---------------------------------------------------------------------------

    def value(self, depth: int = 0):
        r = self.rng
        choice = r.randrange(12 if depth < 3 else 9)
        if choice == 0:
            return None
        if choice == 1:
            return r.choice([True, False])
        if choice == 2:
            return r.choice([0, 1, -1, 2**31, 2**32, 2**63 - 1, -(2**63), 2**64 - 1])
        if choice == 3:
            return r.randint(-1000, 1000)
        if choice == 4:
            return r.choice([0.0, -0.0, 1.5, float("nan"), float("inf"), -float("inf"), 1e308])
        if choice == 5:
            return "".join(
                r.choice("ab\u00e9\u4e2d\U0001f600 \x00.:") for _ in range(r.randrange(12))
            )
        if choice == 6:
            return r.randbytes(r.randrange(20))
        if choice == 7:
            return r.choice(["float32", "float16", "bfloat16", "prefill", "decode", "x" * 300])
        if choice == 8:
            return msgpack.ExtType(r.randrange(128), r.randbytes(r.randrange(8)))
        if choice == 9:
            return [self.value(depth + 1) for _ in range(r.randrange(5))]
        if choice == 10:
            return [1, r.randrange(0, 20), HIDDEN]  # shape-like
        return {self.key(): self.value(depth + 1) for _ in range(r.randrange(5))}

    def key(self):
        r = self.rng
        names = ["t", "sid", "route", "hop", "pos", "end", "phase", "hidden", "dtype", "shape"]
        names += ["data", "nonce", "sink_token", "max_length", "fingerprint", "wire_dtype"]
        return r.choice(names) if r.random() < 0.7 else r.choice(["", "x", "\u00e9"]) * 2

    def tensor(self, tokens: int, dtype: str = "float32") -> dict:
        return pack_tensor(torch.randn(1, tokens, HIDDEN), dtype)

    def valid_message(self, sid: str) -> dict:
        r = self.rng
        host, port = self.addr
        tokens = r.randrange(1, 5)
        msg = r.choice(
            [
                Step(sid=sid, phase="prefill", pos=0, end=tokens, hidden=self.tensor(tokens)),
                Open(
                    sid=sid,
                    route=(Hop(host, port, 0, 3, self.peer),),
                    hop=0,
                    fingerprint=self.fingerprint,
                    wire_dtype="float32",
                    max_length=16,
                    sink_token="s" * 32,
                ),
                Attach(sid=sid, sink_token="s" * 32),
                Close(sid=sid),
                Ping(nonce=r.randrange(2**63)),
            ]
        )
        return to_wire(msg)

    def mutate(self, msg: dict) -> tuple[dict, str]:
        r = self.rng
        how = r.randrange(6)
        name = r.choice(sorted(msg))
        if how == 0:
            msg[name] = self.value()
            return msg, f"{name} = random"
        if how == 1:
            del msg[name]
            return msg, f"no {name}"
        if how == 2:
            msg[self.key()] = self.value()
            return msg, "extra field"
        if how == 3:
            msg["t"] = r.choice(KINDS)
            return msg, f"t = {msg['t']!r}"
        if how == 4 and isinstance(msg.get("hidden"), dict):
            sub = r.choice(["dtype", "shape", "data"])
            msg["hidden"][sub] = self.value()
            return msg, f"hidden.{sub} = random"
        if how == 5 and isinstance(msg.get("route"), list):
            hop = list(msg["route"][0])
            hop[r.randrange(5)] = self.value()
            msg["route"] = [hop] * r.choice([1, 1, 2, 64, 65])
            return msg, "route mangled"
        msg[name] = self.value()
        return msg, f"{name} = random"

    # the case kinds -------------------------------------------------------------------------

    def random_bytes(self) -> Case:
        n = self.rng.choice([0, 1, 2, 3, 4, 5, 8, 16, 64, 1024, 65536])
        return Case("random bytes", self.rng.randbytes(n), note=f"{n} bytes")

    def random_msgpack(self) -> Case:
        r = self.rng
        if r.random() < 0.5:
            obj = {
                "t": r.choice(KINDS),
                **{self.key(): self.value() for _ in range(r.randrange(6))},
            }
        else:
            obj = self.value()
        try:
            return Case("random msgpack", pack(obj))
        except (TypeError, ValueError, OverflowError):
            return Case("random msgpack", pack([repr(obj)]))

    def mutated_message(self) -> Case:
        msg, note = self.mutate(self.valid_message(os.urandom(16).hex()))
        return Case("mutated message", pack(msg), note=note)

    def flipped_bits(self) -> Case:
        r = self.rng
        frame = bytearray(pack(self.valid_message(os.urandom(16).hex())))
        for _ in range(r.randrange(1, 6)):
            i = r.randrange(4, len(frame))  # the body only: the prefix stays true
            frame[i] ^= 1 << r.randrange(8)
        return Case("flipped bits", bytes(frame))

    def huge_prefix(self) -> Case:
        n = self.rng.choice([DEFAULT_MAX_FRAME + 1, 2**31, 2**32 - 1])
        n = self.rng.choice([n, self.rng.randrange(DEFAULT_MAX_FRAME + 1, 2**32)])
        return Case("huge prefix", struct.pack(">I", n) + self.rng.randbytes(8), note=str(n))

    def truncated(self) -> Case:
        frame = pack(self.valid_message(os.urandom(16).hex()))
        cut = self.rng.randrange(1, len(frame))
        return Case("truncated frame", frame[:cut], note=f"{cut} of {len(frame)} bytes")

    def bad_step(self) -> Case:
        """A step on the attacker's own, attached session: bad tensors, positions, phases."""
        r = self.rng
        sid = os.urandom(16).hex()
        tokens = r.randrange(1, 5)
        hidden = self.tensor(tokens, r.choice(["float32", "float16", "bfloat16"]))
        step = {"t": "step", "sid": sid, "phase": "prefill", "pos": 0, "end": tokens}
        how = r.randrange(7)
        if how == 0:
            hidden[r.choice(["dtype", "shape", "data"])] = self.value()
            note = "tensor field random"
        elif how == 1:
            t = torch.randn(1, tokens, HIDDEN)
            t.view(-1)[r.randrange(t.numel())] = r.choice([float("nan"), float("inf"), -1e30])
            hidden = pack_tensor(t, r.choice(["float32", "float16", "bfloat16"]))
            note = "non-finite value"
        elif how == 2:
            hidden["data"] = hidden["data"][: r.randrange(len(hidden["data"]))]
            note = "short data"
        elif how == 3:
            hidden["shape"] = [r.choice([0, 1, 2]), r.randrange(-1, 40), r.choice([63, 64, 65])]
            note = f"shape {hidden['shape']}"
        elif how == 4:
            step.update(pos=r.choice([0, 1, 5, 2**31]), end=r.choice([0, 1, 4, 16, 17, 2**31]))
            step["phase"] = r.choice(["prefill", "decode"])
            note = f"{step['phase']} {step['pos']}:{step['end']}"
        elif how == 5:
            step, note = self.mutate(step)
        else:
            note = "valid, then replayed"
        step["hidden"] = hidden
        frames = pack(step) * (2 if how == 6 else r.choice([1, 1, 2]))
        return Case("bad step", frames, setup="session", sid=sid, note=note)

    def bad_open(self) -> Case:
        """Opens with odd routes: unusable next hops, loops back here, bad spans and sizes."""
        r = self.rng
        host, port = self.addr
        me = [host, port, 0, 3, self.peer]
        nxt = [r.choice(BAD_HOSTS + [host, "localhost"]), r.choice([1, 9, port, 70000, -1]), 3]
        nxt += [6, ""]
        route = r.choice([[me, nxt], [me, me], [me, me, me], [nxt, me], [me]])
        msg = {
            "t": "open",
            "sid": os.urandom(16).hex(),
            "route": route,
            "hop": r.choice([0, 0, 1]),
            "fingerprint": self.fingerprint,
            "wire_dtype": r.choice(["float32", "", "int8"]),
            "max_length": r.choice([1, 16, 8192, 8193, 1 << 20]),
            "sink_token": "s" * 32,
        }
        note = f"route {route}"
        if r.random() < 0.3:
            msg, more = self.mutate(msg)
            note += f", {more}"
        return Case("bad open", pack(msg), note=note)

    def bad_attach(self) -> Case:
        """Attach to an own unattached session with the wrong or an odd token."""
        r = self.rng
        sid = os.urandom(16).hex()
        token = r.choice(["", "s" * 31, "t" * 32, "\u00f1" * 32, "s" * 32 + "\u00e9", "s" * 32])
        opened_with = r.choice(["s" * 32, "s" * 32, "\u00f1" * 8])
        target = r.choice([sid, sid, self.legit_sid() or sid, os.urandom(16).hex()])
        return Case(
            "bad attach",
            pack({"t": "attach", "sid": target, "sink_token": token}),
            setup="unattached",
            sid=sid,
            sink_token=opened_with,
            note=f"opened with {opened_with!r}, attach {token!r}",
        )

    def foreign(self) -> Case:
        """Steps, closes and opens naming the legitimate session from another connection."""
        r = self.rng
        sid = self.legit_sid() or os.urandom(16).hex()
        pos = r.randrange(0, 40)
        msg = r.choice(
            [
                {"t": "step", "sid": sid, "phase": "decode", "pos": pos, "end": pos + 1},
                {"t": "close", "sid": sid},
                self.valid_message(sid),
            ]
        )
        if msg["t"] == "step":
            msg["hidden"] = self.tensor(1)
        return Case("foreign session id", pack(msg), note=msg["t"])


def known_crash(case: Case) -> bool:
    """Inputs that hit the node crashes already reported (see the report of this script)."""
    decoder = FrameDecoder(DEFAULT_MAX_FRAME)
    try:
        decoder.feed(case.frames)
        messages = []
        while (m := decoder.next_message()) is not None:
            messages.append(m)
    except Exception:
        return False
    if not case.sink_token.isascii():
        return True
    for m in messages:
        hidden = m.get("hidden")
        if isinstance(hidden, dict) and isinstance(hidden.get("dtype"), list | dict):
            return True  # wire.unpack_tensor: unhashable dtype -> TypeError
        token = m.get("sink_token")
        if m.get("t") == "attach" and isinstance(token, str) and not token.isascii():
            return True  # node._attach: compare_digest on non-ASCII str -> TypeError
        route = m.get("route")
        if m.get("t") == "open" and isinstance(route, list):
            for hop in route:
                if isinstance(hop, list) and hop and isinstance(hop[0], str):
                    try:
                        hop[0].encode("idna")
                    except UnicodeError:
                        return True  # node._open: UnicodeError from getaddrinfo
    return False


# ---- running a case -------------------------------------------------------------------------


def read_frames(sock: socket.socket, decoder: FrameDecoder, until: Callable[[dict], bool]):
    """Frames until one satisfies `until`; None at end of stream."""
    while True:
        msg = decoder.next_message()
        if msg is not None:
            if until(msg):
                return msg
            continue
        data = sock.recv(65536)
        if not data:
            return None
        decoder.feed(data)


def run_case(case: Case, addr: tuple[str, int], peer: str, fingerprint: str) -> str:
    """'error:<code>...', 'reply:<t>' or 'closed' for what the node did; 'silent' if nothing."""
    host, port = addr
    seen: list[str] = []
    try:
        with socket.create_connection(addr, timeout=15) as sock:
            decoder = FrameDecoder(DEFAULT_MAX_FRAME)
            if case.setup != "none":
                open_ = Open(
                    sid=case.sid,
                    route=(Hop(host, port, 0, 3, peer),),
                    hop=0,
                    fingerprint=fingerprint,
                    wire_dtype="float32",
                    max_length=16,
                    sink_token=case.sink_token,
                )
                sock.sendall(encode_frame(to_wire(open_)))
                reply = read_frames(sock, decoder, lambda m: m.get("t") in ("opened", "error"))
                if reply is None or reply["t"] != "opened":
                    return f"set-up failed: {reply}"
                if case.setup == "session":
                    attach = Attach(sid=case.sid, sink_token=case.sink_token)
                    sock.sendall(encode_frame(to_wire(attach)))
                    read_frames(sock, decoder, lambda m: m.get("t") in ("attached", "error"))
            sock.sendall(case.frames)
            sock.shutdown(socket.SHUT_WR)
            while True:
                msg = read_frames(sock, decoder, lambda m: True)
                if msg is None:
                    break
                seen.append(f"error:{msg.get('code')}" if msg.get("t") == "error" else msg["t"])
    except TimeoutError:
        return "silent" if not seen else "silent after " + ",".join(seen)
    except ConnectionRefusedError:
        return "refused"
    except (ConnectionResetError, BrokenPipeError):
        pass  # the node dropped us mid-write: also a close
    except Exception as exc:  # a frame from the node we cannot decode is a finding too
        return f"bad reply: {type(exc).__name__}: {exc}"
    return ",".join(seen[:3]) + (",closed" if seen else "closed")


def answers_ping(addr: tuple[str, int], timeout: float = 10.0) -> bool:
    try:
        with socket.create_connection(addr, timeout=timeout) as sock:
            sock.sendall(encode_frame(to_wire(Ping(nonce=7))))
            reply = read_frames(sock, FrameDecoder(4096), lambda m: True)
            return reply is not None and reply.get("t") == "pong"
    except Exception:
        return False


def alive(node: NodeProcess, addr: tuple[str, int]) -> bool:
    """Answers a ping; a miss is retried once, so a busy moment is not a crash."""
    if node.proc.poll() is not None:
        return False
    return answers_ping(addr, 5) or (time.sleep(1) is None and answers_ping(addr, 10))


def wait_exit(node: NodeProcess, timeout: float) -> bool:
    """Whether the node process has exited within `timeout` (a dying node takes a moment)."""
    try:
        node.proc.wait(timeout)
        return True
    except subprocess.TimeoutExpired:
        return False


def last_error_line(log: Path) -> str:
    """The exception that ended the node, from the bottom of its stderr."""
    pattern = re.compile(r"^[\s|]*((?:[\w.]+\.)?\w*(?:Error|Exception|Exit))\b:?\s*(.*)$")
    for line in reversed(log.read_text(errors="replace").splitlines()):
        m = pattern.match(line)
        if m and "ExceptionGroup" not in m.group(1):
            return f"{m.group(1)}: {m.group(2)}".strip(": ")
    return "(no traceback in stderr)"


# ---- the legitimate session -----------------------------------------------------------------


class Legit(threading.Thread):
    """Greedy sessions back to back until stopped; each checked against the unsplit model."""

    def __init__(self, client: Client, reference, seed: int, new_tokens: int = 16):
        super().__init__(daemon=True)
        self.client, self.reference, self.new_tokens = client, reference, new_tokens
        self.rng = random.Random(seed)
        self.stop = threading.Event()
        self.sid = ""
        self.correct = self.wrong = self.tokens = 0
        self.rerouted = 0
        self.failure: str | None = None
        self.first_done = threading.Event()

    def run(self) -> None:
        try:
            while not self.stop.is_set():
                prompt = [self.rng.randrange(3, 500) for _ in range(self.rng.randrange(3, 12))]
                out = []
                with self.client.session(len(prompt) + self.new_tokens) as s:
                    logits = s.feed(prompt)
                    self.sid = s.remote.sid
                    for _ in range(self.new_tokens):
                        out.append(int(logits.argmax()))
                        logits = s.feed([out[-1]])
                    self.rerouted += len(s.recoveries)
                self.tokens += len(out)
                if out == reference_greedy(self.reference, prompt, self.new_tokens):
                    self.correct += 1
                else:
                    self.wrong += 1
                self.first_done.set()
        except Exception as exc:
            self.failure = f"{type(exc).__name__}: {exc}"
        finally:
            self.first_done.set()


# ---- epochs: a fresh pair of nodes, run until done or a crash -----------------------------------


@dataclass
class Epoch:
    nodes: list[NodeProcess]
    logs: list[Path]
    client: Client
    legit: Legit
    rss_before: float = 0.0


@dataclass
class Tally:
    cases: int = 0
    skipped: int = 0
    outcomes: Counter = field(default_factory=Counter)
    kinds: Counter = field(default_factory=Counter)
    crashes: list[dict] = field(default_factory=list)
    silent: list[dict] = field(default_factory=list)
    legit_correct: int = 0
    legit_wrong: int = 0
    legit_tokens: int = 0
    legit_rerouted: int = 0
    legit_failures: list[str] = field(default_factory=list)
    rss: list[tuple[float, float]] = field(default_factory=list)
    seconds: float = 0.0
    epochs: int = 0
    work: Path = Path(".")


def start_epoch(model_dir: str, reference, work: Path, n: int, seed: int) -> Epoch:
    logs = [work / f"epoch{n}-node{i}.stderr" for i in range(len(SPANS))]
    nodes: list[NodeProcess] = []
    try:
        for i, span in enumerate(SPANS):
            peers = nodes[0].maddrs[:1] if nodes else ()
            with open(logs[i], "w") as f:
                nodes.append(start_node(span, peers, model=model_dir, extra=EXTRA, stderr=f))
            nodes[-1].wait_serving()
        client = Client(nodes[0].maddrs[:1], model=model_dir, wire_dtype="float32", plaintext=True)
    except BaseException:
        stop_all(nodes)
        raise
    legit = Legit(client, reference, seed)
    legit.start()
    legit.first_done.wait(120)
    return Epoch(nodes, logs, client, legit, memory(nodes[0].pid)["VmRSS"] / MIB)


def end_epoch(epoch: Epoch, tally: Tally, crashed: bool) -> None:
    epoch.legit.stop.set()
    epoch.legit.join(120 if not crashed else 30)
    if epoch.nodes[0].proc.poll() is None:
        tally.rss.append((epoch.rss_before, memory(epoch.nodes[0].pid)["VmRSS"] / MIB))
    lg = epoch.legit
    tally.legit_correct += lg.correct
    tally.legit_wrong += lg.wrong
    tally.legit_tokens += lg.tokens
    tally.legit_rerouted += lg.rerouted
    if lg.failure and not crashed:
        tally.legit_failures.append(lg.failure)
    epoch.client.close()
    stop_all(epoch.nodes)


def fuzz(a: argparse.Namespace) -> Tally:
    work = Path(tempfile.mkdtemp(prefix="fuzz-node-"))
    model_dir = str(work / "tiny-llama")
    reference = save_tiny_llama(model_dir)
    fingerprint = open_model(model_dir).fingerprint()
    rng = random.Random(a.seed)
    tally = Tally()
    epochs = 0
    t0 = time.monotonic()
    while tally.cases < a.cases and len(tally.crashes) < a.max_crashes:
        epochs += 1
        epoch = start_epoch(model_dir, reference, work, epochs, a.seed + epochs)
        first = epoch.nodes[0]
        host, _, port = first.addr.rpartition(":")
        addr = (host, int(port))
        cases = Cases(rng, addr, first.peer, fingerprint, lambda e=epoch: e.legit.sid)
        if a.kinds:
            cases.only(a.kinds)
        crashed = False
        while tally.cases < a.cases:
            case = cases.next()
            if a.skip_known and known_crash(case):
                tally.skipped += 1
                continue
            outcome = run_case(case, addr, first.peer, fingerprint)
            tally.cases += 1
            tally.kinds[case.kind] += 1
            if tally.cases % a.ping_every == 0 and not alive(first, addr):
                died = wait_exit(first, 20)
                crash = {
                    "case_number": tally.cases,
                    "how": "process died" if died else "stopped answering pings",
                    "exit_code": first.proc.poll(),
                    "error": last_error_line(epoch.logs[0]),
                    **case.reproducer(),
                }
                tally.crashes.append(crash)
                print(
                    f"  crash #{len(tally.crashes)} at case {tally.cases}: {crash['how']},"
                    f" {crash['error']} <- {case.kind} ({case.note[:100]})",
                    flush=True,
                )
                crashed = True
                break
            tally.outcomes[outcome.split(",")[0]] += 1
            if outcome.startswith(("silent", "bad reply", "set-up failed")):
                tally.silent.append({"outcome": outcome, **case.reproducer()})
            if tally.cases % 1000 == 0:
                print(
                    f"  {tally.cases} cases, {time.monotonic() - t0:.0f} s,"
                    f" node RSS {memory(first.pid)['VmRSS'] / MIB:.1f} MiB",
                    flush=True,
                )
        alive_at_end = not crashed and answers_ping(addr)
        if not crashed and not alive_at_end:
            tally.crashes.append({"case_number": tally.cases, "how": "no ping at the end"})
        end_epoch(epoch, tally, crashed)
    tally.seconds = time.monotonic() - t0
    tally.epochs = epochs
    tally.work = work
    return tally


def report(tally: Tally, a: argparse.Namespace) -> None:
    legit_ok = tally.legit_wrong == 0 and not tally.legit_failures and tally.legit_correct > 0
    print()
    print(
        f"cases run: {tally.cases} in {tally.seconds:.0f} s"
        f" (seed {a.seed}, {tally.epochs} node starts)"
    )
    if tally.cases < a.cases:
        print(f"stopped early: {len(tally.crashes)} crashes (--max-crashes {a.max_crashes})")
    if a.skip_known:
        print(f"cases skipped as known crashers: {tally.skipped}")
    print("cases by kind: " + ", ".join(f"{k} {n}" for k, n in tally.kinds.most_common()))
    print("node answers:  " + ", ".join(f"{k} {n}" for k, n in tally.outcomes.most_common()))
    signatures = Counter(c.get("error", c["how"]) for c in tally.crashes)
    print(f"node crashes found: {len(tally.crashes)} ({len(signatures)} distinct)")
    for sig, n in signatures.most_common():
        c = next(c for c in tally.crashes if c.get("error", c["how"]) == sig)
        print(f"  {n} x {sig}")
        print(f"     first at case {c['case_number']}: {c.get('kind')} ({c.get('note')})")
        print(f"     set-up {c.get('setup')!r}, then send hex {c.get('bytes_hex', '')[:160]}")
    print(f"unanswered cases (no error, no close): {len(tally.silent)}")
    for s in tally.silent[:5]:
        print(f"  {s['outcome']}: {s['kind']} ({s['note']}) hex {s['bytes_hex'][:120]}")
    print(
        f"legit session correct: {'yes' if legit_ok else 'no'} ({tally.legit_correct} sessions,"
        f" {tally.legit_tokens} tokens matched the unsplit model, {tally.legit_wrong} wrong,"
        f" {tally.legit_rerouted} reroutes"
        + (f", failures: {tally.legit_failures}" if tally.legit_failures else "")
        + ")"
    )
    for i, (before, after) in enumerate(tally.rss):
        print(f"node RSS (run {i + 1}): before {before:.1f} MiB, after {after:.1f} MiB")
    out = tally.work / "crashes.json"
    out.write_text(json.dumps({"crashes": tally.crashes, "unanswered": tally.silent}, indent=1))
    print(f"reproducers: {out}")


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--cases", type=int, default=5000)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument(
        "--ping-every",
        type=int,
        default=1,
        help="cases between liveness pings (1: find the culprit)",
    )
    p.add_argument("--max-crashes", type=int, default=10, help="stop after this many crashes")
    p.add_argument(
        "--skip-known", action="store_true", help="leave out inputs of the crashes reported"
    )
    p.add_argument(
        "--kinds",
        nargs="*",
        default=[],
        help="only these case makers (random_bytes, random_msgpack, mutated_message,"
        " flipped_bits, huge_prefix, truncated, bad_step, bad_open, bad_attach, foreign)",
    )
    a = p.parse_args()
    logging.getLogger("swarm.client").setLevel(logging.ERROR)  # reroutes after a crash: known
    report(fuzz(a), a)


if __name__ == "__main__":
    main()
