"""The node's data plane: one trio nursery owning its listener, compute, uplink and next hops.

Each inbound connection is a task reading frames; it admits the sessions it opens and starts
each as a task in its own nursery (session.py), hands steps to them, and answers pings. Replies
go out on the connection; activations leave through the uplink. A session sees only the
`SessionContext` the node builds once. What must outlive the connection that caused it (telling
the holders of evicted sessions) runs in the node's own nursery.
"""

from __future__ import annotations

import logging
import time
from functools import partial

import trio

from swarm.dht import NodeKey
from swarm.errors import (
    FingerprintMismatch,
    FrameTooLarge,
    NodeBusy,
    PeerFailed,
    PlaintextRefused,
    ProtocolError,
    SessionNotFound,
    SpanError,
    SwarmError,
)
from swarm.lending import AT_ONCE_ROWS, AttendLent, Lend, Reclaim
from swarm.model.blocks import Span
from swarm.node.admission import ConnectionTable, Inbound, Throttle, peer_host
from swarm.node.compute import ComputeQueue
from swarm.node.config import NodeConfig
from swarm.node.context import Counters, SessionContext, send_quietly
from swarm.node.directory import PeerDirectory
from swarm.node.downstream import Downstream
from swarm.node.handover import receive
from swarm.node.handover.follow import follow
from swarm.node.handover.send import hand_off
from swarm.node.lender import INLINE_ATTEND, LendTable, attend
from swarm.node.observer import NoObserver, StepObserver
from swarm.node.session import Session
from swarm.node.session_table import SessionTable
from swarm.node.spread_replica import SpreadReplica
from swarm.node.uplink import Uplink
from swarm.protocol import (
    Attach,
    Attached,
    Close,
    Error,
    Handover,
    HandoverEnd,
    HandoverTail,
    Hop,
    KvChunk,
    Open,
    Ping,
    Relay,
    Release,
    Resume,
    StateChunk,
    Step,
)
from swarm.records import DECODE
from swarm.relay import RelayHub
from swarm.tls import HANDSHAKE_TIMEOUT_S, TLS_HANDSHAKE, Identity, peek_byte
from swarm.transport import FramedStream
from swarm.wire import WIRE_DTYPES

log = logging.getLogger("swarm.node")


class Node:
    def __init__(
        self,
        config: NodeConfig,
        span: Span,
        fingerprint: str,
        observer: StepObserver | None = None,
        *,
        directory: PeerDirectory,
        identity: Identity | None = None,
        key: NodeKey | None = None,
    ):
        """`key`: what names this node and signs its claims (the process's DHT key unless
        given)."""
        self.config = config
        self.identity = identity  # the TLS key this node proves; None: plaintext (--plaintext)
        self.key = key or NodeKey.process_wide()
        # relaying for nodes nobody can dial takes TLS: the relay must not read what it copies
        relays = config.limits.max_relayed if identity else 0
        self.relay_hub = RelayHub(relays, self.key.peer if relays else "")
        self.directory = directory  # the next hops an open may name
        self.span = span
        self.fingerprint = fingerprint
        self.observer: StepObserver = observer or NoObserver()
        self.sessions = SessionTable[Session](config.limits)
        self.connections = ConnectionTable(
            config.limits.max_connections, config.limits.max_host_connections
        )
        self.throttle = Throttle()
        mb, limits = 2**20, config.limits
        self.lends = LendTable(int(limits.max_lend_mb * mb), int(limits.max_lend_host_mb * mb))
        self.uplink = Uplink(config.link, self._stream_broken)
        self.compute = ComputeQueue(
            config.compute.lanes,
            config.compute.prefill_nice,
            config.compute.prefill_order,
            observe=self.uplink.observe_compute,
            max_batch=config.compute.max_batch,
            gather=config.compute.decode_gather == "measured",
        )
        self.downstream = Downstream(
            self.uplink,
            self.sessions,
            config.limits.max_frame,
            self.directory,
            lambda s, moved: follow(self.context, s, moved),
        )
        self.counters = Counters()
        self.spreads = SpreadReplica(span, fingerprint, self.compute, self.sessions, self._spawn)
        self.context = SessionContext(
            config,
            span,
            self.compute,
            self.uplink,
            self.downstream,
            self.sessions,
            self.observer,
            self.counters,
            self._hand_off,
            fingerprint,
            self.directory,
            self.key,
        )
        self._handlers = self._message_handlers()
        self.port: int | None = None
        self._nursery: trio.Nursery | None = None  # the node's own, while it serves

    def _message_handlers(self) -> dict:
        # what a connection's messages do: one handler per message type
        return {
            Step: self._step,
            Ping: self._ping,
            Open: self._open,
            KvChunk: partial(receive.take_chunk, self.context),
            StateChunk: partial(receive.take_chunk, self.context),
            Handover: self._take_handover,
            HandoverTail: partial(receive.take_tail, self.context),
            HandoverEnd: partial(receive.end, self.context),
            Resume: partial(receive.resume, self.context),
            Release: self._release,
            Attach: self._attach,
            Close: self._close,
            Lend: self._lend,
            AttendLent: self._attend_lent,
            Reclaim: self._reclaim,
            **self.spreads.handlers,  # a replica's rows of another node's prompt pass
        }

    # ---- lifetime -------------------------------------------------------------------------

    async def serve(self, listeners=None, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        if listeners is None:
            listeners = await trio.open_tcp_listeners(self.config.port, host=self.config.host)
        self.port = listeners[0].socket.getsockname()[1]
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            nursery.start_soon(self.uplink.run)
            nursery.start_soon(self.compute.worker)
            await nursery.start(self.downstream.run)
            nursery.start_soon(trio.serve_listeners, self._handle_connection, listeners)
            task_status.started(self.port)

    def stop_accepting(self) -> None:
        self.sessions.accepting = False

    @property
    def tokens_done(self) -> int:
        return self.counters.tokens_done

    @property
    def throughput(self) -> float:
        step = self.compute.decode_step_seconds
        return 1.0 / step if step > 0 else 0.0

    async def _stream_broken(self, stream: FramedStream, reason: Exception | None) -> None:
        await self.downstream.lost(stream, reason)

    # ---- inbound connections --------------------------------------------------------------

    async def _handle_connection(self, stream: trio.SocketStream, source: str = "") -> None:
        """Serve one inbound connection; `source`: the dialler's host when a relay spliced it
        (the socket's peer is then the relay)."""
        conn = FramedStream(stream, self.config.limits.max_frame)
        scope = trio.CancelScope()
        inbound = Inbound(
            source or peer_host(conn),
            time.monotonic(),
            scope.cancel,
            lambda: not self._holds(conn),
        )
        try:
            victim = self.connections.admit(inbound)
        except NodeBusy as exc:
            self.throttle.refuse(inbound.host, "a connection", str(exc), inbound.opened)
            # said in plaintext, before any TLS: a flood of refused connections must not cost
            # the node a handshake each (swarm.tls.dial reads this answer as a typed error)
            with trio.move_on_after(1):
                await self._reply_error(conn, exc)
            await trio.aclose_forcefully(conn.stream)
            return
        if victim is not None:
            why = "connections full; it held no session, a newcomer needed the place"
            self.throttle.evict(victim.host, why, inbound.opened)
            victim.close()
        try:
            with scope:
                if not await self._secure(conn, inbound.host):
                    return
                await self._read(conn)
            if scope.cancelled_caught:
                busy = NodeBusy("connection closed: the node was full and it held no session")
                await self._reply_error(conn, busy)
        except Exception:
            # whatever a stranger's bytes make a handler raise costs this connection only:
            # out of serve_listeners it would end the node and everyone's sessions
            log.exception("closing connection from %s after an internal error", conn.peer())
        finally:
            self.connections.remove(inbound)
            self.lends.forget(conn)
            self.spreads.forget(conn)
            conn.closed = True
            self.uplink.forget_client(conn)
            for s in self.sessions:
                # a session never outlives the connection that asked for it (or, handed over
                # here, the one that now owns it)
                if s.owner is conn and s.intake is not None and s.sink not in (None, conn):
                    # handed over here, the leaving node went before passing it on: the client
                    # replays it elsewhere, told now rather than at its step's timeout
                    err = PeerFailed("the node that handed this session over left too soon")
                    await s.fail(Error.of(err, s.sid, s.hop))
                elif s.owner is conn:
                    s.close()
                elif s.sink is conn:
                    s.sink_gone()
            await conn.aclose()

    async def accept_relayed(self, stream: trio.SocketStream, source: str) -> None:
        """A connection a relay spliced to this node (it dialled the relay back)."""
        await self._handle_connection(stream, source)

    async def _secure(self, conn: FramedStream, host: str) -> bool:
        """Run the server side of TLS on `conn` (unless plaintext); False if it failed or
        the connection was a relay request (served here, to its end)."""
        if self.identity is None:
            return True
        try:
            with trio.fail_after(HANDSHAKE_TIMEOUT_S):
                first = await peek_byte(conn)
            if first != TLS_HANDSHAKE:
                await self._plaintext_request(conn, host)
                return False
            conn.stream = await self.identity.accept(conn.stream)
        except (trio.BrokenResourceError, trio.TooSlowError, OSError) as exc:
            # a scanner, a plaintext client or a stalled handshake: nobody to tell
            log.debug("TLS handshake from %s failed: %s", conn.peer(), exc)
            return False
        return True

    async def _plaintext_request(self, conn: FramedStream, host: str) -> None:
        """Before TLS only relay requests are taken; anything else is told to speak TLS."""
        try:
            with trio.fail_after(HANDSHAKE_TIMEOUT_S):
                msg = await conn.receive()
            if not isinstance(msg, Relay):
                raise PlaintextRefused()
            await self.relay_hub.handle(conn, msg, host)
        except SwarmError as exc:
            await self._reply_error(conn, exc)

    async def _read(self, conn: FramedStream) -> None:
        try:
            while (msg := await self._receive(conn)) is not None:
                try:
                    await self._dispatch(conn, msg)
                except SwarmError as exc:
                    await self._reply_error(conn, exc, sid=getattr(msg, "sid", ""))
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass
        except Exception:
            # a bug must cost one connection, never the node and everyone else's sessions
            log.exception("closing connection from %s after an internal error", conn.peer())
            await send_quietly(conn, Error.of(SwarmError("internal error"), sid="", hop=-1))

    async def _receive(self, conn: FramedStream):
        """The next message; None when the connection should end. Errors in framing are
        answered here; a connection without sessions may idle only so long."""
        while True:
            with trio.move_on_after(self.config.limits.connection_idle_s) as idle:
                try:
                    return await conn.receive()
                except FrameTooLarge as exc:
                    await self._reply_error(conn, exc)
                    return None  # the rest of the stream cannot be framed any more
                except ProtocolError as exc:
                    await self._reply_error(conn, exc)
                    continue
            if idle.cancelled_caught:
                if self._holds(conn):
                    continue
                await self._reply_error(
                    conn, ProtocolError("connection idle without a session; closing")
                )
                return None

    async def _dispatch(self, conn: FramedStream, msg) -> None:
        handler = self._handlers.get(type(msg))
        if handler is None:
            raise ProtocolError(f"a node does not accept {msg.t!r} messages from upstream")
        await handler(conn, msg)

    async def _step(self, conn: FramedStream, msg: Step) -> None:
        receive.step(self.context, conn, msg)

    async def _ping(self, conn: FramedStream, msg: Ping) -> None:
        await conn.send(conn.pong(msg.nonce))  # with how the frame it follows arrived

    async def _release(self, conn: FramedStream, msg: Release) -> None:
        receive.release(self.sessions.get(msg.sid, conn), conn)

    async def _attach(self, conn: FramedStream, msg: Attach) -> None:
        s = self.sessions.lookup(msg.sid)
        if s is None:
            raise SessionNotFound(f"no session {msg.sid[:8]}... to attach to here")
        s.attach(conn, msg.sink_token)
        await conn.send(Attached(sid=msg.sid))

    async def _close(self, conn: FramedStream, msg: Close) -> None:
        s = self.sessions.get(msg.sid, conn)
        if s.owner is conn:
            s.close()

    def _holds(self, conn: FramedStream) -> bool:
        """The connection holds a session here, or KV blocks it lent: never closed as idle."""
        held = self.lends.holds(conn) or self.spreads.holds(conn)  # or a spread it asked for
        return held or any(s.owner is conn or s.sink is conn for s in self.sessions)

    async def _lend(self, conn: FramedStream, msg: Lend) -> None:
        await conn.send(self.lends.lend(conn, peer_host(conn), msg))

    async def _attend_lent(self, conn: FramedStream, msg: AttendLent) -> None:
        q, keys, values = self.lends.query(conn, msg)
        if q.shape[0] * keys.shape[1] <= INLINE_ATTEND:  # a decode step's: a thread costs more
            reply = attend(msg, q, keys, values)
        else:
            reply = await trio.to_thread.run_sync(attend, msg, q, keys, values)
        await conn.send(reply, at_once=q.shape[0] <= AT_ONCE_ROWS)

    async def _reclaim(self, conn: FramedStream, msg: Reclaim) -> None:
        for chunk in self.lends.reclaim(conn, msg, self.config.limits.max_frame // 2):
            await conn.send(chunk)

    async def _reply_error(self, conn: FramedStream, exc: SwarmError, sid: str = "") -> None:
        self.counters.errors_sent += 1
        log.info("error to %s: %s: %s", conn.peer(), exc.code, exc)
        await send_quietly(conn, Error.of(exc, sid=sid, hop=self._hop_of(sid, conn)))

    def _hop_of(self, sid: str, conn: FramedStream) -> int:
        """The session's hop, told only to a connection holding it: a guessed id learns nothing."""
        s = self.sessions.lookup(sid) if sid else None
        return s.hop if s is not None and conn in (s.owner, s.sink) else -1

    # ---- admission ------------------------------------------------------------------------

    async def _open(self, conn: FramedStream, msg: Open) -> None:
        now = time.monotonic()
        evicted: list[tuple[Session, Error]] = []
        try:
            self._check_open(msg)
            session = Session(self.context, conn, msg, now)
            try:
                victims = self.sessions.make_room(session, now)
            except NodeBusy as exc:
                self.throttle.refuse(session.host, "a session", str(exc), now)
                raise
            for victim in victims:  # their places go to the newcomer before anyone else's
                why = "the node was full and it was idle or unused"
                err = Error.of(NodeBusy(f"session evicted: {why}"), victim.sid, victim.hop)
                victim.evict(err)
                self.throttle.evict(victim.host, why, now)
                evicted.append((victim, err))
            self.sessions.add(session)
        except SwarmError as exc:
            self.counters.errors_sent += 1
            await send_quietly(conn, Error.of(exc, sid=msg.sid, hop=msg.hop))
            return
        assert self._nursery is not None, "Node.serve is not running"
        self._nursery.start_soon(session.run)
        for victim, err in evicted:  # told even if the newcomer's connection ends at once
            for holder in {id(c): c for c in (victim.owner, victim.sink) if c}.values():
                self._nursery.start_soon(send_quietly, holder, err)

    def _check_open(self, msg: Open) -> None:
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
        if msg.handoff is not None:
            self._check_handoff(msg, hop)

    def _check_handoff(self, msg: Open, hop: Hop) -> None:
        """An open asking this node to compute the prompt, then hand the session on: only the
        last hop does, to another node for the same blocks, unless this node decodes only."""
        to = msg.handoff
        assert to is not None
        if msg.hop != len(msg.route) - 1:
            raise ProtocolError("only a route's last hop hands its session on after the prompt")
        if (to.start, to.end) != (hop.start, hop.end):
            raise ProtocolError(
                f"a handoff of blocks {to.start}:{to.end} from a hop computing"
                f" {hop.start}:{hop.end}"
            )
        if to.peer == self.key.peer:
            raise ProtocolError("a handoff to the node itself")
        if self.config.role == DECODE or self.config.limits.handover == "off":
            raise NodeBusy("this node hands no sessions on (--role decode or --handover off)")

    def _hand_off(self, session: Session) -> None:
        self._spawn(hand_off, self.context, session)

    def _spawn(self, fn, *args) -> None:
        """Start a task that must outlive the connection that caused it."""
        assert self._nursery is not None, "Node.serve is not running"
        self._nursery.start_soon(fn, *args)

    async def _take_handover(self, conn: FramedStream, msg: Handover) -> None:
        await receive.take(self.context, conn, msg, self._check_open, self._spawn)
