"""One pass over the DHT for the health page: every model, every node, freshest copies only.

swarm.dht's readers accept any unexpired copy, which for a client-mode peer is often its own
cache, up to a TTL old; a health page would then show a node that left as online. These ask
for the latest copy, and bound what a foreign record can make us read.
"""

from __future__ import annotations

import functools
import logging

from swarm.dht import SwarmView, get_latest
from swarm.records import MAX_LAYERS, MAX_MODELS, MODELS_KEY, ModelRecord, NodeRecord, block_key

log = logging.getLogger(__name__)


def survey(dht, max_models: int = MAX_MODELS, max_layers: int = MAX_LAYERS) -> SwarmView:
    """Read models and node records (blocking). Records that fail validation are counted.

    A model index entry claiming more than `max_layers` layers, or models beyond the first
    `max_models` by name, are skipped and counted too: each layer costs a DHT key to read.
    """
    view = SwarmView()
    raw = dht.run_coroutine(functools.partial(get_latest, keys=[MODELS_KEY]))
    for value, _exp in raw.get(MODELS_KEY, {}).values():
        try:
            m = ModelRecord.from_wire(value)
        except ValueError:
            view.malformed += 1
            continue
        if not 0 < m.num_layers <= max_layers:
            view.malformed += 1
            continue
        view.models.setdefault(m.model, m)
    names = sorted(view.models)
    for name in names[max_models:]:
        del view.models[name]
        view.malformed += 1
    for name in names[:max_models]:
        _read_model_nodes(dht, view, view.models[name])
    return view


def _read_model_nodes(dht, view: SwarmView, model: ModelRecord) -> None:
    keys = [block_key(model.model, b) for b in range(model.num_layers)]
    raw = dht.run_coroutine(functools.partial(get_latest, keys=keys))
    latest: dict[str, tuple[NodeRecord, float]] = {}
    for key, entries in raw.items():
        block = int(key.rsplit(".", 1)[1])
        for value, exp in entries.values():
            try:
                rec = NodeRecord.from_wire(value)
            except ValueError as exc:
                log.debug("skipping malformed record under %s: %s", key, exc)
                view.malformed += 1
                continue
            if rec.model != model.model or not rec.start <= block < rec.end:
                view.malformed += 1
                continue
            old = latest.get(rec.peer)
            if old is None or rec.updated > old[0].updated:
                latest[rec.peer] = (rec, exp)
    view.nodes[model.model] = [rec for rec, _ in latest.values()]
    for peer, (_rec, exp) in latest.items():
        view.expirations[(model.model, peer)] = exp
