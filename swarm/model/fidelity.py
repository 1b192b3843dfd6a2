"""How faithful a span's weights are: teacher-forced logits against a reference model's."""

from __future__ import annotations

import torch

# A fixed text for agreement and perplexity (written for this project; plain English prose).
SAMPLE_TEXT = """\
The harbour town wakes before the sun. Fishing boats leave in a line, their lamps swinging,
while the bakers on the hill pull the first loaves from brick ovens. By seven the market square
fills with carts of apples, cheese and salted fish, and the town clock, which has run four
minutes slow for as long as anyone remembers, strikes the hour to nobody's surprise.
Children walk to the school by the old lighthouse. Their teacher, a retired ship's engineer,
explains tides with a bucket of water and a torch, and fractions with a loaf of bread. In the
afternoon the wind turns, the gulls settle on the roofs, and the boats come home heavy or
light depending on luck and weather. Prices in the market follow the catch: a good day makes
fish cheap and the fishermen cheerful; a poor one fills the tavern early.
In winter the storms arrive from the west. Shutters are closed, ropes doubled, and the boats
stay in the harbour for days. People mend nets, write letters, and argue about the council's
plan to build a new road over the hills. Some say the road will bring visitors and money;
others say it will bring noise and take the young people away to the cities. The debate has
lasted eleven years, and the road has not been built.
Spring brings the painters, who set up easels on the quay and try to catch the colour of the
water at dusk, which changes from grey to green to a deep violet in the space of an hour.
Most of them leave with unfinished pictures and promise to return. Many of them do.
"""


@torch.inference_mode()
def span_logits(span, head, ids: list[int], step: int | None = None) -> torch.Tensor:
    """Logits [tokens, vocab] at every position of `ids` through `span`: one prompt pass, or
    `step` tokens at a time (1: every position as a decode step, through the decode kernels)."""
    cache = span.allocate_cache(span.start, span.end, len(ids))
    step = step or len(ids)
    pieces = [ids[i : i + step] for i in range(0, len(ids), step)]
    hidden = torch.cat(
        [
            span.forward(head.embed_tokens(p), cache, i * step, span.start, span.end, ids=p)
            for i, p in enumerate(pieces)
        ],
        dim=1,
    )
    return torch.stack([head.logits(hidden[:, i]) for i in range(len(ids))])


@torch.inference_mode()
def reference_logits(model, ids: list[int]) -> torch.Tensor:
    """Logits [tokens, vocab] of a transformers causal LM over `ids`."""
    return model(torch.tensor([ids])).logits[0].float()


def agreement(logits: torch.Tensor, reference: torch.Tensor) -> float:
    """Share of positions where the top-1 token equals the reference's top-1 token."""
    return (logits.argmax(-1) == reference.argmax(-1)).float().mean().item()


def perplexity(logits: torch.Tensor, ids: list[int]) -> float:
    """exp of the mean negative log-likelihood of ids[1:] given the logits before each."""
    logprobs = torch.log_softmax(logits[:-1].float(), dim=-1)
    nll = -logprobs.gather(1, torch.tensor(ids[1:])[:, None]).mean()
    return float(torch.exp(nll))
