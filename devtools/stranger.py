"""A stranger to the swarm, for tests and benchmarks of what it can and cannot do: a stock
hivemind DHT peer (without the swarm's validator), signing keys of its own, oversized values."""

from __future__ import annotations

import hivemind
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.utils.crypto import RSAPrivateKey

from swarm.dht import id_of


def stranger_dht(
    peers: list[str], key: RSAPrivateKey | None = None, validators: list | None = None
) -> hivemind.DHT:
    """A DHT peer of the stranger's, joined to `peers`: stock hivemind, signing with `key` (or
    with what `validators` sign with)."""
    if validators is None:
        validators = [RSASignatureValidator(key)] if key is not None else []
    return hivemind.DHT(initial_peers=peers, record_validators=validators, start=True)


def new_key() -> tuple[RSAPrivateKey, bytes, str]:
    """A fresh signing key, the subkey marker naming it, and the node id it proves."""
    key = RSAPrivateKey()
    marker = RSASignatureValidator(key).local_public_key
    return key, marker, id_of(marker)


async def store_padded(_dht, node, keys, record, pad, subkey, expiration):
    """Runs in the stranger's DHT process (`DHT.run_coroutine`): `record` padded by `pad`
    characters under every one of `keys`; a value this large cannot cross hivemind's pipe."""
    value = {**record, "padding": "x" * pad}
    n = len(keys)
    await node.store_many(keys, [value] * n, expiration_time=expiration, subkeys=[subkey] * n)
