"""The node's data plane: one trio nursery owning its listener, connections, compute and uplink."""

from __future__ import annotations

import dataclasses
import logging
import secrets
import time

import torch
import trio

from swarm.errors import (
    FingerprintMismatch,
    FrameTooLarge,
    PeerFailed,
    ProtocolError,
    SessionNotFound,
    ShapeMismatch,
    SpanError,
    SwarmError,
)
from swarm.model.blocks import Span
from swarm.node.compute import ComputeQueue
from swarm.node.config import NodeConfig, scheduler_options
from swarm.node.sessions import Session, SessionTable
from swarm.node.uplink import Payload, Uplink
from swarm.protocol import (
    DECODE,
    PREFILL,
    Attach,
    Attached,
    Close,
    Error,
    Open,
    Opened,
    Ping,
    Pong,
    Step,
)
from swarm.transport import FramedStream, connect
from swarm.wire import WIRE_DTYPES, unpack_tensor

log = logging.getLogger("swarm.node")

PING_INTERVAL = 2.0


class Node:
    def __init__(self, config: NodeConfig, span: Span, fingerprint: str):
        self.config = config
        self.span = span
        self.fingerprint = fingerprint
        self.hidden = span.config.hidden
        self.sessions = SessionTable(
            config.max_sessions, config.max_cache_tokens, config.max_session_tokens
        )
        self.compute = ComputeQueue(
            config.compute_lanes, config.prefill_nice, config.prefill_compute_order
        )
        self.uplink = Uplink(scheduler_options(config), self._stream_broken)
        self._downstream: dict[str, FramedStream] = {}
        self._connecting: dict[str, trio.Lock] = {}
        self.port: int | None = None
        self.nursery: trio.Nursery | None = None
        self.errors_sent = 0
        self.steps_done = 0
        self._pings: dict[tuple[str, int], tuple[float, bool]] = {}  # -> (sent, path clear)
        # lines, so a killed node loses none
        self._step_log = open(config.step_log, "a", buffering=1) if config.step_log else None

    # ---- lifetime -------------------------------------------------------------------------

    async def serve(self, listeners=None, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        if listeners is None:
            listeners = await trio.open_tcp_listeners(self.config.port, host=self.config.host)
        self.port = listeners[0].socket.getsockname()[1]
        async with trio.open_nursery() as nursery:
            self.nursery = nursery
            nursery.start_soon(self.uplink.run)
            nursery.start_soon(self.compute.worker, self.uplink.observe_compute)
            nursery.start_soon(self._expire_sessions)
            nursery.start_soon(self._ping_downstream)
            nursery.start_soon(trio.serve_listeners, self._handle_connection, listeners)
            task_status.started(self.port)

    def stop_accepting(self) -> None:
        self.sessions.accepting = False

    @property
    def throughput(self) -> float:
        step = self.compute.decode_step_seconds
        return 1.0 / step if step > 0 else 0.0

    # ---- inbound connections --------------------------------------------------------------

    async def _handle_connection(self, stream: trio.SocketStream) -> None:
        conn = FramedStream(stream, self.config.max_frame)
        try:
            while True:
                with trio.move_on_after(self.config.connection_idle) as idle:
                    try:
                        msg = await conn.receive()
                    except FrameTooLarge as exc:
                        await self._reply_error(conn, exc)
                        return  # the rest of the stream cannot be framed any more
                    except ProtocolError as exc:
                        await self._reply_error(conn, exc)
                        continue
                if idle.cancelled_caught:
                    if self._owns_sessions(conn):
                        continue
                    await self._reply_error(
                        conn, ProtocolError("connection idle without a session; closing")
                    )
                    return
                if msg is None:
                    return
                try:
                    await self._dispatch(conn, msg)
                except SwarmError as exc:
                    await self._reply_error(conn, exc, sid=getattr(msg, "sid", ""))
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass
        except Exception:
            # a bug must cost one connection, never the node and everyone else's sessions
            log.exception("closing connection from %s after an internal error", conn.peer())
            await self._send_quietly(conn, Error.of(SwarmError("internal error"), sid="", hop=-1))
        finally:
            await self._connection_gone(conn)
            await conn.aclose()

    async def _guarded(self, fn, conn: FramedStream, *args) -> None:
        """Run a background handler for `conn`; an unexpected error closes that connection only."""
        try:
            await fn(conn, *args)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass
        except Exception:
            log.exception("closing connection from %s after an internal error", conn.peer())
            await conn.aclose()

    def _owns_sessions(self, conn: FramedStream) -> bool:
        return any(s.owner is conn or s.sink is conn for s in self.sessions)

    async def _connection_gone(self, conn: FramedStream) -> None:
        conn.closed = True
        for s in self.sessions:
            if s.owner is conn:
                self._close_session(s, notify_downstream=True)
            elif s.sink is conn:
                s.sink = None

    async def _dispatch(self, conn: FramedStream, msg) -> None:
        if isinstance(msg, Step):
            self._step(conn, msg)
        elif isinstance(msg, Ping):
            await conn.send(conn.pong(msg.nonce))  # with how the frame it follows arrived
        elif isinstance(msg, Open):
            self.nursery.start_soon(self._guarded, self._open, conn, msg)
        elif isinstance(msg, Attach):
            await self._attach(conn, msg)
        elif isinstance(msg, Close):
            s = self.sessions.get(msg.sid, conn)
            if s.owner is conn:
                self._close_session(s, notify_downstream=True)
        else:
            raise ProtocolError(f"a node does not accept {msg.t!r} messages from upstream")

    async def _reply_error(self, conn: FramedStream, exc: SwarmError, sid: str = "") -> None:
        self.errors_sent += 1
        log.info("error to %s: %s: %s", conn.peer(), exc.code, exc)
        try:
            with trio.move_on_after(5):
                await conn.send(Error.of(exc, sid=sid, hop=self._hop_of(sid, conn)))
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass

    def _hop_of(self, sid: str, conn: FramedStream) -> int:
        """The session's hop, told only to a connection holding it: a guessed id learns nothing."""
        s = self.sessions.lookup(sid) if sid else None
        return s.hop if s is not None and conn in (s.owner, s.sink) else -1

    # ---- sessions -------------------------------------------------------------------------

    async def _open(self, conn: FramedStream, msg: Open) -> None:
        try:
            s = self._admit(conn, msg)
        except SwarmError as exc:
            self.errors_sent += 1
            await self._send_quietly(conn, Error.of(exc, sid=msg.sid, hop=msg.hop))
            return
        if not s.is_last:
            nxt = msg.route[msg.hop + 1]
            dest = f"{nxt.host}:{nxt.port}"
            try:
                ds = await self._get_downstream(dest)
            except (OSError, UnicodeError, ValueError, trio.TooSlowError) as exc:
                # unreachable, unresolvable, or not even a valid host name
                self._close_session(s, notify_downstream=False)
                err = PeerFailed(f"cannot reach hop {msg.hop + 1} at {dest}: {exc}")
                await self._send_quietly(conn, Error.of(err, sid=msg.sid, hop=msg.hop + 1))
                return
            s.downstream = dest
            self.uplink.send_control(
                ds,
                Open(
                    sid=msg.sid,
                    route=msg.route,
                    hop=msg.hop + 1,
                    fingerprint=msg.fingerprint,
                    wire_dtype=msg.wire_dtype,
                    max_length=msg.max_length,
                    sink_token=msg.sink_token,
                ),
            )
            with trio.move_on_after(self.config.open_timeout):
                await s.opened.wait()
            if not s.opened.is_set() or s.open_error is not None:
                self._close_session(s, notify_downstream=True)
                err = s.open_error or Error.of(
                    PeerFailed(f"hop {msg.hop + 1} at {dest} did not answer the open"),
                    sid=msg.sid,
                    hop=msg.hop + 1,
                )
                await self._send_quietly(conn, err)
                return
        log.info("session %s... opened, hop %d, blocks %d:%d", s.sid[:8], s.hop, s.start, s.end)
        await self._send_quietly(conn, Opened(sid=msg.sid))

    def _admit(self, conn: FramedStream, msg: Open) -> Session:
        if msg.fingerprint != self.fingerprint:
            raise FingerprintMismatch(
                f"this node serves weights {self.fingerprint}, the session expects"
                f" {msg.fingerprint}"
            )
        hop = msg.route[msg.hop]
        if not (self.span.start <= hop.start < hop.end <= self.span.end):
            raise SpanError(
                f"route asks for blocks {hop.start}:{hop.end}, this node serves"
                f" {self.span.start}:{self.span.end}"
            )
        if msg.wire_dtype and msg.wire_dtype not in WIRE_DTYPES:
            raise ProtocolError(
                f"wire dtype {msg.wire_dtype!r} is not one of {sorted(WIRE_DTYPES)}"
            )
        self.sessions.check_admission(msg.sid, msg.max_length)
        s = Session(
            sid=msg.sid,
            hop=msg.hop,
            route=msg.route,
            start=hop.start,
            end=hop.end,
            wire_dtype=msg.wire_dtype or self.config.wire_dtype,
            max_length=msg.max_length,
            sink_token=msg.sink_token,
            owner=conn,
            cache=self.span.allocate_cache(hop.end - hop.start, msg.max_length),
            last_active=time.monotonic(),
        )
        self.sessions.add(s)
        return s

    async def _attach(self, conn: FramedStream, msg: Attach) -> None:
        s = self.sessions.lookup(msg.sid)
        if (
            s is None
            or not s.is_last
            or s.sink is not None
            or not secrets.compare_digest(s.sink_token.encode(), msg.sink_token.encode())
        ):
            raise SessionNotFound(f"no session {msg.sid[:8]}... to attach to here")
        s.sink = conn
        await conn.send(Attached(sid=msg.sid))

    def _step(self, conn: FramedStream, msg: Step) -> None:
        s = self.sessions.get(msg.sid, conn)
        if s.owner is not conn:
            raise SessionNotFound(f"no session {msg.sid[:8]}... on this connection")
        hidden = unpack_tensor(msg.hidden, hidden=self.hidden, max_tokens=s.max_length)
        n = hidden.shape[1]
        if msg.pos != s.next_pos:
            raise ProtocolError(
                f"step for positions {msg.pos}:{msg.pos + n} out of order; expected position"
                f" {s.next_pos}"
            )
        if not msg.pos + n <= msg.end <= s.max_length:
            raise ShapeMismatch(
                f"step covers {msg.pos}:{msg.pos + n} of a phase ending at {msg.end}; the session"
                f" holds at most {s.max_length} tokens"
            )
        if msg.phase == DECODE and n != 1:
            raise ShapeMismatch(f"a decode step carries one token, this one {n}")
        s.next_pos = msg.pos + n
        s.last_active = time.monotonic()
        if msg.phase == DECODE:
            self.uplink.observe_decode_arrival(s.sid)
        else:
            self._prefill(s, msg, hidden)
            return

        done = self._pass_done(s, arrived=time.monotonic())
        self.compute.submit(DECODE, n, self._pass(s, msg, hidden), done)

    def _prefill(self, s: Session, msg: Step, hidden) -> None:
        """Queue a prefill piece. The link may deliver a prompt in many small chunks, and a
        client may send it whole: pieces that arrived while a job waited are computed together,
        up to `prefill_pass_tokens` per forward pass, so one pass costs little per token and a
        decode step waits behind at most one pass."""
        now = time.monotonic()
        if not s.pending:
            s.pending_since = now
        if msg.end != s.prompt_end:  # the first piece of a prompt
            s.prompt_end, s.prompt_since = msg.end, now
        s.pending.append((msg, hidden))
        if self._step_log is not None:
            self._step_log.write(f"a {s.sid[:8]} {now:.4f} {msg.pos} {hidden.shape[1]} {msg.end}\n")
        if s.gather is not None and self._gather_wait(s) == 0:
            s.gather.cancel()  # enough has come: the pass need not wait longer
            s.gather = None
            self._submit_prefill(s)
        elif not s.prefill_queued:
            s.prefill_queued = True
            self._submit_prefill(s)

    def _gather_wait(self, s: Session) -> float:
        c = self.config
        now = time.monotonic()
        return gather_wait(
            s.pending, s.pending_since, now, c.prefill_min_pass_tokens, c.prefill_gather_s
        )

    async def _gather(self, s: Session, scope: trio.CancelScope, wait: float) -> None:
        with scope:
            await trio.sleep(wait)
            s.gather = None
            if not s.closed:
                self._submit_prefill(s)

    def _submit_prefill(self, s: Session) -> None:
        def prepare():
            wait = self._gather_wait(s)
            if wait > 0 and not s.closed:  # a few tokens only: let more come, a little while
                s.gather = trio.CancelScope()
                self.nursery.start_soon(self._gather, s, s.gather, wait)
                return None  # prefill_queued stays set: the gathering submits the pass
            batch = _take_tokens(s.pending, self.config.prefill_pass_tokens)
            if s.pending:  # more than one pass waits: queue the next, behind any decode step
                s.pending_since = time.monotonic()
                self._submit_prefill(s)
            else:
                s.prefill_queued = False
            if s.closed or not batch:
                return None
            hidden = torch.cat([h for _, h in batch], dim=1) if len(batch) > 1 else batch[0][1]
            return hidden.shape[1], self._pass(s, batch[0][0], hidden)

        first = s.pending[0][0] if s.pending else None
        left = first.end - first.pos if first is not None else 0
        rank = self.compute.prefill_rank(s.prompt_since, left)
        self.compute.submit(PREFILL, 0, None, self._pass_done(s), prepare, rank=rank)

    def _pass(self, s: Session, msg: Step, hidden):
        """The work of one forward pass from position `msg.pos`, run in the compute thread."""

        def run():
            with s.compute_lock:  # lanes run in parallel; one session's passes never do
                if s.closed:
                    raise SessionNotFound("session closed before its step ran")
                if s.cache.length != msg.pos:
                    # only a client that sends a step before its previous one returned
                    raise ProtocolError(
                        f"step at position {msg.pos} ran before the session's earlier positions"
                        f" (cache holds {s.cache.length}); wait for each result"
                    )
                return msg, self.span.forward(hidden, s.cache, msg.pos, s.start, s.end)

        return run

    def _pass_done(self, s: Session, arrived: float | None = None):
        """Back on the trio thread: forward the pass's output, or fail the session. `arrived`:
        when a decode step's input came in, for the step log (which also notes each prompt
        piece's arrival and each prompt pass)."""

        async def done(result, error, elapsed, usage):
            if s.closed:
                return
            if error is not None:
                log.exception("step failed in session %s...", s.sid[:8], exc_info=error)
                err = (
                    error
                    if isinstance(error, SwarmError)
                    else ProtocolError(f"compute failed: {error}")
                )
                await self._fail_session(s, Error.of(err, sid=s.sid, hop=s.hop))
                return
            msg, out = result
            self.steps_done += 1
            self._forward(s, msg, out)
            if self._step_log is None:
                return
            now = time.monotonic()
            os_time = f"{usage.cpu_s:.4f} {usage.runqueue_s:.4f}"
            if arrived is not None:
                self._step_log.write(f"{arrived:.4f} {now - arrived:.4f} {elapsed:.4f} {os_time}\n")
            elif msg.phase == PREFILL:
                n, sid = out.shape[1], s.sid[:8]
                self._step_log.write(
                    f"p {sid} {now:.4f} {msg.pos} {n} {msg.end} {elapsed:.4f} {os_time}\n"
                )

        return done

    def _forward(self, s: Session, msg: Step, out) -> None:
        n = out.shape[1]
        if s.is_last:
            if msg.pos + n != msg.end:
                return  # a middle chunk of a prefill: the client needs only the last token
            if s.sink is None:
                self.nursery.start_soon(
                    self._fail_session,
                    s,
                    Error.of(
                        SessionNotFound("no client attached to receive results"), s.sid, s.hop
                    ),
                )
                return
            self.uplink.send_activations(
                Payload(
                    s.sink,
                    "client",
                    s.sid,
                    DECODE,
                    msg.pos,
                    msg.end,
                    out[:, -1:],
                    s.wire_dtype,
                    result=True,
                )
            )
        else:
            ds = self._downstream.get(s.downstream)
            if ds is None:
                return
            self.uplink.send_activations(
                Payload(
                    ds,
                    s.downstream,
                    s.sid,
                    msg.phase,
                    msg.pos,
                    msg.end,
                    out,
                    s.wire_dtype,
                    result=False,
                )
            )

    def _close_session(self, s: Session, notify_downstream: bool) -> None:
        if self.sessions.remove(s.sid) is None:
            return
        log.info("session %s... closed", s.sid[:8])
        self.uplink.end_session(s.sid)
        if notify_downstream and s.downstream in self._downstream:
            self.uplink.send_control(self._downstream[s.downstream], Close(sid=s.sid))

    async def _fail_session(self, s: Session, error: Error) -> None:
        """Tell the session's upstream (and so, hop by hop, the client) and drop the session."""
        self._close_session(s, notify_downstream=True)
        self.errors_sent += 1
        await self._send_quietly(s.owner, error)
        if s.sink is not None and s.sink is not s.owner:
            await self._send_quietly(s.sink, error)

    async def _send_quietly(self, conn: FramedStream, msg) -> None:
        try:
            with trio.move_on_after(5):
                await conn.send(msg)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass

    async def _expire_sessions(self) -> None:
        while True:
            await trio.sleep(min(5.0, self.config.session_idle / 2))
            cutoff = time.monotonic() - self.config.session_idle
            for s in self.sessions:
                if s.last_active < cutoff and (s.opened.is_set() or s.is_last):
                    await self._fail_session(
                        s, Error.of(SessionNotFound("session expired after idling"), s.sid, s.hop)
                    )

    # ---- downstream connections -----------------------------------------------------------

    async def _get_downstream(self, dest: str) -> FramedStream:
        lock = self._connecting.setdefault(dest, trio.Lock())
        async with lock:
            ds = self._downstream.get(dest)
            if ds is not None and not ds.closed:
                return ds
            host, _, port = dest.rpartition(":")
            with trio.fail_after(10):
                ds = await connect(host, int(port), self.config.max_frame)
            self._downstream[dest] = ds
            self.nursery.start_soon(self._read_downstream, dest, ds)
            return ds

    async def _read_downstream(self, dest: str, ds: FramedStream) -> None:
        """Backward traffic from the next hop: open acks, errors, pongs."""
        reason: Exception | None = None
        try:
            while True:
                msg = await ds.receive()
                if msg is None:
                    reason = ConnectionError("connection closed")
                    break
                if isinstance(msg, Pong):
                    if self.uplink.on_pong(dest, msg.nonce, msg.rx_bytes, msg.rx_us / 1e6):
                        continue
                    ping = self._pings.pop((dest, msg.nonce), None)
                    if ping is not None:
                        sent, clear = ping
                        self.uplink.on_ping(dest, time.monotonic() - sent, queued=not clear)
                    continue
                s = self.sessions.lookup(getattr(msg, "sid", ""))
                if s is None or s.downstream != dest:
                    continue
                if isinstance(msg, Opened):
                    s.opened.set()
                elif isinstance(msg, Error):
                    if not s.opened.is_set():
                        s.open_error = msg
                        s.opened.set()
                    else:
                        await self._fail_session(s, msg)
        except (SwarmError, trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            reason = exc
        await self._stream_broken(ds, reason)

    async def _stream_broken(self, stream: FramedStream, reason: Exception | None) -> None:
        """A write or read on `stream` failed: every session that depends on it fails."""
        if stream.closed:
            return
        stream.closed = True
        for dest, ds in list(self._downstream.items()):
            if ds is stream:
                del self._downstream[dest]
                self.uplink.forget_dest(dest)
                log.warning("lost downstream %s: %s", dest, reason)
                for s in self.sessions:
                    if s.downstream == dest:
                        err = PeerFailed(f"hop {s.hop + 1} at {dest} failed: {reason}")
                        if not s.opened.is_set():
                            s.open_error = Error.of(err, s.sid, s.hop + 1)
                            s.opened.set()
                        else:
                            await self._fail_session(s, Error.of(err, s.sid, s.hop + 1))
        await stream.aclose()

    async def _ping_downstream(self) -> None:
        nonce = 0
        while True:
            await trio.sleep(PING_INTERVAL)
            for dest, ds in list(self._downstream.items()):
                nonce += 1
                self._pings[(dest, nonce)] = (time.monotonic(), self.uplink.path_clear(dest))
                self.uplink.send_control(ds, Ping(nonce=nonce))
            if len(self._pings) > 1000:
                self._pings.clear()


def gather_wait(pending: list, since: float, now: float, min_tokens: int, gather_s: float) -> float:
    """How much longer a prefill pass should wait for more pieces: none once `pending` holds
    `min_tokens` or the end of its phase, else until `gather_s` after the oldest piece came.
    Each pass costs a fixed overhead whatever its size, so passes of a few tokens (a slow link
    delivers a prompt in small chunks) spend CPU the decode steps of other sessions need."""
    if not pending:
        return 0.0
    tokens = sum(h.shape[1] for _, h in pending)
    last, hidden = pending[-1]
    if tokens >= min_tokens or last.pos + hidden.shape[1] >= last.end:
        return 0.0
    return max(0.0, since + gather_s - now)


def _take_tokens(pending: list, limit: int) -> list:
    """Pop up to `limit` tokens of consecutive prefill pieces of one phase from `pending`; a
    piece that does not fit is split, its rest left at the front."""
    batch: list = []
    taken = 0
    while pending and taken < limit:
        msg, hidden = pending[0]
        if batch and (msg.end != batch[0][0].end or msg.pos != batch[0][0].pos + taken):
            break  # another phase: its own pass
        n = hidden.shape[1]
        if taken + n <= limit:
            pending.pop(0)
            batch.append((msg, hidden))
            taken += n
            continue
        k = limit - taken
        batch.append((msg, hidden[:, :k]))
        pending[0] = (dataclasses.replace(msg, pos=msg.pos + k), hidden[:, k:])
        taken += k
    return batch
