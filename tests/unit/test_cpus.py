"""Pinning engine instances: the kernel's CPU list syntax, and how `halfmoon up
--pin-engines` hands out cores."""

from __future__ import annotations

import pytest

from shared.cpus import engine_cpus, parse_cpus


def test_cpu_lists_parse_as_the_kernel_writes_them():
    assert parse_cpus("0") == {0}
    assert parse_cpus("0-3,8") == {0, 1, 2, 3, 8}
    assert parse_cpus(" 1 , 3-4") == {1, 3, 4}
    for bad in ("", "a", "3-1", "1-", "-2", "1,,2"):
        with pytest.raises(ValueError, match="CPU list"):
            parse_cpus(bad)


def test_engines_get_cores_round_robin():
    cores = [0, 1]
    # Two prefill stages and a decode instance, one thread each, on two cores: the
    # stages apart, decode beside the first (it is idle while a prompt is prefilled).
    assert [engine_cpus(i, 1, cores) for i in range(3)] == ["0", "1", "0"]
    assert [engine_cpus(i, 2, [0, 1, 2, 3]) for i in range(2)] == ["0,1", "2,3"]
    assert engine_cpus(0, 4, [0, 1]) == "0,1"  # more threads than cores: all of them
