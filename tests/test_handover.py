"""A leaving node hands its sessions to a replica with their caches (swarm/node/handover/): the
sessions go on there without replaying a token, and every failure falls back to replay."""

from __future__ import annotations

import signal
import threading

import torch
import trio

from devtools.launch import stop_all
from tests.conftest import reference_greedy
from tests.helpers.handover import (
    LONG_PROMPT,
    NEW,
    PAUSE_AT,
    PROMPTS,
    client_of,
    generate_across_a_leave,
    handed_over_across_a_leave,
    left_with,
    start_full_node,
    wait_for_lines,
)
from tests.helpers.relay import free_port


def test_a_drained_node_hands_its_sessions_over_and_they_go_on_without_replay(
    dht_peers, tiny_model_dir, tiny_reference
):
    out = handed_over_across_a_leave(tiny_model_dir, dht_peers, PROMPTS, grace=20)
    assert out == [reference_greedy(tiny_reference, p, NEW) for p in PROMPTS]


def test_a_last_hop_hands_its_sessions_over_and_the_node_before_it_follows(
    dht_peers, tiny_model_dir, tiny_reference
):
    first = start_full_node(tiny_model_dir, dht_peers, layers=(0, 3))
    leaving = start_full_node(tiny_model_dir, dht_peers, "--grace", "20", layers=(3, 6))
    client = client_of(dht_peers, tiny_model_dir)
    replica = None
    try:

        def leave() -> None:
            nonlocal replica
            replica = start_full_node(tiny_model_dir, dht_peers, layers=(3, 6))
            leaving.proc.send_signal(signal.SIGTERM)
            wait_for_lines(leaving, "handed over to", 4)

        out, sessions = generate_across_a_leave(client, PROMPTS, leave)
        assert out == [reference_greedy(tiny_reference, p, NEW) for p in PROMPTS]
        route = [first.peer, replica.peer]
        assert [(s.recoveries, s.moves, s.peers) for s in sessions] == [([], 1, route)] * 4
        assert leaving.proc.wait(60) == 0
        assert left_with(replica) == (0, 4, 0)
    finally:
        client.close()
        stop_all([first, leaving] + ([replica] if replica else []))


def test_a_handed_over_session_computes_what_the_unsplit_model_does(
    dht_peers, tiny_model_dir, tiny_reference
):
    """Teacher-forced logits within float noise of transformers' across the hand-over: the
    replica's weights (float32) were not in the client's records, and its head fell back to
    the file's formats (~1e-2 off) while every token still matched on wide greedy margins."""
    prompt = PROMPTS[0]
    tokens = reference_greedy(tiny_reference, prompt, NEW)
    with torch.inference_mode():
        want = tiny_reference(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 :]
    first = start_full_node(tiny_model_dir, dht_peers, layers=(0, 3))
    leaving = start_full_node(tiny_model_dir, dht_peers, "--grace", "20", layers=(3, 6))
    client = client_of(dht_peers, tiny_model_dir)
    replica, gaps = None, []
    try:
        with client.session(len(prompt) + NEW + 1) as s:
            logits = s.feed(prompt)
            for i, token in enumerate(tokens):  # teacher-forced: the reference's own tokens
                if i == PAUSE_AT:
                    replica = start_full_node(tiny_model_dir, dht_peers, layers=(3, 6))
                    leaving.proc.send_signal(signal.SIGTERM)
                    wait_for_lines(leaving, "handed over to", 1)
                gaps.append(float((logits.float() - want[i]).abs().max()))
                logits = s.feed([token])
            assert s.remote.moves == 1 and s.recoveries == []
        assert max(gaps) < 1e-4, [f"{g:.1e}" for g in gaps]
    finally:
        client.close()
        stop_all([first, leaving] + ([replica] if replica else []))


class CuttingProxy:
    """A TCP relay on loopback that cuts any connection once `limit` bytes have gone through
    it towards the target: a link failing in the middle of a large transfer."""

    def __init__(self, target_port: int, limit: int):
        self.target_port, self.limit = target_port, limit
        self.cuts = 0
        self.port = 0
        self._ready = threading.Event()
        self._stop: trio.CancelScope | None = None
        self._thread = threading.Thread(target=trio.run, args=(self._serve,), daemon=True)
        self._thread.start()
        self._ready.wait(10)

    async def _serve(self) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        self.port = listeners[0].socket.getsockname()[1]
        self._token = trio.lowlevel.current_trio_token()
        with trio.CancelScope() as self._stop:
            self._ready.set()
            await trio.serve_listeners(self._relay, listeners)

    async def _relay(self, inbound: trio.SocketStream) -> None:
        try:
            outbound = await trio.open_tcp_stream("127.0.0.1", self.target_port)
        except OSError:
            return
        async with inbound, outbound, trio.open_nursery() as nursery:

            async def copy(src, dst, limit: float) -> None:
                passed = 0
                try:
                    while data := await src.receive_some(65536):
                        if passed + len(data) > limit:
                            self.cuts += 1
                            break
                        passed += len(data)
                        await dst.send_all(data)
                except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                    pass
                nursery.cancel_scope.cancel()

            nursery.start_soon(copy, inbound, outbound, self.limit)
            nursery.start_soon(copy, outbound, inbound, float("inf"))

    def close(self) -> None:
        if self._stop is not None:
            trio.from_thread.run_sync(self._stop.cancel, trio_token=self._token)
        self._thread.join(5)


def test_a_transfer_cut_half_way_falls_back_to_replay_with_the_same_tokens(
    dht_peers, tiny_model_dir, tiny_reference
):
    prompt = LONG_PROMPT
    node = start_full_node(tiny_model_dir, dht_peers, "--grace", "3")
    port = free_port()
    proxy = CuttingProxy(port, limit=40 * 1024)
    client = client_of(dht_peers, tiny_model_dir)
    replica = None
    try:

        def leave() -> None:
            nonlocal replica
            public = ["--port", str(port), "--public-address", f"127.0.0.1:{proxy.port}"]
            replica = start_full_node(tiny_model_dir, dht_peers, *public)
            node.proc.send_signal(signal.SIGTERM)
            assert node.proc.wait(60) == 0  # the handover failed; the grace period ran out

        [out], [session] = generate_across_a_leave(client, [prompt], leave)
        assert out == reference_greedy(tiny_reference, prompt, NEW)
        assert proxy.cuts >= 1
        assert len(session.recoveries) == 1
        passes, moved_in, _ = left_with(replica)
        assert passes >= 1 and moved_in == 0  # replayed there, nothing taken over
    finally:
        client.close()
        stop_all([node] + ([replica] if replica else []))
        proxy.close()
