"""Reaching a node nobody can dial (behind NAT or a firewall): another node relays for it.

At start a node asks another to dial its announced address back (`check_reachable`). If that
fails it keeps a control connection open to a reachable node (`stay_relayed`) and announces the
relay's address plus the relay's peer id. A dialler connects to the relay and asks for the node
by peer id (`splice`); the relay asks the node, over its control connection, to connect back; the
node does, and the relay then copies bytes between the two connections. The TLS handshake runs
end to end through the copy, checked against the node's own key, so the relay sees only
ciphertext. Each relayed connection is a TCP connection of its own from the node, so the node's
link scheduler still paces, and reads TCP_INFO of, what leaves its home uplink.

The relay copies through small buffers so the far end's backpressure reaches the node: a relay
that queued megabytes would hide the slow link from the scheduler.
"""

from __future__ import annotations

import logging
import random
import secrets
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import trio

from swarm.address import parse_host_port, source_host
from swarm.dht import NodeKey, proves
from swarm.errors import NodeBusy, PeerFailed, ProtocolError, SwarmError
from swarm.protocol import Error, Hop, Ping, Pong, Relay, relay_claim, to_wire
from swarm.records import ONLINE, NodeRecord
from swarm.transport import FramedStream, ask_relay, ping
from swarm.wire import DEFAULT_MAX_FRAME, encode_frame

log = logging.getLogger("swarm.relay")

DIALBACK_TIMEOUT_S = 5.0  # a reachable node answers a dial-back well within this
ACCEPT_TIMEOUT_S = 10.0  # for the relayed node to connect back (a dialler waits SPLICE_TIMEOUT_S)
CONTROL_PING_S = 5.0
CONTROL_SILENCE_S = 15.0  # a relay (or a relayed node) silent this long is gone
PROOF_TIMEOUT_S = 10.0  # for a registrant to sign the relay's challenge
MAX_RELAYED_PER_HOST = 2  # nodes one source address may register with a relay
COPY_CHUNK = 16 * 1024
HELPERS = 3  # nodes asked to dial back, one after the other


# ---- the relay's side ---------------------------------------------------------------------------


@dataclass(eq=False)
class _Handoff:
    """A splice waiting for its node to connect back with the splice's token."""

    back: FramedStream | None = None  # that connection, once it came
    arrived: trio.Event = field(default_factory=trio.Event)
    done: trio.Event = field(default_factory=trio.Event)  # the splice is over with it


class RelayHub:
    """What a reachable node does for others: holds their control connections, splices
    diallers to them, and dials back nodes that ask whether they can be reached."""

    def __init__(self, capacity: int, me: str = ""):
        self.capacity = capacity  # nodes it relays for at once; 0: none
        self.me = me  # this relay's node id, which a registration's proof must name
        self.controls: dict[str, FramedStream] = {}
        self._hosts: dict[str, str] = {}  # peer -> the address its registration came from
        self._waiting: dict[str, _Handoff] = {}  # splice token -> the splice waiting for it
        self.spliced = 0  # connections spliced so far

    async def handle(self, conn: FramedStream, msg: Relay, source: str) -> None:
        """Serve one plaintext relay request on `conn` (from host `source`) to its end."""
        if msg.op == "listen":
            await self._listen(conn, msg.peer, source)
        elif msg.op == "splice":
            await self._splice(conn, msg.peer, source)
        elif msg.op == "accept":
            await self._accept(conn, msg.token)
        elif msg.op == "dialback":
            await self._dial_back(conn, msg, source)
        else:
            raise ProtocolError(f"a relay does not take {msg.op!r} requests")

    async def _listen(self, conn: FramedStream, peer: str, source: str) -> None:
        if not peer:
            raise ProtocolError("listen names no peer")
        if self.capacity <= 0:
            raise NodeBusy("this node relays for nobody (it is relayed itself, or --max-relayed 0)")
        await self._check_proof(conn, peer)
        if peer not in self.controls and len(self.controls) >= self.capacity:
            raise NodeBusy(f"this node relays for {self.capacity} nodes already")
        same_host = [p for p, host in self._hosts.items() if host == source and p != peer]
        if len(same_host) >= MAX_RELAYED_PER_HOST:
            raise NodeBusy(f"this relay holds {MAX_RELAYED_PER_HOST} nodes from {source} already")
        old = self.controls.get(peer)
        self.controls[peer], self._hosts[peer] = conn, source  # a node reconnecting: the latest
        if old is not None:
            await old.aclose()
        log.info("relaying for %s (from %s)", peer, conn.peer())
        try:
            await conn.send(Relay(op="listening"))
            while True:
                # the node pings every CONTROL_PING_S: a silent one is gone, its place free
                with trio.move_on_after(CONTROL_SILENCE_S):
                    msg = await conn.receive()
                    if msg is None:
                        break
                    if isinstance(msg, Ping):
                        await conn.send(Pong(nonce=msg.nonce))
                    continue
                log.info("%s silent for %g s; dropping it", peer, CONTROL_SILENCE_S)
                break
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError, ProtocolError):
            pass
        finally:
            if self.controls.get(peer) is conn:
                del self.controls[peer], self._hosts[peer]
                log.info("no longer relaying for %s", peer)

    async def _check_proof(self, conn: FramedStream, peer: str) -> None:
        """The registrant must sign a fresh nonce with the key behind `peer` (its records' key):
        nobody takes another node's relay slot, or learns who dials it."""
        nonce = secrets.token_hex(16)
        await conn.send(Relay(op="challenge", token=nonce))
        with trio.fail_after(PROOF_TIMEOUT_S):
            answer = await conn.receive()
        claim = relay_claim(self.me, peer, nonce)
        if not isinstance(answer, Relay) or answer.op != "prove":
            raise ProtocolError("a relay registration answers its challenge with 'prove'")
        if not proves(peer, answer.key, claim, answer.proof):  # an RSA check: a millisecond
            raise ProtocolError(f"the registration proves no key of node {peer[:20]!r}")

    async def _splice(self, conn: FramedStream, peer: str, source: str) -> None:
        control = self.controls.get(peer)
        if control is None:
            raise PeerFailed(f"this relay has no node {peer[:20]!r} behind it now", peer=peer)
        token = secrets.token_hex(16)
        handoff = self._waiting[token] = _Handoff()
        try:
            try:
                await control.send(Relay(op="reverse", token=token, addr=source))
                with trio.fail_after(ACCEPT_TIMEOUT_S):
                    await handoff.arrived.wait()
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                raise PeerFailed(f"the relay lost node {peer[:20]!r}", peer=peer) from None
            except trio.TooSlowError:
                raise PeerFailed(
                    f"node {peer[:20]!r} did not connect back to its relay in"
                    f" {ACCEPT_TIMEOUT_S:g} s",
                    peer=peer,
                ) from None
            finally:
                self._waiting.pop(token, None)
            await conn.send(Relay(op="spliced"))
            self.spliced += 1
            await copy_both_ways(conn.stream, handoff.back.stream)
        finally:
            handoff.done.set()  # the connection back, if it came, is free to close

    async def _accept(self, conn: FramedStream, token: str) -> None:
        # a token is taken once: a second accept for it (a stranger's) is refused at once
        handoff = self._waiting.pop(token, None)
        if handoff is None:
            raise ProtocolError("no splice waits for this token")
        handoff.back = conn
        handoff.arrived.set()
        await handoff.done.wait()  # the splice owns the connection until it ends

    async def _dial_back(self, conn: FramedStream, msg: Relay, source: str) -> None:
        try:
            host, port = parse_host_port(msg.addr)
        except ValueError as exc:
            raise ProtocolError(str(exc)) from None
        if source_host((host, port)) != source:
            # dialling anywhere on request would make every node a scanner for hire
            error = (
                f"its connections arrive from {source}, not from {host}: behind NAT (or a wrong"
                " --public-address); a dial-back goes only to the address a request came from"
            )
        else:
            reach = await ping(Hop(host, port, 0, 1, "", msg.tls), timeout=DIALBACK_TIMEOUT_S)
            error = reach.error or ""
        await conn.send(Relay(op="dialed", addr=msg.addr, error=error))


async def copy_both_ways(a: trio.abc.Stream, b: trio.abc.Stream) -> None:
    """Copy bytes a -> b and b -> a until either side ends, then close both."""

    async def copy(src: trio.abc.Stream, dst: trio.abc.Stream, scope: trio.CancelScope) -> None:
        try:
            while data := await src.receive_some(COPY_CHUNK):
                await dst.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass
        scope.cancel()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(copy, a, b, nursery.cancel_scope)
        nursery.start_soon(copy, b, a, nursery.cancel_scope)
    await trio.aclose_forcefully(a)
    await trio.aclose_forcefully(b)


# ---- the relayed node's side -------------------------------------------------------------------


async def check_reachable(
    addr: str, tls: str, me: str, records: list[NodeRecord]
) -> tuple[bool | None, str]:
    """Whether others can dial `addr` (this node, key `tls`): asks up to HELPERS direct nodes
    to dial it back. (True/False, what they said), or (None, why nobody could tell)."""
    helpers = [r for r in records if r.state == ONLINE and r.tls and not r.relay and r.peer != me]
    random.shuffle(helpers)
    request = Relay(op="dialback", addr=addr, tls=tls)
    for r in helpers[:HELPERS]:
        try:
            conn, reply = await ask_relay(
                *r.host_port, request, "dialed", DIALBACK_TIMEOUT_S + 5, DEFAULT_MAX_FRAME
            )
            await conn.aclose()
        except (OSError, trio.TooSlowError, trio.BrokenResourceError, SwarmError):
            continue
        if isinstance(reply, Relay):
            who = f"node {r.peer[-8:]} at {r.addr}"
            if reply.error:
                return False, f"{who} could not dial {addr}: {reply.error}"
            return True, f"{who} dialled {addr} back"
    return None, "no other node could be asked to dial back"


Accept = Callable[[trio.SocketStream, str], Awaitable[None]]


async def stay_relayed(
    key: NodeKey,
    candidates: Callable[[], Awaitable[list[NodeRecord]]],
    relayed_by: Callable[[NodeRecord | None], Awaitable[None]],
    accept: Accept,
    say: Callable[[str], None],
) -> None:
    """Keep a relay for this node (its records' `key`, which registrations prove) for as long
    as it runs: pick a direct node from `candidates()`, register, call `relayed_by(record)`,
    and hand each connection the relay splices to `accept(stream, dialler's host)`. A lost
    relay is replaced."""
    me = key.peer
    failed: set[str] = set()
    while True:
        records = await candidates()
        relays = [
            r for r in records if r.state == ONLINE and r.tls and not r.relay and r.peer != me
        ]
        random.shuffle(relays)
        relays.sort(key=lambda r: r.peer in failed)  # ones that failed us last
        for r in relays:
            try:
                control = await _register(r, key)
            except (OSError, trio.TooSlowError, trio.BrokenResourceError, SwarmError) as exc:
                failed.add(r.peer)
                say(f"relay {r.peer[-8:]} at {r.addr} refused: {exc}")
                continue
            await relayed_by(r)
            say(
                f"relayed by {r.peer[-8:]} at {r.addr}: clients and upstream nodes reach this"
                " node through it"
            )
            why = await _serve_control(control, r, accept)
            failed.add(r.peer)
            await relayed_by(None)
            say(f"lost relay {r.peer[-8:]}: {why}; choosing another")
            break
        else:
            say(f"no relay available ({len(relays)} candidates); trying again in 10 s")
            await trio.sleep(10)


async def _register(r: NodeRecord, key: NodeKey) -> FramedStream:
    request = Relay(op="listen", peer=key.peer)
    control, reply = await ask_relay(
        *r.host_port, request, "challenge", DIALBACK_TIMEOUT_S, DEFAULT_MAX_FRAME
    )
    try:
        if isinstance(reply, Relay):
            marker, proof = key.sign(relay_claim(r.peer, key.peer, reply.token))
            await control.send(Relay(op="prove", key=marker, proof=proof))
            with trio.fail_after(DIALBACK_TIMEOUT_S):
                reply = await control.receive()
        if isinstance(reply, Error):
            raise reply.exception()
        if not isinstance(reply, Relay) or reply.op != "listening":
            raise ProtocolError(f"relay {r.addr} answered a registration with {reply!r:.100}")
    except BaseException:
        await trio.aclose_forcefully(control.stream)
        raise
    return control


async def _serve_control(control: FramedStream, relay: NodeRecord, accept: Accept) -> str:
    """Answer the relay's requests until it goes away; why it went."""
    why = "the relay closed the connection"
    heard = trio.current_time()
    silent = False
    async with trio.open_nursery() as nursery:

        async def keep_alive() -> None:
            nonlocal silent
            nonce = 0
            while trio.current_time() - heard < CONTROL_SILENCE_S:
                nonce += 1
                try:
                    await control.send(Ping(nonce=nonce))
                except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                    break
                await trio.sleep(CONTROL_PING_S)
            silent = True
            nursery.cancel_scope.cancel()

        nursery.start_soon(keep_alive)
        try:
            while (msg := await control.receive()) is not None:
                heard = trio.current_time()
                if isinstance(msg, Relay) and msg.op == "reverse":
                    nursery.start_soon(_connect_back, relay, msg.token, msg.addr, accept)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError, ProtocolError) as e:
            why = f"{type(e).__name__}: {e}"
        nursery.cancel_scope.cancel()
    await control.aclose()
    return f"no answer for {CONTROL_SILENCE_S:g} s" if silent else why


async def _connect_back(relay: NodeRecord, token: str, source: str, accept: Accept) -> None:
    try:
        with trio.fail_after(ACCEPT_TIMEOUT_S):
            stream = await trio.open_tcp_stream(*relay.host_port)
            stream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            await stream.send_all(encode_frame(to_wire(Relay(op="accept", token=token))))
    except (OSError, trio.TooSlowError, trio.BrokenResourceError) as exc:
        log.warning("connecting back to relay %s failed: %s", relay.addr, exc)
        return
    await accept(stream, source)
