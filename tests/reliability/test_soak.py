"""Case 8: soak, short version (the long one is ``bench/soak.py``). The daemon keeps up with
4,000 records/s from 4 producers for 40 s: nothing lost or dropped, lag bounded, resident
memory flat after the warm-up."""

from __future__ import annotations

from tests.reliability.soak import soak


def test_soak_short() -> None:
    result = soak(seconds=40, rate=4000, producers=4, warmup=10)
    print(result)
    assert result["committed"] == result["written"] > 100_000
    assert result["lost"] == 0
    assert result["dropped"] == 0
    assert result["max_lag_bytes"] < 16 << 20
    assert result["max_lag_seconds"] < 10
    assert result["catch_up_seconds"] < 10
    assert result["rss_growth_pct"] < 10
