from shared.hashing import (
    block_hashes,
    common_prefix_blocks,
    from_signed,
    hash_block,
    root_hash,
    to_signed,
)


def test_only_full_blocks_are_hashed():
    assert len(block_hashes(list(range(47)), 16)) == 2
    assert len(block_hashes(list(range(48)), 16)) == 3
    assert block_hashes(list(range(15)), 16) == []


def test_chain_means_equal_prefix():
    a = list(range(64))
    b = list(range(32)) + [999] + list(range(33, 64))
    ha, hb = block_hashes(a, 16), block_hashes(b, 16)
    assert ha[:2] == hb[:2]
    # block 3 has identical tokens in both, but its parent differs, so its hash differs
    assert ha[3] != hb[3]
    assert common_prefix_blocks(ha, hb) == 2


def test_hash_is_the_chained_definition():
    tokens = list(range(32))
    h0 = hash_block(root_hash(""), tokens[:16])
    assert block_hashes(tokens, 16) == [h0, hash_block(h0, tokens[16:])]


def test_salt_isolates_tenants():
    tokens = list(range(32))
    assert (
        common_prefix_blocks(block_hashes(tokens, 16, salt="a"), block_hashes(tokens, 16, salt="b"))
        == 0
    )
    assert block_hashes(tokens, 16, salt="a") == block_hashes(tokens, 16, salt="a")


def test_signed_mapping_round_trips_and_fits_bigint():
    for h in block_hashes(list(range(16 * 50)), 16) + [0, (1 << 64) - 1, 1 << 63]:
        s = to_signed(h)
        assert -(1 << 63) <= s < (1 << 63)
        assert from_signed(s) == h
