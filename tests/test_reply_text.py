"""The client's reply text (ReplyText): what streams out while tokens arrive, with stop strings."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from swarm.client.client import ReplyText
from swarm.model.tiny import save_tiny_tokenizer


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("tok")
    save_tiny_tokenizer(path)
    tok = AutoTokenizer.from_pretrained(str(path))
    return SimpleNamespace(tokenizer=tok, config=SimpleNamespace(eos_token_ids=(2,)))


def run(client, ids: list[int], stop: list[str]) -> tuple[list[str], bool]:
    text = ReplyText(client.tokenizer, client.config.eos_token_ids, stop)
    pieces = []
    for token in ids:
        piece, done = text.add(token)
        pieces.append(piece)
        if done:
            return pieces, True
    return pieces + [text.flush()], False


def test_a_stop_string_split_across_tokens_never_streams_out(client):
    ids = client.tokenizer.encode("lepo pupi luzotu lizu gafoza")
    full = client.tokenizer.decode(ids)
    ends = [len(client.tokenizer.decode(ids[:j])) for j in range(1, len(ids))]
    # a stop string made of the last character of one token and the first of the next
    k = next(e for e in ends if full.index(full[e - 1 : e + 1]) == e - 1)
    pieces, stopped = run(client, ids, [full[k - 1 : k + 1]])
    assert stopped
    assert "".join(pieces) == full[: k - 1]


def test_text_held_back_for_a_stop_string_that_never_comes_is_flushed(client):
    ids = client.tokenizer.encode("lepo pupi luzotu")
    full = client.tokenizer.decode(ids)
    pieces, stopped = run(client, ids, [full[-2:] + "never"])
    assert not stopped
    assert "".join(pieces) == full
    assert pieces[-1], "the tail waited for the stop string, then came out at the end"
