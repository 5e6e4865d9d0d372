import torch

from shared.engine.disk_tier import DiskTier


def block(seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 3, 4, generator=g).bfloat16(), torch.randn(
        2, 3, 4, generator=g
    ).bfloat16()


def test_round_trip_and_lru_by_bytes(tmp_path):
    k, v = block(0)
    tier = DiskTier(tmp_path, capacity_bytes=10_000)
    assert tier.put(1, (5, 6), k, v)
    tokens, k2, v2 = tier.get(1, k, v)
    assert tokens == (5, 6) and torch.equal(k, k2) and torch.equal(v, v2)
    size = tier.nbytes
    tier2 = DiskTier(tmp_path / "small", capacity_bytes=2 * size)
    for h in (1, 2, 3):
        assert tier2.put(h, (h,), *block(h))
    assert 1 not in tier2 and 2 in tier2 and 3 in tier2  # oldest went first
    assert tier2.drain_removed() == [1]
    assert not (tmp_path / "small" / f"{1:016x}.kvb").exists()


def test_corrupt_file_is_a_miss_not_a_crash(tmp_path):
    k, v = block(1)
    tier = DiskTier(tmp_path, 10_000)
    tier.put(7, (1,), k, v)
    (tmp_path / f"{7:016x}.kvb").write_bytes(b"junk")
    assert tier.get(7, k, v) is None and 7 not in tier


def test_restart_forgets_old_files(tmp_path):
    k, v = block(2)
    DiskTier(tmp_path, 10_000).put(9, (1,), k, v)
    assert list(tmp_path.glob("*.kvb")) and 9 not in DiskTier(tmp_path, 10_000)
    assert not list(tmp_path.glob("*.kvb"))
