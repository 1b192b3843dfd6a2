"""A DHT that cannot be asked is an error callers of the client can catch, like any other."""

from __future__ import annotations

import pytest

from swarm.dht import read_nodes, start_dht
from swarm.errors import DhtGone, DhtUnavailable, SwarmError


def test_reading_a_dead_dht_raises_a_swarm_error():
    dht = start_dht()
    dht.shutdown()
    with pytest.raises(SwarmError) as caught:
        read_nodes(dht, "some-model", 4)
    assert isinstance(caught.value, DhtGone)
    assert "exited" in str(caught.value)


def test_dht_errors_share_one_code_for_the_api():
    assert DhtGone.code == DhtUnavailable.code == "dht_unavailable"
