"""TLS on the data plane, with the peer identified by a key its signed DHT record names.

A node makes a fresh key and a self-signed certificate at start and puts the SHA-256 of the
certificate's public key (`key_id`) in its DHT record, which hivemind's signature validator lets
only the record's owner write. Whoever dials a node knows from the record which key to expect and
checks it after the handshake, so nothing else at the node's address can pass for it. No
certificate authority is involved: the DHT record plays that part. The node does not check who
dialled it (clients have no identity to prove).
"""

from __future__ import annotations

import datetime
import hashlib
import socket
import ssl
import tempfile
from dataclasses import dataclass
from pathlib import Path

import trio
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from swarm.errors import WrongPeer

HANDSHAKE_TIMEOUT_S = 10.0
TLS_HANDSHAKE = 0x16  # the first byte of every TLS connection (a handshake record)


async def peek_byte(conn) -> int | None:
    """The first byte waiting on a FramedStream's socket, left there (None: closed)."""
    sock = conn.socket
    data = await sock.recv(1, socket.MSG_PEEK)
    return data[0] if data else None


def key_id(certificate_der: bytes) -> str:
    """Hex SHA-256 of a DER certificate's SubjectPublicKeyInfo: what a record announces."""
    public = x509.load_der_x509_certificate(certificate_der).public_key()
    spki = public.public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return hashlib.sha256(spki).hexdigest()


@dataclass(frozen=True)
class Identity:
    """A node's TLS key and certificate, and the context that presents them."""

    key_id: str
    context: ssl.SSLContext

    @classmethod
    def generate(cls) -> Identity:
        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "swarm node")])
        now = datetime.datetime.now(datetime.UTC)
        cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=3650))
            .sign(key, hashes.SHA256())
        )
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_3
        # ssl loads keys only from files: write them to a private temporary directory
        with tempfile.TemporaryDirectory() as tmp:
            cert_file, key_file = Path(tmp, "cert.pem"), Path(tmp, "key.pem")
            cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
            key_file.write_bytes(
                key.private_bytes(
                    serialization.Encoding.PEM,
                    serialization.PrivateFormat.PKCS8,
                    serialization.NoEncryption(),
                )
            )
            context.load_cert_chain(cert_file, key_file)
        return cls(key_id(cert.public_bytes(serialization.Encoding.DER)), context)

    async def accept(self, stream: trio.abc.Stream) -> trio.SSLStream:
        """The server side of a handshake on an accepted connection (bounded in time)."""
        tls = trio.SSLStream(stream, self.context, server_side=True)
        with trio.fail_after(HANDSHAKE_TIMEOUT_S):
            await tls.do_handshake()
        return tls


def _client_context() -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    # the peer is checked against the key its DHT record names, in `dial`, not against a CA
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    return context


CLIENT_CONTEXT = _client_context()


class _Recorded(trio.abc.Stream):
    """A stream that keeps the first bytes it receives: a node refusing a connection answers
    with a plaintext error frame where a TLS handshake was expected."""

    def __init__(self, stream: trio.abc.Stream):
        self.stream, self.head = stream, bytearray()

    @property
    def socket(self):
        return self.stream.socket

    async def send_all(self, data) -> None:
        await self.stream.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self.stream.wait_send_all_might_not_block()

    async def receive_some(self, max_bytes=None) -> bytes:
        data = await self.stream.receive_some(max_bytes)
        if len(self.head) < 4096:
            self.head += data[: 4096 - len(self.head)]
        return data

    async def aclose(self) -> None:
        await self.stream.aclose()


def refusal(head: bytes):
    """The error frame a node sent instead of a handshake (`head`: the first bytes it sent),
    as its exception; None if there was none."""
    from swarm.protocol import Error, parse_message
    from swarm.wire import FrameDecoder

    decoder = FrameDecoder(4096)
    try:
        decoder.feed(bytes(head))
        raw = decoder.next_message()
        msg = parse_message(raw) if raw is not None else None
    except Exception:  # not a frame of ours: the handshake failed for its own reason
        return None
    return msg.exception() if isinstance(msg, Error) else None


async def dial(stream: trio.abc.Stream, expected_key: str, where: str) -> trio.SSLStream:
    """The client side of a handshake on `stream`; raises WrongPeer unless the peer's
    certificate carries `expected_key`, and the node's own error (NodeBusy, say) if it
    refused the connection before TLS."""
    recorded = _Recorded(stream)
    tls = trio.SSLStream(recorded, CLIENT_CONTEXT, server_side=False)
    try:
        with trio.fail_after(HANDSHAKE_TIMEOUT_S):
            await tls.do_handshake()
    except trio.BrokenResourceError:
        refused = refusal(recorded.head)
        if refused is not None:
            raise refused from None
        raise
    try:
        check_key(tls.getpeercert(binary_form=True), expected_key, where)
    except WrongPeer:
        await trio.aclose_forcefully(tls)
        raise
    return tls


def check_key(der: bytes | None, expected_key: str, where: str) -> None:
    """Raises WrongPeer unless the certificate `der` a handshake got carries `expected_key`."""
    got = key_id(der) if der else "(none)"
    if got != expected_key:
        raise WrongPeer(
            f"the peer at {where} is not the node its record names: its TLS key is"
            f" {got[:16]}…, the record says {expected_key[:16]}…"
        )
