"""The pure parts of scripts/bench_link.py: the report and the ratio it states."""

from __future__ import annotations

from scriptload import load

bench = load("bench_link")


def test_the_report_names_both_paths_the_cipher_and_their_ratio() -> None:
    r = {
        "bytes": 2_000_000_000,
        "cipher": "TLS_AES_256_GCM_SHA384",
        "ferry_gbps": 0.5,
        "ferry_s": 4.0,
        "raw_gbps": 1.0,
        "raw_s": 2.0,
        "ratio": bench.ratio(0.5, 1.0),
    }
    text = bench.format_report(r)
    assert "2.00 GB on loopback, cipher TLS_AES_256_GCM_SHA384" in text
    assert "0.50 GB/s (4.00 s" in text and "1.00 GB/s (2.00 s)" in text
    assert text.splitlines()[-1] == "  ferry / raw: 0.50"
    assert bench.ratio(1.0, 0.0) is None
