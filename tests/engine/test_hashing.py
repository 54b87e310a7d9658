from __future__ import annotations

import json
import os
import subprocess
import sys

import cbor2
import pytest
import xxhash

from pdserve.engine.kvcache.hashing import BlockHasher, block_hashes, hash_block_tokens, none_hash, xxhash_cbor

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def independent(obj: object) -> bytes:
    # The contract's formula written out again, not through the module under test.
    return xxhash.xxh3_128_digest(cbor2.dumps(obj, canonical=True))


def test_contract_vectors() -> None:
    assert none_hash("0").hex() == "1ebe36576dcb573f26b99533a20aaeca"
    hs = block_hashes(list(range(32)), 16, seed="0")
    assert [h.hex() for h in hs] == ["209f5d549fc07c8e39d823615ede61ce", "03888914ee75b87e89df867a21beb72b"]
    salted = block_hashes(list(range(16)), 16, seed="0", cache_salt="tenant-a")
    assert salted[0].hex() == "bfbfafff3fa6ee68c398534127fa2299"


def test_matches_formula_with_lora_and_salt() -> None:
    tokens = list(range(100, 148))
    hs = block_hashes(tokens, 16, seed="s", cache_salt="salt", lora_name="lora1")
    root = independent("s")
    h0 = independent((root, tuple(tokens[:16]), ("lora1", "salt")))
    h1 = independent((h0, tuple(tokens[16:32]), ("lora1",)))
    h2 = independent((h1, tuple(tokens[32:48]), ("lora1",)))
    assert hs == [h0, h1, h2]
    assert xxhash_cbor("x") == independent("x")
    assert hash_block_tokens(None, tokens[:16], None, "s") == independent((root, tuple(tokens[:16]), None))


def test_only_full_blocks_hashed() -> None:
    assert block_hashes(list(range(15)), 16) == []
    assert len(block_hashes(list(range(33)), 16)) == 2
    assert block_hashes([], 16) == []


def test_seed_and_salt_change_hashes() -> None:
    t = list(range(16))
    base = block_hashes(t, 16)[0]
    assert block_hashes(t, 16, seed="secret")[0] != base
    assert block_hashes(t, 16, cache_salt="a")[0] != base
    assert block_hashes(t, 16, cache_salt="a")[0] != block_hashes(t, 16, cache_salt="b")[0]
    # the salt only enters block 0 but changes every later hash through the chain
    a = block_hashes(list(range(32)), 16, cache_salt="a")
    b = block_hashes(list(range(32)), 16)
    assert a[1] != b[1]


def test_incremental_hasher_never_rehashes() -> None:
    tokens = list(range(1000, 1000 + 16 * 5 + 3))
    h = BlockHasher(16, seed="0")
    for t in tokens:
        h.extend([t])
    assert h.hashes == block_hashes(tokens, 16)
    assert h.hash_calls == 5  # each full block hashed exactly once
    h.extend(list(range(13)))
    assert h.hash_calls == 6 and len(h.hashes) == 6


def test_bad_inputs() -> None:
    with pytest.raises(ValueError):
        BlockHasher(0)
    with pytest.raises(TypeError):
        none_hash(0)  # type: ignore[arg-type]


_CHILD = """
import json, sys
from pdserve.engine.kvcache.hashing import block_hashes
seed, salt = sys.argv[1], sys.argv[2] or None
print(json.dumps([h.hex() for h in block_hashes(list(range(64)), 16, seed=seed, cache_salt=salt)]))
"""


def _child_hashes(pyhashseed: str, seed: str, salt: str = "") -> list[str]:
    env = dict(os.environ, PYTHONHASHSEED=pyhashseed, PYTHONPATH=REPO)
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, seed, salt], env=env, capture_output=True, text=True, check=True, timeout=60
    )
    return json.loads(out.stdout)


def test_deterministic_across_processes() -> None:
    a = _child_hashes("1", "0")
    b = _child_hashes("12345", "0")
    assert a == b == [h.hex() for h in block_hashes(list(range(64)), 16)]
    assert _child_hashes("1", "other") != a
    assert _child_hashes("7", "0", "tenant") != a
