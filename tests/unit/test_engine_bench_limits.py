"""`bench engine`'s limits: each precision's peak is timed with the kernels the engine
runs, so a roofline bounds what the engine could do, not an op it never calls."""

from __future__ import annotations

from services.tools.bench.engine import machine
from shared.engine.linear import DenseLinear, Int8Linear


def test_int8_s_peak_is_the_engine_s_weight_only_linear_not_integer_products(monkeypatch):
    called: list[str] = []
    for cls in (DenseLinear, Int8Linear):
        real = cls.__call__

        def spy(self, x, _real=real, _name=cls.__name__):
            called.append(_name)
            return _real(self, x)

        monkeypatch.setattr(cls, "__call__", spy)
    got = machine.peaks(["float32"], "float32", n=256)
    assert set(got) == {"float32", "int8", "int8_w8a8"}
    assert all(v > 0 for v in got.values())
    assert "Int8Linear" in called and "DenseLinear" in called
    # the dense peak is never below the library's own matmul in the same dtype
    assert got["float32"] >= 0.5 * machine.peak_matmul("float32", 256)


def test_a_run_without_int8_times_no_int8():
    assert set(machine.peaks(["float32"], None, n=128)) == {"float32"}
