"""The node's outbound link: every byte sent downstream leaves through here.

Control frames (open, close, errors, pings) are tiny and go first. Activations are queued as
volumes in the sans-IO LinkScheduler, which decides what goes next and how many tokens of it;
this driver slices the activation on those token boundaries, writes one send at a time, and
feeds the scheduler the link measurements it takes along the way (TCP_INFO, timed writes,
pings). TCP_NOTSENT_LOWAT keeps waiting bytes here, where a decode step can still pass them,
rather than in a multi-megabyte kernel send buffer.

The figures a node announces (`stats`: bandwidth, RTT, ...) are those of its links to next
nodes. A last hop's results go to clients, each over its own connection: the scheduler queues
them under one destination, CLIENTS, and each client connection is measured apart (until it
ends), so one client's slow link neither blends into another's nor into the node's figures;
`stats` gives only their count and medians (`client_links`, `client_rtt_s`,
`client_bandwidth_Bps`).
"""

from __future__ import annotations

import logging
import math
import statistics
import time
import weakref
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import torch
import trio

from swarm.link.estimator import LinkEstimator, SentFrame
from swarm.link.options import LinkOptions
from swarm.link.scheduler import LinkScheduler, Send, Volume
from swarm.link.tcpinfo import read_tcp_info, set_notsent_lowat
from swarm.node.signal import Signal
from swarm.protocol import (
    DECODE,
    PREFILL,
    KvChunk,
    Message,
    Ping,
    Result,
    StateChunk,
    Step,
    to_wire,
)
from swarm.transport import FramedStream
from swarm.wire import encode_frame, pack_tensor, tensor_nbytes

log = logging.getLogger(__name__)

NOTSENT_LOWAT = 16 * 1024
ACK_NONCE_BASE = 1 << 40  # pings that acknowledge delivery; the node's own RTT pings count from 1
# A decode frame asks for an acknowledgement at most this often on a link: on a fast route a
# ping and its pong for every step cost both nodes more than the step's own frame; a decode
# frame's bytes seldom make a bandwidth sample, and a few acknowledgements a second keep the
# round trip measured where TCP_INFO cannot
DECODE_ACK_INTERVAL_S = 0.1
MAX_UNACKED = 4096
HOLD_RECHECK_S = 0.02
MIN_HOLD_S = 0.0005
CLIENTS = "clients"  # where the scheduler queues a last hop's results, whichever the client


@dataclass
class Payload:
    stream: FramedStream
    dest: str
    sid: str
    phase: str
    pos: int
    end: int
    hidden: torch.Tensor  # [1, tokens, hidden] float32
    wire_dtype: str
    result: bool  # last hop: a Result for the client (`stream`; `dest` CLIENTS), not a Step
    # a layer of a cache handed over (KvChunk frames): `hidden` its keys, these its values
    values: torch.Tensor | None = None
    layer: int = -1  # a cache's layer (KV or state), -1 for activations
    part: str = ""  # a Gated DeltaNet state's part (StateChunk frames): `hidden` its rows
    done: trio.Event | None = None  # set once its last byte is written (or it is dropped)
    spec: int | None = None  # a verification round's id (speculative decoding)
    ids: tuple[int, ...] | None = None  # the tokens' ids, where the next hop's layers read them
    picks: tuple[int, ...] | None = None  # a Result's tokens, picked here (hidden [1, n, 0])


class Uplink:
    def __init__(
        self,
        options: LinkOptions,
        on_broken: Callable[[FramedStream, Exception], Awaitable[None]],
        send_timeout: float = 60.0,
    ):
        self.scheduler = LinkScheduler(options)
        self._on_broken = on_broken
        self._send_timeout = send_timeout
        self._control: deque[tuple[FramedStream, bytes]] = deque()
        self._payloads: dict[int, Payload] = {}
        self._estimators: dict[str, LinkEstimator] = {}  # the links to next nodes
        self._clients: dict[FramedStream, LinkEstimator] = {}  # results' links, per connection
        self._lowat: weakref.WeakSet[FramedStream] = weakref.WeakSet()  # connections set up
        self._wake = trio.Event()
        self._gone = Signal()  # a frame was written or dropped
        self._clock0 = time.monotonic()
        self.bytes_sent = 0
        # dest -> (nonce, frame, the scheduler's mark after it, its prompt bytes), oldest first
        self._acks: dict[str, deque[tuple[int, SentFrame, int, int]]] = {}
        self._ack_nonce = ACK_NONCE_BASE
        self._decode_acked: dict[str, float] = {}  # dest -> when a decode frame last asked

    def now(self) -> float:
        return time.monotonic() - self._clock0

    def estimator(self, dest: str) -> LinkEstimator:
        if dest not in self._estimators:
            self._estimators[dest] = LinkEstimator()
        return self._estimators[dest]

    def send_control(self, stream: FramedStream, message: Message) -> None:
        self._control.append((stream, encode_frame(to_wire(message))))
        self._wake.set()

    def send_activations(self, payload: Payload) -> None:
        tokens, hidden = payload.hidden.shape[1], payload.hidden.shape[2]
        per_token = 4 if payload.picks is not None else tensor_nbytes(1, hidden, payload.wire_dtype)
        vid = self.scheduler.enqueue(
            Volume(
                session=payload.sid,
                dest=payload.dest,
                phase=payload.phase,
                tokens=tokens,
                bytes_per_token=per_token,
                phase_left=max(tokens, payload.end - payload.pos),
            ),
            self.now(),
        )
        self._payloads[vid] = payload
        self._wake.set()

    def send_cache(self, payload: Payload) -> None:
        """A layer of a handed-over cache (or a state's part, rows as positions): bulk, behind
        decode steps, cut on position boundaries like a prompt's activations (`pos` the first)."""
        tokens, width = payload.hidden.shape[1], payload.hidden.shape[2]
        parts = 1 if payload.values is None else 2  # a state's rows; keys and values
        vid = self.scheduler.enqueue(
            Volume(
                # in order among themselves, but not ahead of the session's own results: the
                # scheduler sends a session's volumes in order, and the session goes on
                # decoding while its cache is copied
                session=f"{payload.sid}/kv",
                dest=payload.dest,
                phase=PREFILL,
                tokens=tokens,
                bytes_per_token=parts * tensor_nbytes(1, width, payload.wire_dtype),
                phase_left=tokens,
            ),
            self.now(),
        )
        self._payloads[vid] = payload
        self._wake.set()

    def control_pending(self, stream: FramedStream) -> bool:
        """Whether control frames for `stream` still wait to be written."""
        return any(s is stream for s, _ in self._control)

    def pending(self, sid: str, dest: str | None = None) -> bool:
        """Whether activations or results of `sid` (to `dest`, if given) still wait to be
        sent."""
        return any(
            p.sid == sid and p.layer < 0 and dest in (None, p.dest) for p in self._payloads.values()
        )

    async def until_sent(self, sid: str, dest: str | None = None) -> None:
        """Return once nothing of `sid` (to `dest`, if given) waits to be sent."""
        await self._gone.until(lambda: not self.pending(sid, dest))

    async def until_control_sent(self, stream: FramedStream) -> None:
        """Return once no control frame for `stream` waits to be written."""
        await self._gone.until(lambda: not self.control_pending(stream))

    def end_session(self, sid: str) -> None:
        self.scheduler.end_session(sid)
        self.scheduler.end_session(f"{sid}/kv")
        for vid in [v for v, p in self._payloads.items() if p.sid == sid]:
            _done(self._payloads.pop(vid))
        self._gone.fire()

    def observe_decode_arrival(self, sid: str) -> None:
        self.scheduler.observe_decode_arrival(sid, self.now())

    def observe_compute(self, phase: str, tokens: int, seconds: float) -> None:
        self.scheduler.observe_compute(phase, tokens, seconds)

    def on_pong(self, dest: str, nonce: int, rx_bytes: int = 0, rx_s: float = 0.0) -> bool:
        """A pong from `dest`; True if it acknowledged an activation frame (and was used here).
        `rx_bytes` over `rx_s`: how that frame arrived there, if it was large enough to tell."""
        if nonce < ACK_NONCE_BASE:
            return False
        waiting = self._acks.get(dest)
        est = self.estimator(dest)
        acked = None  # the scheduler's mark after the acknowledged frame
        while waiting:
            n, frame, mark, _ = waiting.popleft()
            if n == nonce:
                est.on_acked(frame, self.now())
                if rx_bytes > 0 and rx_s > 0:
                    est.on_arrival(rx_bytes, rx_s, self.now())
                acked = mark
                break
            est.on_ack_lost(frame)  # pongs come in order: an earlier one will not come now
        self._push_estimate(dest, est)
        if acked is not None:
            self.scheduler.acked(dest, acked, self.now())
        self._wake.set()  # a prefill held back for acknowledgements may go now
        return True

    def forget_client(self, stream: FramedStream) -> None:
        """The client connection `stream` has ended: its link is measured no more."""
        self._clients.pop(stream, None)

    def client_link(self, stream: FramedStream) -> LinkEstimator | None:
        """What results sent on the client connection `stream` have measured of its link."""
        return self._clients.get(stream)

    def forget_dest(self, dest: str) -> None:
        """The connection to `dest` is gone: its outstanding acknowledgements will not come."""
        est = self._estimators.get(dest)
        for _, frame, _, _ in self._acks.pop(dest, ()):
            if est is not None:
                est.on_ack_lost(frame)
        if est is not None:
            self._push_estimate(dest, est)
            self._wake.set()

    def path_clear(self, dest: str) -> bool:
        """Nothing sent to `dest` is unacknowledged: a ping sent now queues behind nothing."""
        return self.estimator(dest).in_flight == 0

    def on_ping(self, dest: str, rtt: float, queued: bool = False) -> None:
        """A round trip to `dest`; `queued` unless path_clear held when the ping was sent."""
        est = self.estimator(dest)
        est.on_ping(rtt, self.now(), queued)
        self._push_estimate(dest, est)

    def _push_estimate(self, dest: str, est: LinkEstimator) -> None:
        prompts = [prompt for _, _, _, prompt in self._acks.get(dest, ()) if prompt]
        self.scheduler.update_link(
            dest,
            rtt=est.rtt,
            bandwidth=est.bandwidth,
            now=self.now(),
            forget_bandwidth=est.bandwidth is None,
            min_rtt=est.min_rtt,
            in_flight=est.in_flight,
            prefill_in_flight=sum(prompts),
            prefill_frames=len(prompts),
        )

    def stats(self) -> dict[str, float]:
        out = {k: float(v) for k, v in self.scheduler.stats().items()}
        ests = self._estimators.values()
        out["tcp_info_blind"] = float(any(e.tcp_blind for e in ests))
        out["ack_rate_samples"] = float(sum(e.ack_samples for e in ests))
        out["arrival_rate_samples"] = float(sum(e.arrival_samples for e in ests))
        clients = list(self._clients.values())
        out["client_links"] = float(len(clients))
        out["client_rtt_s"] = _median(e.rtt for e in clients)
        out["client_bandwidth_Bps"] = _median(e.bandwidth for e in clients)
        return out

    async def _write(self, stream: FramedStream, frame: bytes) -> bool:
        sock = stream.socket
        if sock is not None and stream not in self._lowat:
            try:
                set_notsent_lowat(sock, NOTSENT_LOWAT)
            except OSError:
                pass
            self._lowat.add(stream)
        try:
            with trio.fail_after(self._send_timeout):
                await stream.send_raw(frame)
        except (
            trio.BrokenResourceError,
            trio.ClosedResourceError,
            trio.TooSlowError,
            OSError,
        ) as exc:
            await self._on_broken(stream, exc)
            return False
        self.bytes_sent += len(frame)
        return True

    async def run(self) -> None:
        while True:
            if self._control:
                stream, frame = self._control.popleft()
                if not stream.closed:
                    await self._write(stream, frame)
                self._gone.fire()
                continue
            send = self.scheduler.next_send(self.now())
            if send is None:
                self._wake = trio.Event()
                if not self._control:
                    # a held prefill is looked at again when an acknowledgement comes, when
                    # pacing lets it go, or soon anyway (the decode prediction moves with time)
                    with trio.move_on_after(self._hold_timeout()):
                        await self._wake.wait()
                continue
            p = self._payloads.get(send.vid)
            if p is not None and send.last:
                del self._payloads[send.vid]
            if p is None or p.stream is None or p.stream.closed:
                now = self.now()
                self.scheduler.sent(send, started=now, finished=now)
                if p is not None and send.last:
                    _done(p)
                self._gone.fire()
                continue
            try:
                await self._send(send, p)
            except Exception as exc:
                # a bug must cost the connection it hit, never the node and everyone else's
                # sessions: the sessions behind that connection fail, the rest go on
                log.exception("uplink: internal error sending to %s; dropping it", p.dest)
                await self._on_broken(p.stream, exc)
            finally:
                if send.last:
                    _done(p)
                self._gone.fire()

    async def _send(self, send: Send, p: Payload) -> None:
        """Write `send`, cut from `p`, with an acknowledgement request behind it if it is
        an activation for the next node (a decode step's: now and then), and feed the
        scheduler and estimator what it took."""
        started = self.now()
        frame = self._frame(p, send.offset, send.tokens)
        asks = not p.result and (send.phase != DECODE or self._decode_ack_due(p.dest, started))
        sent = self.estimator(p.dest).on_frame_sent(len(frame)) if asks else None
        ok = await self._write(p.stream, frame)
        finished = self.now()
        ack = None if sent is None else self._ack_ping()
        wire = len(frame) + (len(ack[1]) if ack else 0)
        self.scheduler.sent(send, started=started, finished=finished, wire_bytes=wire)
        if ok:
            self._measure(p, len(frame), started, finished)
        if sent is not None and ack is not None:
            prompt = send.nbytes if send.phase == PREFILL else 0
            mark = self.scheduler.bytes_sent_to(p.dest)
            await self._ask_ack(p, sent, ok, mark, prompt, ack)

    def _decode_ack_due(self, dest: str, now: float) -> bool:
        if now - self._decode_acked.get(dest, -math.inf) < DECODE_ACK_INTERVAL_S:
            return False
        self._decode_acked[dest] = now
        return True

    def _hold_timeout(self) -> float:
        if not self.scheduler.holding:
            return math.inf
        if self.scheduler.hold_until is None:
            return HOLD_RECHECK_S
        return min(HOLD_RECHECK_S, max(MIN_HOLD_S, self.scheduler.hold_until - self.now()))

    def _ack_ping(self) -> tuple[int, bytes]:
        """The next acknowledgement request: its nonce and its frame."""
        self._ack_nonce += 1
        return self._ack_nonce, encode_frame(to_wire(Ping(nonce=self._ack_nonce)))

    async def _ask_ack(
        self,
        p: Payload,
        sent: SentFrame,
        written: bool,
        mark: int,
        prompt: int,
        ack: tuple[int, bytes],
    ) -> None:
        """A ping (`ack`) right behind the frame: its pong means the next hop has read the frame.
        `prompt`: the frame's prompt bytes as the scheduler counts them (the tensor, not the
        frame's header: the in-flight cap compares them with its chunks)."""
        waiting = self._acks.setdefault(p.dest, deque())
        if not written or len(waiting) >= MAX_UNACKED:
            self.estimator(p.dest).on_ack_lost(sent)
            self._push_estimate(p.dest, self.estimator(p.dest))
            return
        nonce, frame = ack
        waiting.append((nonce, sent, mark, prompt))
        self._push_estimate(p.dest, self.estimator(p.dest))  # in flight grew
        await self._write(p.stream, frame)

    def _frame(self, p: Payload, offset: int, tokens: int) -> bytes:
        if p.picks is not None:
            picks = p.picks[offset : offset + tokens]
            return encode_frame(to_wire(Result(p.sid, p.end, None, p.spec, picks)))
        hidden = pack_tensor(p.hidden, p.wire_dtype, slice(offset, offset + tokens))
        if p.part:
            return encode_frame(to_wire(StateChunk(p.sid, p.layer, p.part, p.pos + offset, hidden)))
        if p.values is not None:
            values = pack_tensor(p.values[:, offset : offset + tokens], p.wire_dtype)
            chunk = KvChunk(
                sid=p.sid, layer=p.layer, pos=p.pos + offset, keys=hidden, values=values
            )
            return encode_frame(to_wire(chunk))
        if p.result:
            msg: Message = Result(sid=p.sid, end=p.end, hidden=hidden, spec=p.spec)
        else:
            msg = Step(
                sid=p.sid,
                phase=p.phase,
                pos=p.pos + offset,
                end=p.end,
                hidden=hidden,
                spec=p.spec,
                ids=None if p.ids is None else p.ids[offset : offset + tokens],
            )
        return encode_frame(to_wire(msg))

    def _measure(self, p: Payload, nbytes: int, started: float, finished: float) -> None:
        if p.result:
            if p.stream.closed:
                return  # ended while the frame went: forgotten already
            est = self._clients.setdefault(p.stream, LinkEstimator())
        else:
            est = self.estimator(p.dest)
        est.on_delivery(nbytes, started, finished, finished)
        sock = p.stream.socket
        if sock is not None:
            info = read_tcp_info(sock)
            if info is not None:
                est.on_tcp_info(
                    info.rtt_s,
                    info.delivery_rate_Bps,
                    finished,
                    info.delivery_rate_app_limited,
                    info.min_rtt_s,
                )
        if not p.result:
            self._push_estimate(p.dest, est)


def _done(p: Payload) -> None:
    if p.done is not None:
        p.done.set()


def _median(figures) -> float:
    """The median of the figures known (None: not yet measured), 0.0 if none is."""
    known = [f for f in figures if f is not None]
    return float(statistics.median(known)) if known else 0.0
