"""Hypothesis strategies the wire fuzz tests share: scalars, what an attacker puts in a field,
session ids and hops."""

from __future__ import annotations

import msgpack
from hypothesis import strategies as st

from swarm.protocol import Hop

scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=12)
    | st.binary(max_size=24)
)
# what an attacker can put in a field: the above plus NaN and the extension types msgpack decodes
hostile_scalars = (
    scalars
    | st.floats()
    | st.builds(msgpack.ExtType, st.integers(0, 127), st.binary(max_size=8))
    | st.builds(msgpack.Timestamp, st.integers(0, 2**33), st.integers(0, 999_999_999))
)

sids = st.text(max_size=64)
small_ints = st.integers(0, 2**31)
hops = st.builds(
    Hop, st.text(max_size=20), small_ints, small_ints, small_ints, st.text(max_size=20)
)
