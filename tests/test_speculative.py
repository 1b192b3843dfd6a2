"""Speculative decoding's parts, without processes: prompt lookup's drafts, a ring cache's
rewind, a node's checks of verification steps, the sampler's draws, replies decoded in rounds
against a model in this process (greedy: plain decoding's tokens; sampled: the model's own
distribution), and a node's session dropping the rounds a rejection made stale."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import replace

import pytest
import torch
import trio

from swarm.client.decoding import Decoding, PromptLookup
from swarm.client.draft import DraftModel
from swarm.client.inference import Round, RoundRows
from swarm.client.options import Sampling
from swarm.client.reply import Sampler
from swarm.client.tuner import Tuner
from swarm.errors import ProtocolError, RewindRefused, ShapeMismatch
from swarm.model.blocks import KVCache, Span
from swarm.model.head import Head
from swarm.model.source import open_model
from swarm.model.tiny import save_tiny_llama
from swarm.node.session_state import SessionState, StepIn
from swarm.protocol import DECODE, MAX_REWIND, MAX_VERIFY_TOKENS, PREFILL, Opened
from tests.helpers.sessions import SID, TOKEN, Conn, context, open_msg, start, step, until
from tests.helpers.speculation import Fixed

# ---- prompt lookup ------------------------------------------------------------------------


def test_lookup_proposes_what_followed_the_latest_occurrence_of_the_longest_suffix():
    # [1, 2, 3] last occurred at 4 (and at 0); the shorter [2, 3] later, at 10
    tokens = [1, 2, 3, 7, 1, 2, 3, 9, 9, 4, 2, 3, 8, 1, 2, 3]
    assert PromptLookup().propose(tokens, 3) == [9, 9, 4]


def test_lookup_falls_back_to_a_shorter_suffix_and_proposes_at_most_k():
    tokens = [6, 2, 3, 8, 5, 4, 4, 1, 9, 3]  # no [1, 9, 3] or [9, 3] before: [3] at 2
    assert PromptLookup().propose(tokens, 2) == [8, 5]
    assert PromptLookup().propose(tokens, 50) == tokens[3:]


def test_lookup_proposes_nothing_without_a_match():
    assert PromptLookup().propose([1, 2, 3, 4], 5) == []
    assert PromptLookup().propose([7], 5) == []


def test_a_lookups_drafts_are_of_the_kind_of_its_match_length():
    assert PromptLookup().kind([1, 2, 3, 7, 1, 2, 3]) == 3
    assert PromptLookup().kind([6, 2, 3, 8, 5, 4, 4, 1, 9, 3]) == 1
    assert PromptLookup().kind([1, 2, 3, 4]) == 0


def test_the_tuner_learns_each_kind_of_drafts_acceptance_apart():
    tuner = Tuner(acceptance=0.5)
    for _ in range(20):
        tuner.observe(8, 8, kind=3)  # a reply copying its prompt
        tuner.observe(1, 0, kind=1)  # matches of one common token
    assert tuner.acceptance(3) > 0.95 and tuner.acceptance(1) < 0.05
    assert tuner.acceptance(2) == 0.5  # not seen yet: the prior


def test_the_tuner_drafts_long_rounds_of_a_good_kind_and_none_of_a_bad_one():
    tuner = Tuner(acceptance=0.5)
    tuner.timed(1, 0.1)  # a round trip dominates
    for _ in range(20):
        tuner.observe(8, 8, kind=3)
        tuner.observe(1, 0, kind=1)
    assert tuner.plan(100, kind=3)[0] >= 8
    assert tuner.plan(100, kind=1) == (0, 1)


def test_one_round_flies_at_a_time_until_a_tokens_cost_in_a_round_is_measured():
    tuner = Tuner(acceptance=0.95)
    tuner.timed(1, 0.1)  # a long round trip, rounds of one size only
    assert tuner.plan(10)[1] == 1
    for _ in range(3):
        tuner.timed(4, 0.101)  # tokens cost little beside the round trip
        tuner.timed(8, 0.102)
    assert tuner.per_token < 0.001 and tuner.plan(20)[1] > 1


def test_rounds_go_off_where_they_produced_tokens_slower_than_plain_steps():
    tuner = Tuner(acceptance=0.9)
    tuner.timed(1, 0.02)
    assert tuner.plan(10)[0] > 0  # nothing measured yet: the model's choice
    for _ in range(10):
        tuner.produced(True, 2, 0.05)  # 40 tokens/s by rounds
        tuner.produced(False, 1, 0.02)  # 50 by plain steps
    assert tuner.plan(20) == (0, 1)
    tuner.produced(True, 8, 0.05)
    for _ in range(10):
        tuner.produced(True, 3, 0.02)  # now 150 tokens/s
    assert tuner.plan(30)[0] > 0


# ---- a ring cache's rewind ----------------------------------------------------------------

PROMPT = [(7 * i + 3) % 500 + 5 for i in range(30)]  # past every tiny model's window
DRAFTS = [(11 * i + 4) % 500 + 5 for i in range(MAX_VERIFY_TOKENS)]


@pytest.fixture(scope="module")
def model_parts(tiny):
    """family -> (the whole tiny model as one float32 Span, its Head)."""

    def get(family: str) -> tuple[Span, Head]:
        source = open_model(str(tiny(family)[1]))
        span = Span.load(source, 0, source.config.num_layers, weights="float32")
        return span, Head.load(source, weights="float32")

    return get


def fed(span: Span, head: Head, ids: list[int], cache: KVCache | None = None) -> torch.Tensor:
    """Feed `ids` after what `cache` holds (a new cache of 64 tokens if none); hidden out."""
    cache = cache if cache is not None else span.allocate_cache(0, span.end, 64)
    return span.forward(head.embed_tokens(ids), cache, cache.length, 0, span.end)


def prompted(span: Span, head: Head) -> KVCache:
    cache = span.allocate_cache(0, span.end, 64)
    fed(span, head, PROMPT, cache)
    return cache


def held(cache: KVCache) -> list[torch.Tensor]:
    """What each layer's cache holds for the session's positions (a wrapped ring: every slot)."""
    out = []
    for k, v in zip(cache.keys, cache.values):
        n = min(cache.length, k.shape[2])
        out += [k[:, :, :n].clone(), v[:, :, :n].clone()]
    return out


def assert_holds(cache: KVCache, want: list[torch.Tensor], atol: float = 0.0) -> None:
    got = held(cache)
    assert len(got) == len(want)
    for layer, (a, b) in enumerate(zip(got, want)):
        assert a.shape == b.shape, layer // 2
        assert torch.allclose(a, b, rtol=0, atol=atol), f"layer {layer // 2}"


@pytest.mark.parametrize("family, drafts", [("mistral", 16), ("gemma2", 6), ("gemma2", 8)])
def test_a_ring_rewound_over_all_its_drafts_holds_exactly_what_it_held(model_parts, family, drafts):
    span, head = model_parts(family)
    cache = prompted(span, head)
    before = held(cache)
    cache.keep_for_rewind(len(PROMPT), drafts, MAX_REWIND)
    fed(span, head, DRAFTS[:drafts], cache)
    cache.rewind(len(PROMPT))
    assert cache.length == len(PROMPT)
    assert_holds(cache, before)


@pytest.mark.parametrize(
    "family, drafts, accepted",
    [
        ("mistral", 16, 3),
        ("mistral", 6, 2),
        ("gemma2", 6, 2),
        ("gemma2", 8, 5),
    ],
)
def test_a_ring_rewound_into_its_drafts_holds_the_accepted_ones_as_if_fed_alone(
    model_parts, family, drafts, accepted
):
    span, head = model_parts(family)
    window = min(k.shape[2] for k in span.allocate_cache(0, span.end, 64).keys)
    assert window < len(PROMPT) + accepted  # the ring wraps
    rounds, alone = prompted(span, head), prompted(span, head)
    rounds.keep_for_rewind(len(PROMPT), drafts, MAX_REWIND)
    fed(span, head, DRAFTS[:drafts], rounds)
    rounds.rewind(len(PROMPT) + accepted)
    fed(span, head, DRAFTS[:accepted], alone)
    assert rounds.length == alone.length
    assert_holds(rounds, held(alone), atol=1e-5)
    after = fed(span, head, [42], rounds), fed(span, head, [42], alone)
    assert torch.allclose(*after, rtol=0, atol=1e-4)


@pytest.mark.parametrize("drafts", [12, 16])
def test_a_round_longer_than_a_rings_window_is_refused_before_it_is_computed(model_parts, drafts):
    span, head = model_parts("gemma2")
    cache = prompted(span, head)
    before = held(cache)
    with pytest.raises(ProtocolError, match=f"pass of {drafts} tokens"):
        cache.keep_for_rewind(len(PROMPT), drafts, MAX_REWIND)
    assert cache.length == len(PROMPT)
    assert_holds(cache, before)


def test_a_ring_short_of_what_a_rewind_needs_says_a_replay_may_help(model_parts):
    span, head = model_parts("mistral")
    cache = prompted(span, head)
    cache.keep_for_rewind(len(PROMPT), 8, 4)
    fed(span, head, DRAFTS[:8], cache)
    with pytest.raises(RewindRefused) as refused:
        cache.rewind(len(PROMPT) + 1)
    assert refused.value.retry_elsewhere  # the node is honest: a route rebuilds its cache


def test_a_rewind_further_back_than_was_kept_is_refused_and_changes_nothing(model_parts):
    span, head = model_parts("mistral")
    cache = prompted(span, head)
    cache.keep_for_rewind(len(PROMPT), 8, 4)  # only the last 4 positions may be rewound
    fed(span, head, DRAFTS[:8], cache)
    before = held(cache)
    with pytest.raises(ProtocolError, match="cannot rewind to position 31"):
        cache.rewind(len(PROMPT) + 1)
    assert cache.length == len(PROMPT) + 8
    assert_holds(cache, before)
    cache.rewind(len(PROMPT) + 4)  # as far as was kept
    assert cache.length == len(PROMPT) + 4


def test_a_ring_that_kept_nothing_refuses_any_rewind(model_parts):
    span, head = model_parts("gemma2")
    cache = prompted(span, head)
    before = held(cache)
    with pytest.raises(ProtocolError, match="sliding window"):
        cache.rewind(len(PROMPT) - 1)
    assert cache.length == len(PROMPT)
    assert_holds(cache, before)


# ---- a node's checks of verification steps ----------------------------------------------


def session_after_prompt(prompt: int = 10, max_length: int = 256) -> SessionState:
    state = SessionState(SID, max_length, last=False)
    state.handle(Opened(sid=SID))
    state.handle(StepIn(PREFILL, 0, prompt, prompt))
    return state


def verification(pos: int, tokens: int) -> StepIn:
    return StepIn(DECODE, pos, tokens, pos + tokens, spec=True)


def where(state: SessionState) -> tuple:
    return state.state, state.next_pos, state.floor, state.last_active, state.used


def test_a_verification_step_may_rewind_to_any_position_since_the_last_plain_step():
    state = session_after_prompt()
    state.handle(verification(10, 4))
    state.handle(verification(14, 4))
    state.handle(verification(11, 3))  # the first round's second draft was rejected
    assert (state.next_pos, state.floor) == (14, 10)
    state.handle(verification(10, 1))
    assert (state.next_pos, state.floor) == (11, 10)


def test_a_verification_step_over_the_token_limit_is_a_shape_mismatch_changing_nothing():
    state = session_after_prompt()
    before = where(state)
    with pytest.raises(ShapeMismatch, match=f"at most {MAX_VERIFY_TOKENS} tokens"):
        state.handle(verification(10, MAX_VERIFY_TOKENS + 1))
    assert where(state) == before
    state.handle(verification(10, MAX_VERIFY_TOKENS))


def test_a_verification_step_rewinding_below_a_plain_step_is_refused_changing_nothing():
    state = session_after_prompt()
    state.handle(verification(10, 4))
    before = where(state)
    with pytest.raises(ProtocolError, match="rewind to 10 at the earliest"):
        state.handle(verification(9, 2))
    assert where(state) == before


def test_a_verification_step_rewinding_beyond_max_rewind_is_refused_changing_nothing():
    state = session_after_prompt()
    for pos in range(10, 10 + MAX_REWIND + 16, 16):
        state.handle(verification(pos, 16))
    end = state.next_pos
    before = where(state)
    with pytest.raises(ProtocolError, match=f"rewind to {end - MAX_REWIND} at the earliest"):
        state.handle(verification(end - MAX_REWIND - 1, 2))
    assert where(state) == before
    state.handle(verification(end - MAX_REWIND, 2))


def test_a_verification_step_skipping_ahead_is_refused_changing_nothing():
    state = session_after_prompt()
    state.handle(verification(10, 4))
    before = where(state)
    with pytest.raises(ProtocolError, match="may go on at 14"):
        state.handle(verification(15, 2))
    assert where(state) == before


def test_a_verification_step_in_the_prefill_phase_is_refused():
    state = session_after_prompt()
    before = where(state)
    with pytest.raises(ProtocolError, match="a verification step is a decode step"):
        state.handle(StepIn(PREFILL, 10, 3, 13, spec=True))
    assert where(state) == before


# ---- the sampler ------------------------------------------------------------------------


def test_a_sampled_token_depends_on_seed_position_and_logits_only_not_the_order_of_calls():
    logits = torch.randn(20, 50, generator=torch.Generator().manual_seed(0)) * 2
    sampling = Sampling(temperature=1.0, top_k=20, top_p=0.9, seed=7)
    forward = [Sampler(sampling)(row, pos) for pos, row in enumerate(logits)]
    again = Sampler(sampling)
    backward = [again(logits[pos], pos) for pos in reversed(range(20))][::-1]
    assert forward == backward
    assert forward != [Sampler(replace(sampling, seed=8))(r, p) for p, r in enumerate(logits)]


def test_greedy_sampling_picks_the_argmax_whatever_the_seed():
    logits = torch.randn(20, 50, generator=torch.Generator().manual_seed(1))
    for seed in (None, 3):
        sampler = Sampler(Sampling(temperature=0.0, seed=seed))
        assert [sampler(row, p) for p, row in enumerate(logits)] == logits.argmax(1).tolist()


# ---- a round's logits, read row by row --------------------------------------------------


@pytest.fixture(scope="module")
def default_head():
    return Head.load(open_model(None))  # the client's head at its default weights


def test_a_rounds_rows_go_through_the_head_only_as_far_as_they_are_read(default_head):
    rows = RoundRows(default_head, torch.randn(9, default_head.config.hidden), first=3)
    assert len(rows) == 9 and rows.computed == 0
    rows[2]
    assert rows.computed == 3
    rows[3]
    assert rows.computed == 9  # past the first chunk: the next one is twice as long


def test_a_rounds_rows_are_the_logits_a_plain_step_gets_for_each_row(default_head):
    hidden = torch.randn(9, default_head.config.hidden)
    rows = RoundRows(default_head, hidden, first=2)
    for i in range(9):
        assert torch.equal(rows[i], default_head.logits(hidden[i : i + 1]))
    assert torch.equal(rows[-1], rows[8])
    with pytest.raises(IndexError):
        rows[9]


def test_the_rows_expected_read_follow_the_acceptance():
    tuner = Tuner(acceptance=0.0)
    assert tuner.rows_read(9) == 1  # the first row's pick rejects the first draft
    tuner = Tuner(acceptance=0.5)
    assert tuner.rows_read(9) == 2  # 1 + 1/2 + 1/4 + ... < 2
    tuner = Tuner(acceptance=1.0)
    assert tuner.rows_read(9) == 9


# ---- replies decoded in rounds, against a model in this process ---------------------------


@pytest.fixture
def one_thread():
    """Tiny models compute fastest on one thread, the more so on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class Memo:
    """A model's logits [tokens, vocab] after each prefix of a sequence, once per sequence."""

    def __init__(self, model):
        self.model, self.known = model, {}

    def __call__(self, seq) -> torch.Tensor:
        key = tuple(seq)
        if key not in self.known:
            with torch.inference_mode():
                self.known[key] = self.model(torch.tensor([key])).logits[0].float()
        return self.known[key]


class ModelRoute:
    """An InferenceSession as a Decoding uses it, on a model in this process: a round is
    answered from what the route holds when it arrives (the accepted tokens, then the rounds
    sent before it), and where it may start is checked as a node checks it."""

    round_tokens = MAX_VERIFY_TOKENS  # a model without sliding windows
    sampler: Sampler | None = None  # the Decoding's

    def __init__(self, logits: Memo):
        self.logits = logits
        self.history: list[int] = []  # accepted
        self.holds: list[int] = []  # accepted, then the rounds in flight
        self.answers: dict[int, torch.Tensor] = {}
        self.spec = 0

    def feed(self, ids: list[int]) -> torch.Tensor:
        self.history += ids
        self.holds = list(self.history)
        return self.logits(self.history)[-1]

    def pick(self, ids: list[int]) -> int:
        """As a route whose client picks: the Decoding's sampler, given as `sampler`."""
        return self.sampler(self.feed(ids), len(self.history))

    def send_round(self, ids: list[int], pos: int) -> Round:
        assert len(self.history) <= pos <= len(self.holds) and len(ids) <= MAX_VERIFY_TOKENS
        self.holds = self.holds[:pos] + list(ids)
        self.spec += 1
        self.answers[self.spec] = self.logits(self.holds)[pos:]
        return Round(self.spec, pos, tuple(ids))

    def round_logits(self, r: Round, first: int = MAX_VERIFY_TOKENS) -> torch.Tensor:
        assert r.spec in self.answers and r.spec > max(self.answers, default=0) - 4
        for stale in [s for s in self.answers if s < r.spec]:
            del self.answers[stale]
        return self.answers.pop(r.spec)

    def keep(self, r: Round, n: int) -> None:
        assert r.pos == len(self.history) and 1 <= n <= len(r.ids)
        self.history += r.ids[:n]

    def recover(self, exc) -> None:
        raise exc


class Greedy:
    """Drafts a model's greedy continuation (the served model's own: every draft accepted
    under greedy decoding)."""

    def __init__(self, logits: Memo):
        self.logits = logits

    def propose(self, tokens, k: int) -> list[int]:
        seq = list(tokens)
        for _ in range(k):
            seq.append(int(self.logits(seq)[-1].argmax()))
        return seq[len(tokens) :]


def decoded(logits: Memo, prompt, new: int, sampler: Sampler, drafter=None, tuner=None):
    decoding = Decoding(ModelRoute(logits), list(prompt), new, sampler, drafter, tuner)
    return list(decoding), decoding.stats


REPETITIVE = [5, 17, 29, 41, 53, 65, 77, 89] * 3


@pytest.mark.parametrize("drafter", ["lookup", "itself", "another model"])
@pytest.mark.parametrize("drafts, in_flight", [(2, 1), (5, 3), (MAX_VERIFY_TOKENS - 1, 4)])
def test_greedy_rounds_give_plain_decodings_tokens(
    one_thread, tiny_reference, tiny_model_dir, tmp_path, drafter, drafts, in_flight
):
    served = Memo(tiny_reference)
    plain, _ = decoded(served, REPETITIVE, 40, Sampler())
    if drafter == "lookup":
        draft = PromptLookup()
    elif drafter == "itself":
        draft = Greedy(served)
    else:
        draft = Greedy(Memo(save_tiny_llama(tmp_path, seed=5)))
    out, stats = decoded(served, REPETITIVE, 40, Sampler(), draft, Fixed(drafts, in_flight))
    assert out == plain
    assert stats.rounds > 0 and stats.proposed > 0
    if drafter == "itself":
        assert stats.accepted == stats.proposed
        assert stats.rounds < 40 / 2


class Warming(Greedy):
    """A drafter that notes when it was warmed on a prompt and when it proposed."""

    def __init__(self, logits: Memo):
        super().__init__(logits)
        self.events: list[tuple] = []

    def warm(self, tokens) -> None:
        self.events.append(("warm", tuple(tokens)))

    def propose(self, tokens, k: int) -> list[int]:
        self.events.append(("propose", len(tokens)))
        return super().propose(tokens, k)


def test_a_drafter_is_warmed_on_the_prompt_before_its_first_proposal(one_thread, tiny_reference):
    served = Memo(tiny_reference)
    draft = Warming(served)
    out, stats = decoded(served, REPETITIVE, 12, Sampler(), draft, Fixed(3, 1))
    assert out == decoded(served, REPETITIVE, 12, Sampler())[0]
    assert draft.events[0] == ("warm", tuple(REPETITIVE))
    assert [e[0] for e in draft.events[1:]] == ["propose"] * (len(draft.events) - 1)
    assert stats.rounds > 0


def test_a_draft_model_warmed_on_a_prompt_proposes_what_it_proposes_cold(one_thread, tiny_family):
    _, folder, _, _ = tiny_family("llama")
    tokenizer = open_model(str(folder)).tokenizer()
    cold = DraftModel(str(folder), tokenizer, "llama").propose(REPETITIVE, 5)
    warmed = DraftModel(str(folder), tokenizer, "llama")
    warmed.warm(REPETITIVE)
    assert warmed._fed == REPETITIVE  # the proposal then feeds only its own drafts
    assert warmed.propose(REPETITIVE, 5) == cold


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory):
    """A tiny Llama of 32 tokens: its next-token distributions at temperature 1 spread over a
    handful of tokens, so a few thousand samples test them."""
    return save_tiny_llama(tmp_path_factory.mktemp("vocab32"), seed=3, vocab_size=32)


STAT_PREFIX = [5, 9, 3, 17, 5, 9]
SAMPLES = 6000


def sequence_bins(logits: Memo, prefix: list[int], tokens: int, least: float) -> dict:
    """Every sequence of `tokens` after `prefix` of probability >= `least`, with it: the
    bins, chosen from the model alone (the rest of the mass is one more bin)."""
    frontier = [((), 1.0)]
    for _ in range(tokens):
        grown = []
        for seq, p in frontier:
            probs = torch.softmax(logits(prefix + list(seq))[-1].double(), -1)
            for t, q in enumerate(probs.tolist()):
                if p * q >= least:
                    grown.append(((*seq, t), p * q))
        frontier = grown
    return dict(frontier)


def chi_square(samples: list[tuple], bins: dict) -> tuple[float, int]:
    """Pearson's statistic of the samples against the bins' probabilities, and its degrees
    of freedom (the bins and the rest, less one)."""
    n, seen = len(samples), Counter(samples)
    rest_p = 1.0 - sum(bins.values())
    rest_seen = n - sum(seen[s] for s in bins)
    stat = sum((seen[s] - n * p) ** 2 / (n * p) for s, p in bins.items())
    stat += (rest_seen - n * rest_p) ** 2 / (n * rest_p)
    return stat, len(bins)


def chi_square_critical(df: int, z: float = 3.090) -> float:
    """The chi-square distribution's upper quantile for `df` degrees of freedom at the
    standard normal's `z` (3.090: p = 0.001), by Wilson and Hilferty's approximation."""
    h = 2.0 / (9.0 * df)
    return df * (1.0 - h + z * math.sqrt(h)) ** 3


def test_the_chi_square_critical_value_matches_the_tables():
    # tables at p = 0.001: df 10 -> 29.59, df 50 -> 86.66, df 100 -> 149.45
    for df, table in [(10, 29.59), (50, 86.66), (100, 149.45)]:
        assert chi_square_critical(df) == pytest.approx(table, rel=0.01)


@pytest.mark.parametrize("speculative", [True, False])
def test_sampled_tokens_follow_the_models_distribution_at_temperature_1(
    one_thread, small_vocab, speculative
):
    """The first three tokens after a prefix, many seeds: their joint distribution (the 2nd
    and 3rd tokens decided by a verification round where speculating) is the model's own,
    by Pearson's chi-square at p = 0.001. Speculative and plain draw from other seeds."""
    served = Memo(small_vocab)
    bins = sequence_bins(served, STAT_PREFIX, 3, 5.0 / SAMPLES)
    assert len(bins) > 20 and sum(bins.values()) < 0.95
    first = SAMPLES if speculative else 0
    samples, proposed, accepted = [], 0, 0
    for seed in range(first, first + SAMPLES):
        sampler = Sampler(Sampling(temperature=1.0, seed=seed))
        draft, tuner = (Greedy(served), Fixed(2, 2)) if speculative else (None, None)
        out, stats = decoded(served, STAT_PREFIX, 3, sampler, draft, tuner)
        samples.append(tuple(out))
        proposed, accepted = proposed + stats.proposed, accepted + stats.accepted
    if speculative:
        assert 0 < accepted < proposed  # rounds decided tokens, and rejected drafts
    stat, df = chi_square(samples, bins)
    assert stat < chi_square_critical(df), (stat, df)


@pytest.mark.parametrize(
    "sampling",
    [dict(temperature=1.0), dict(temperature=0.7, top_k=8, top_p=0.9)],
    ids=["t1", "top"],
)
def test_the_same_seed_samples_the_same_tokens_with_or_without_speculation(
    one_thread, small_vocab, sampling
):
    served = Memo(small_vocab)
    accepted = 0
    for seed in range(40):
        sampler = Sampling(**sampling, seed=seed)
        plain, _ = decoded(served, STAT_PREFIX, 10, Sampler(sampler))
        for draft, tuner in [(Greedy(served), Fixed(3, 3)), (PromptLookup(), Fixed(4, 2))]:
            out, stats = decoded(served, STAT_PREFIX, 10, Sampler(sampler), draft, tuner)
            assert out == plain, seed
            accepted += stats.accepted
    assert accepted > 0


# ---- a node's session: rounds a rejection made stale --------------------------------------


def round_step(pos: int, tokens: int, spec: int):
    msg, _ = step(pos, tokens, pos + tokens, DECODE)
    return replace(msg, spec=spec)


async def session_with_prompt(ctx, nursery, hops: int, prompt: int = 8, max_length: int = 64):
    """A session on the first hop of `hops`, a client attached where it is the last, its
    prompt computed and handed on."""
    msg = replace(open_msg(hops), max_length=max_length)
    session, owner = await start(ctx, nursery, msg)
    if hops > 1:
        await until(lambda: ctx.uplink.control)
        await session.from_downstream(Opened(sid=SID))
    await until(lambda: owner.sent)
    if hops == 1:
        session.attach(Conn(), TOKEN)
    session.take_step(step(0, prompt, prompt)[0])
    await until(lambda: len(ctx.uplink.payloads) == 1)
    return session, owner


@pytest.mark.parametrize("hops", [1, 2], ids=["last hop", "first of two"])
async def test_a_round_after_a_rejection_drops_the_rounds_queued_behind_it(nursery, hops):
    ctx = context(nursery)
    session, _ = await session_with_prompt(ctx, nursery, hops)
    session.take_step(round_step(8, 4, spec=1))
    await until(lambda: len(ctx.uplink.payloads) == 2)
    session.take_step(round_step(12, 4, spec=2))  # sent ahead, still queued when...
    session.take_step(round_step(10, 2, spec=3))  # ...round 1's third token is rejected
    await until(lambda: len(ctx.uplink.payloads) == 3)
    await trio.sleep(0.05)  # a dropped round, had it been computed, is out by now
    sent = ctx.uplink.payloads
    assert [(p.spec, p.pos, p.end) for p in sent[1:]] == [(1, 8, 12), (3, 10, 12)]
    assert [p.result for p in sent[1:]] == [hops == 1] * 2
    assert sent[2].hidden.shape[1] == 2  # every token's state, for the client or next hop
    assert ctx.counters.steps_dropped == 1
    assert session.state.next_pos == 12 and session.cache.length == 12


async def test_a_round_at_the_first_rounds_position_drops_every_round_queued(nursery):
    ctx = context(nursery)
    session, _ = await session_with_prompt(ctx, nursery, hops=1)
    session.take_step(round_step(8, 4, spec=1))
    session.take_step(round_step(12, 4, spec=2))
    session.take_step(round_step(8, 3, spec=3))
    await until(lambda: len(ctx.uplink.payloads) == 2)
    await trio.sleep(0.05)  # a dropped round, had it been computed, is out by now
    assert [(p.spec, p.pos, p.end) for p in ctx.uplink.payloads[1:]] == [(3, 8, 11)]
    assert ctx.counters.steps_dropped == 2
    assert session.state.next_pos == 11 and session.cache.length == 11


async def test_malformed_rounds_are_refused_by_type_and_the_session_goes_on(nursery):
    ctx = context(nursery)
    session, _ = await session_with_prompt(ctx, nursery, hops=1)
    with pytest.raises(ShapeMismatch):
        session.take_step(round_step(8, MAX_VERIFY_TOKENS + 1, spec=1))
    with pytest.raises(ProtocolError, match="may go on at 8"):
        session.take_step(round_step(9, 2, spec=1))  # skips a position
    with pytest.raises(ProtocolError, match="rewind to 8 at the earliest"):
        session.take_step(round_step(7, 2, spec=1))  # into the prompt
    session.take_step(round_step(8, 3, spec=1))
    await until(lambda: len(ctx.uplink.payloads) == 2)
    assert (ctx.uplink.payloads[1].spec, ctx.uplink.payloads[1].end) == (1, 11)
    assert not session.state.closed and ctx.counters.steps_dropped == 0
