"""The ingester's cycle-collector settings (kv_preflight/collector.py): its per-block objects are never
tracked, and the tuned settings are undone after the body (the bench runs an ingester beside other rows)."""
from __future__ import annotations

import gc

from kv_preflight.index.pod_state import _Block
from kv_preflight.ingester.bridge import ChainPoint
from kv_preflight.collector import THRESHOLDS, tuned_collector


def test_the_objects_held_per_block_are_not_tracked():
    assert not gc.is_tracked(_Block("f", (1, 2), None))
    assert not gc.is_tracked(ChainPoint(7, (1, 2), keys=(3, 4)))


def test_settings_hold_in_the_body_and_are_undone_after():
    before = gc.get_threshold()
    frozen = gc.get_freeze_count()
    with tuned_collector():
        assert gc.get_threshold() == THRESHOLDS
        assert gc.get_freeze_count() > frozen
    assert gc.get_threshold() == before
    assert gc.get_freeze_count() == 0
