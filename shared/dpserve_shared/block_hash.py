"""The one hash of KV-cache blocks, shared by the engines' prefix caches and the frontends' routing.

A block is `block_size` consecutive token ids; its hash is chained: blake2b (8-byte digest) of the parent
block's hash (8 bytes, little-endian; 0 for a prompt's first block) followed by the block's token ids (8 bytes
each, signed, little-endian). The result is an int in [0, 2**63), so it survives msgpack as a plain integer. It
depends on nothing but those bytes: the same value in every process and on every host, whatever
PYTHONHASHSEED is (Python's own `hash()` of a tuple holding None is not: None's hash is its address in 3.11).

Two blocks collide with probability ~2**-63 per pair: a collision would make a prefix hit serve another prompt's
K/V, which is the same risk vLLM takes with its (longer) digests; 64 bits keeps the index compact.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence
from hashlib import blake2b

ROOT_HASH = 0  # the parent of a prompt's first block
_MASK = (1 << 63) - 1
_SWAP = sys.byteorder != "little"


def block_hash(parent_hash: int | None, token_ids: Sequence[int]) -> int:
    """The hash of one block whose preceding block hashes to `parent_hash` (None or ROOT_HASH: the first)."""
    tokens = array("q", token_ids)
    if _SWAP:
        tokens.byteswap()
    digest = blake2b((parent_hash or ROOT_HASH).to_bytes(8, "little"), digest_size=8)
    digest.update(tokens)
    return int.from_bytes(digest.digest(), "little") & _MASK


def block_hashes(token_ids: Sequence[int], block_size: int, parent_hash: int | None = None,
                 max_blocks: int | None = None) -> list[int]:  # fmt: skip
    """The chained hashes of the full blocks of `token_ids` (a partial last block has none), in order; at most
    `max_blocks` of them."""
    num_blocks = len(token_ids) // block_size
    if max_blocks is not None:
        num_blocks = min(num_blocks, max_blocks)
    hashes = []
    parent = parent_hash
    for i in range(num_blocks):
        parent = block_hash(parent, token_ids[i * block_size : (i + 1) * block_size])
        hashes.append(parent)
    return hashes
