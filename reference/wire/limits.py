"""The wire's limits: every size and count a frame, a message or a session may reach, named once.

Relations between them are asserted here, at import: a frame without block data always fits the
control limit, and a frame with a whole block always fits the data limit.
"""

from __future__ import annotations

from kvcc.spec.keys import DIGEST_BYTES

FRAME_HEADER_BYTES = 4
MAX_BLOCK_BYTES = 64 << 20  # block data carried by WriteBytes / BytesRead
MAX_CONTROL_FRAME_BYTES = 4 << 20  # any frame without block data fits (see the asserts below)
MAX_FRAME_BYTES = MAX_BLOCK_BYTES + MAX_CONTROL_FRAME_BYTES  # data connections
# A server accepts no frame above this before one frame of the connection authenticated (the MAC
# is checked only once a frame is whole): an unauthenticated peer can make it buffer this much, not
# a block. Clients open every connection with a Ping, so a block may be the next frame.
MAX_UNAUTHENTICATED_FRAME_BYTES = 64 << 10
MAX_WIRE_INT = 2**63 - 1  # every int field: 0 .. 2**63-1, a signed 64-bit int in any language
MAX_ID_BYTES = 128  # node and location ids (UTF-8)
MAX_TENANT_BYTES = 128
MAX_CODE_BYTES = 64  # error codes, refusal reasons, scopes: [a-z][a-z0-9_]*
MAX_TEXT_BYTES = 4096  # Error.text (UTF-8)
MAX_LOOKUP_KEYS = 16384  # keys in one Lookup, locations in one PrefixFound
MAX_BATCH_ITEMS = 1024  # requests in one Batch (a chain of 1024 blocks: 32k tokens of 32)
# Block data one Batched reply of a node carries: the reads past it are answered ``batch_full``
# (read them alone). Below MAX_BLOCK_BYTES, so that every batched item decodes as one string.
MAX_BATCH_DATA_BYTES = 32 << 20
MAX_MESSAGE_FIELDS = 16  # entries of one message map, kind included
MAX_WAIT_TICKET_MS = 30_000  # longest WaitTicket.timeout_ms; servers' request timeouts exceed it
HEARTBEAT_INTERVAL_MS = 250  # a node pings the directory this often: silence means it is down
MIN_TOKEN_BYTES = 16  # a tenant token shorter than 128 bits is refused at configuration
MAC_BYTES = 32  # HMAC-SHA256
SESSION_NONCE_BYTES = 16  # each side's fresh random value, in its first frame: the session key binds both

_ENVELOPE_OVERHEAD_BYTES = 64 + MAX_TENANT_BYTES + MAC_BYTES + SESSION_NONCE_BYTES  # map, names, ints, heads
assert MAX_FRAME_BYTES < 2**32, "the length header is 4 bytes"
assert 1024 + _ENVELOPE_OVERHEAD_BYTES <= MAX_UNAUTHENTICATED_FRAME_BYTES <= MAX_CONTROL_FRAME_BYTES
assert MAX_LOOKUP_KEYS * (DIGEST_BYTES + 3) + 1024 + _ENVELOPE_OVERHEAD_BYTES <= MAX_CONTROL_FRAME_BYTES
assert MAX_LOOKUP_KEYS * (MAX_ID_BYTES + 3) + 1024 + _ENVELOPE_OVERHEAD_BYTES <= MAX_CONTROL_FRAME_BYTES
assert MAX_BLOCK_BYTES + 4096 + _ENVELOPE_OVERHEAD_BYTES <= MAX_FRAME_BYTES
# A Batch of read-lease requests, or its Batched answer (grants included), fits a control frame;
# a node's Batched reads fit a data frame.
_BATCH_ITEM_BYTES = 1024  # an Acquire, Renew or Release, or its answer with a grant, encoded (with margin)
assert MAX_BATCH_ITEMS <= MAX_LOOKUP_KEYS
assert MAX_BATCH_ITEMS * _BATCH_ITEM_BYTES + _ENVELOPE_OVERHEAD_BYTES <= MAX_CONTROL_FRAME_BYTES
assert MAX_BATCH_DATA_BYTES + 4096 <= MAX_BLOCK_BYTES
assert MAX_BATCH_DATA_BYTES + MAX_BATCH_ITEMS * _BATCH_ITEM_BYTES + _ENVELOPE_OVERHEAD_BYTES <= MAX_FRAME_BYTES
