"""The pure parts of scripts/bench_link.py: the report, the ratio it states, the log's span."""

from __future__ import annotations

from scriptload import load

bench = load("bench_link")


def test_the_report_names_both_paths_the_cipher_and_their_ratios() -> None:
    r = {
        "bytes": 2_000_000_000,
        "cipher": "TLS_AES_256_GCM_SHA384",
        "ferry_gbps": 0.5,
        "ferry_s": 4.0,
        "dump_gbps": 0.4,
        "dump_s": 5.0,
        "dump_ratio": bench.ratio(0.4, 1.0),
        "raw_gbps": 1.0,
        "raw_s": 2.0,
        "ratio": bench.ratio(0.5, 1.0),
    }
    text = bench.format_report(r)
    assert "2.00 GB on loopback, cipher TLS_AES_256_GCM_SHA384" in text
    assert "0.50 GB/s (4.00 s, first page to last)" in text
    assert "0.40 GB/s (5.00 s, freeze" in text and "1.00 GB/s (2.00 s)" in text
    assert text.splitlines()[-1] == "  ferry / raw: 0.50 (whole dump / raw: 0.40)"
    assert bench.ratio(1.0, 0.0) is None


def test_the_transfer_span_runs_from_the_first_page_transfer_to_the_last_send() -> None:
    log = (
        b"(00.036260) Connecting to server 127.0.0.1:42399\n"
        b"(00.086758) page-xfer: Transferring pages:\n"
        b"(00.086792) page-xfer: Sending 1000 bytes\n"
        b"(01.500000) page-xfer: \tbuf 400/1\n"
        b"(01.810343) page-xfer: Sending 8000 bytes\n"
        b"(02.016534) Dumping finished successfully\n"
    )
    assert abs(bench.transfer_span_s(log) - (1.810343 - 0.086758)) < 1e-9
    assert bench.transfer_span_s(b"(00.1) Dumping finished successfully\n") is None
