"""A client session outlives a failed route: it reroutes and replays its tokens, up to
max_retries times, and gives up at once on an error no other route can fix."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

from swarm.client.client import InferenceSession
from swarm.client.options import ClientOptions
from swarm.client.session import RemoteSession
from swarm.errors import (
    CacheFull,
    FingerprintMismatch,
    LendRefused,
    PeerFailed,
    RouteUnavailable,
)


class Nodes:
    """Stands in for the client's loop thread and the nodes behind it: a step returns the hidden
    states it was sent, once the errors queued for it are used up."""

    def __init__(self, errors: list[Exception]):
        self.errors = errors
        self.steps: list[list[float]] = []
        self.opened = 0

    def run(self, fn, *args):
        if fn.__name__ == "open":
            self.opened += 1
        if fn.__name__ != "step":
            return None
        self.steps.append(args[0].tolist())
        if self.errors:
            raise self.errors.pop(0)
        return args[0]


def session(
    errors: list[Exception], max_retries: int = 2, peers: tuple[str, ...] = ("p", "q")
) -> InferenceSession:
    """A session whose routes are one hop, the first of `peers` not excluded."""

    def hold_route(excluded, max_length):
        left = [p for p in peers if p not in excluded]
        if not left:
            raise RouteUnavailable("every node left out")
        return [SimpleNamespace(peer=left[0], addr="127.0.0.1:1", start=0, end=1)], 0.0

    failed: list[str] = []
    client = SimpleNamespace(
        config=SimpleNamespace(max_position=100, hidden=1),
        hold_route=hold_route,
        release_route=lambda route, token: None,
        router=SimpleNamespace(failed=failed.append, failures=failed),
        fingerprint="f",
        options=ClientOptions(step_timeout=1.0, prefill_chunk=8, max_retries=max_retries),
        loop=Nodes(errors),
        head=lambda route: SimpleNamespace(embed_tokens=lambda ids: torch.tensor(ids, dtype=float)),
        logits=SimpleNamespace(logits=lambda head, out: out),
        observe_step=lambda route, seconds: None,
        prefill_hop=lambda hop, tokens, max_length, exclude: None,  # no prefill nodes
        remote_session=lambda route, max_length, handoff, picking=None: RemoteSession(
            route, "f", 1, max_length, None, 1.0, handoff=handoff
        ),
    )
    return InferenceSession(client, 50)


def from_hop(exc: Exception, peer: str) -> Exception:
    """`exc` as the client has it from a node's error frame: naming the hop's peer."""
    exc.peer = peer
    return exc


@pytest.fixture(autouse=True)
def no_backoff(monkeypatch):
    monkeypatch.setattr(time, "sleep", lambda seconds: None)


def test_a_failed_step_is_retried_on_a_new_route_without_the_peer_to_blame():
    s = session([PeerFailed("gone", peer="p")])
    s.feed([1, 2])
    assert s.client.loop.steps == [[1, 2], [1, 2]]
    assert s.client.loop.opened == 2 and s.excluded == {"p"} and len(s.recoveries) == 1


def test_a_new_route_is_sent_the_tokens_so_far():
    s = session([])
    s.feed([1, 2])
    s.client.loop.errors.append(PeerFailed("gone", peer="p"))
    s.feed([3])
    assert s.client.loop.steps == [[1, 2], [3], [1, 2, 3]]


def test_a_failure_on_every_route_is_raised_after_max_retries_reroutes():
    s = session([PeerFailed("gone", peer=str(i)) for i in range(10)], max_retries=2)
    with pytest.raises(PeerFailed):
        s.feed([1])
    assert s.client.loop.opened == 3


def test_an_error_no_other_route_can_fix_is_raised_at_once():
    s = session([FingerprintMismatch("other weights")])
    with pytest.raises(FingerprintMismatch):
        s.feed([1])
    assert s.client.loop.opened == 1


def test_a_lender_refusing_more_blocks_replays_through_the_same_sound_node():
    """The node that borrowed is sound; its replay borrows anew (as when its lender dies)."""
    s = session([from_hop(LendRefused("the lender refused more"), "p")], peers=("p",))
    s.feed([1, 2])
    assert s.excluded == set() and s.client.router.failures == []
    assert s.client.loop.opened == 2 and len(s.recoveries) == 1


def test_a_node_allowing_shorter_sessions_is_left_out_of_this_session_only():
    s = session([from_hop(CacheFull("this node allows 32 per session"), "p")])
    s.feed([1, 2])
    assert s.excluded == {"p"} and s.client.router.failures == []  # other sessions may use it
    assert s.client.loop.opened == 2


def test_a_session_every_node_refuses_as_too_long_raises_their_cache_full_not_no_route():
    s = session([from_hop(CacheFull("this node allows 32 per session"), "p")], peers=("p",))
    with pytest.raises(CacheFull, match="allows 32"):
        s.feed([1])
