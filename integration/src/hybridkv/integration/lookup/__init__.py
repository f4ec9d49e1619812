"""The scheduler's requests to the pool, made of worker rank 0 over ZMQ.

The scheduler process holds no store client; worker rank 0 does. One round trip (DEALER to
REP) per query carries the block hashes of that query, with the group and heads whose
objects it asks about (msgspec-encoded; past the request caps below, several do; a long
prompt's lookup is a few small queries, see `hit_finder`); the server renders their keys
with its model's key space and answers per hash (`block_query`). A lookup by rendered
keys is still answered (tests, tools); a
cache reset asks for the model's objects to be removed the same way
(which objects, the server alone decides: its own model's, so that whoever reaches its
loopback port cannot name others'). The server answers every request, a malformed one with
an error, and survives anything a request does; the client gives up after a timeout and
reports "unknown", which the scheduler treats as a miss (recompute), never as a hang. After
a timeout the pool counts as down (`Breaker`): lookups are misses at once, without being
sent, until a probe (sent without blocking, on a backoff) is answered: a stalled master
costs the scheduler's loop one timeout per outage, not one per lookup.

Unless a fixed loopback port is configured, worker rank 0 listens on a Unix socket in a
directory only its user can enter, named by the engine: no other local user can ask it
anything (a loopback port is open to every user of the host), and the scheduler finds it
without a port to pass around. Once answered, the scheduler removes the socket's path
(its connection stays): nobody else can connect from then on, and no file outlives the
instance even when its workers are killed.

A fixed port is open to every local user: with `HYBRIDKV_LOOKUP_SECRET` set on both sides,
the server speaks ZMQ CURVE with keys derived from it, so that a peer without the secret
completes no handshake (it can neither ask nor answer) and nothing it sends reaches the
server as a request. The server refuses requests past `MAX_REQUEST_KEYS` keys (by hashes:
(hash, head) pairs) or `MAX_REQUEST_BYTES` bytes (ZMQ drops a peer that sends a larger
message); the client splits a longer lookup into several round trips under those caps.
"""

from hybridkv.integration.lookup.breaker import Breaker
from hybridkv.integration.lookup.channel import (
    LOOPBACK,
    LookupChannel,
    claim_socket,
    is_private,
    remove_socket,
    socket_path,
)
from hybridkv.integration.lookup.client import LookupClient
from hybridkv.integration.lookup.server import LookupServer
from hybridkv.integration.lookup.wire import (
    MAX_REQUEST_BYTES,
    MAX_REQUEST_KEYS,
    SECRET_ENV,
    LookupReply,
    LookupRequest,
    RemoveRequest,
    lookup_secret,
)

__all__ = [
    "LOOPBACK",
    "MAX_REQUEST_BYTES",
    "MAX_REQUEST_KEYS",
    "SECRET_ENV",
    "Breaker",
    "LookupChannel",
    "LookupClient",
    "LookupReply",
    "LookupRequest",
    "LookupServer",
    "RemoveRequest",
    "claim_socket",
    "is_private",
    "lookup_secret",
    "remove_socket",
    "socket_path",
]
