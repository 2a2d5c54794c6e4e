"""The claim-latency histogram a worker tells on its last log line (W16's claim p50/p99)."""

from __future__ import annotations

import json

from runpool.claim_times import ClaimTimes, merged_percentiles


def test_claim_times__percentiles_within_a_bucket_and_merged_across_workers() -> None:
    fast, slow = ClaimTimes(), ClaimTimes()
    for i in range(99):
        fast.record(0.002, claimed=i % 3)  # 2 ms; a third of them claimed nothing
    slow.record(0.5, claimed=50)
    one = fast.summary()
    assert one["n"] == 99 and one["empty"] == 33 and one["runs"] == 99
    assert 2.0 <= one["p50_ms"] <= 2.2 and 2.0 <= one["p99_ms"] <= 2.2
    both = json.loads(json.dumps([one, slow.summary()]))  # as read back from the log lines
    p50, p99, top = merged_percentiles(both)
    assert p50 is not None and 2.0 <= p50 <= 2.2
    assert p99 is not None and 2.0 <= p99 <= 2.2  # 99 of 100 claims took 2 ms
    assert top is not None and 500 <= top <= 550
    assert merged_percentiles([ClaimTimes().summary()]) == (None, None, None)
