"""When a cluster lookup may bisect a pod (kv_preflight/index/cluster/merge.py pod_bisectable): its orphan count
known and 0, and no outbox entry left from a step taken while the pod had a gap."""
from kv_preflight.index.cluster import pod_bisectable


def test_a_closed_pod_with_nothing_pending_is_bisected():
    assert pod_bisectable([b"0", None, b"5", b"5"], [])
    assert pod_bisectable([b"0", b"7", b"5", b"5"], [])  # the gapped entry 7 ran and was acked
    assert pod_bisectable([b"0", b"7", b"5", b"5"], [b"8|w1|100", b"9|w1|120"])  # later entries: closed before and after


def test_orphan_keys_or_an_unknown_count_are_walked():
    assert not pod_bisectable([b"2", None, b"5", b"5"], [])
    assert not pod_bisectable([None, None, None, b"5"], [])  # written before the count existed, or imported: unknown
    assert not pod_bisectable([b"x", None, b"5", b"5"], [])


def test_an_entry_from_a_gapped_version_still_on_its_way_is_walked():
    assert not pod_bisectable([b"0", b"7", b"5", b"5"], [b"7|w1|100"])
    assert not pod_bisectable([b"0", b"7", b"5", b"5"], [b"6|w2|90", b"8|w1|120"])


def test_a_count_an_earlier_build_did_not_keep_up_is_walked():
    """A writer of an earlier build (a rolling upgrade) applies batches without the count: its batch count
    moves on, the count's stamp does not."""
    assert not pod_bisectable([b"0", None, b"5", b"6"], [])
    assert pod_bisectable([b"0", None, b"0", None], [])  # written by a clear before any batch
