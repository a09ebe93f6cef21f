"""Who may talk to the store: one secret per store, checked on every connection before any message.

Every shard and index socket is a ZeroMQ server with a ZAP handler (RFC 27) on its own context:
libzmq asks the handler about each new connection during the handshake, and a peer the handler
refuses never produces a single message; it gets no reply and changes nothing. Two mechanisms:

* ``PLAIN`` (default): the client presents the store's secret; checked in constant time. Not
  encrypted, which costs nothing: on the same host the bytes go through shared memory anyway.
* ``CURVE`` (``StoreConfig.encrypt=True``, for tcp between hosts): the client proves it holds the
  store's client key pair and the traffic is encrypted (about 3x slower for bulk bytes here, see
  bench/README.md).

The credentials are made by whoever starts the store, handed to its actors at creation, and given
to clients only by the index actor's Ray method ``info`` (Ray authenticates its own calls with the
cluster's token), so only processes of the Ray cluster can obtain them. The registry that lists
the endpoints is not a secret; the credentials are (``Credentials`` never prints them).

    >>> creds = Credentials.new(encrypt=False)
    >>> secure_server(router, creds, curve=False)   # before bind
    >>> secure_client(dealer, creds, curve=False)   # before connect
"""

from __future__ import annotations

import hmac
import secrets
from dataclasses import dataclass, fields
from typing import Any

import zmq
import zmq.utils.z85

ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # fixed by RFC 27; one handler per zmq context
DOMAIN = b"dataplane"
USER = b"dataplane"


@dataclass(frozen=True)
class Credentials:
    """A store's secrets: the PLAIN password and, for ``encrypt=True``, CURVE key pairs (z85)."""

    secret: str
    server_public: str = ""
    server_secret: str = ""
    client_public: str = ""
    client_secret: str = ""

    @classmethod
    def new(cls, encrypt: bool) -> Credentials:
        if not encrypt:
            return cls(secrets.token_hex(32))
        server_public, server_secret = zmq.curve_keypair()
        client_public, client_secret = zmq.curve_keypair()
        return cls(
            secrets.token_hex(32),
            server_public.decode(),
            server_secret.decode(),
            client_public.decode(),
            client_secret.decode(),
        )

    @property
    def encrypt(self) -> bool:
        return bool(self.server_public)

    def for_clients(self) -> Credentials:
        """What a client needs (never the server's secret key)."""
        return Credentials(self.secret, self.server_public, "", self.client_public, self.client_secret)

    def to_dict(self) -> dict[str, str]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Credentials:
        return cls(**{f.name: str(d.get(f.name, "")) for f in fields(cls)})

    def __repr__(self) -> str:  # never print a secret
        return f"Credentials(encrypt={self.encrypt})"


def secure_server(sock: zmq.Socket[bytes], creds: Credentials, curve: bool) -> None:
    """Make ``sock`` (before ``bind``) accept only peers that pass the ZAP check."""
    sock.zap_domain = DOMAIN
    sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)  # no handler reachable = refuse, never allow
    if curve:
        sock.curve_server = True
        sock.curve_secretkey = creds.server_secret.encode()
    else:
        sock.plain_server = True


def secure_client(sock: zmq.Socket[bytes], creds: Credentials, curve: bool) -> None:
    """Give ``sock`` (before ``connect``) the credentials the store's servers check."""
    if not creds.secret:
        raise ValueError("no store credentials: attach with dp.init(), which fetches them from the index")
    if curve:
        sock.curve_serverkey = creds.server_public.encode()
        sock.curve_publickey = creds.client_public.encode()
        sock.curve_secretkey = creds.client_secret.encode()
    else:
        sock.plain_username = USER
        sock.plain_password = creds.secret.encode()


def zap_reply(frames: list[bytes], creds: Credentials) -> list[bytes]:
    """The ZAP reply to one request (RFC 27): 200 for the store's own peers, 400 for anyone else."""
    request_id = frames[1] if len(frames) > 1 else b""
    ok = False
    if len(frames) >= 6 and frames[0] == b"1.0" and frames[2] == DOMAIN:
        mechanism, cred = frames[5], frames[6:]
        if mechanism == b"PLAIN" and len(cred) == 2:
            ok = hmac.compare_digest(cred[0], USER) & hmac.compare_digest(cred[1], creds.secret.encode())
        elif mechanism == b"CURVE" and len(cred) == 1 and creds.client_public:
            ok = hmac.compare_digest(cred[0], zmq.utils.z85.decode(creds.client_public))
    if ok:
        return [b"1.0", request_id, b"200", b"OK", USER, b""]
    return [b"1.0", request_id, b"400", b"not a peer of this store", b"", b""]


__all__ = ["DOMAIN", "ZAP_ENDPOINT", "Credentials", "secure_client", "secure_server", "zap_reply"]
