"""What every DHT peer of a swarm stores for others and takes from them.

Anyone can write to a DHT. hivemind's RSASignatureValidator checks the signature of a record
whose subkey names its owner's public key, but lets a record without one through, so a stranger
could write records under anyone's name. Here every value must be signed that way (so a record
speaks only for the key that signed it; readers bind the node id to that key, see
`swarm.dht.id_of`), be small, and expire soon. Imported only by `swarm.dht.start_dht`, in the
process that starts the DHT: it needs hivemind, which is slow to import.
"""

from __future__ import annotations

import re

from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils import get_dht_time

from swarm.records import MAX_TTL_S

MAX_VALUE_BYTES = 8 * 1024  # a node record with every link figure is under 2 KiB
OWNER = re.compile(RSASignatureValidator.PUBLIC_KEY_REGEX)


class SwarmValidator(RecordValidatorBase):
    """Signed, small, short-lived values only; the signature itself is checked by hivemind's
    RSASignatureValidator, which runs before this one (its priority is higher)."""

    def validate(self, record: DHTRecord) -> bool:
        if record.subkey is None or not OWNER.search(record.subkey):
            return False  # unsigned: nobody answers for it
        if len(record.value) > MAX_VALUE_BYTES:
            return False
        return record.expiration_time <= get_dht_time() + MAX_TTL_S

    @property
    def priority(self) -> int:
        return 0

    def merge_with(self, other: RecordValidatorBase) -> bool:
        return isinstance(other, SwarmValidator)
