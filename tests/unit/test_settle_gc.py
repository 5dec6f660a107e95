"""A served predictor or gateway settles its garbage collector once started (kv_preflight/predictor/http/app.py
``settle_gc``); an app built in-process (a test's) leaves the process's collector alone."""
from __future__ import annotations

import subprocess
import sys

from kv_preflight.config import Config
from kv_preflight.predictor.serve import served

SCRIPT = """
import gc
from kv_preflight.predictor.http.app import GC_GEN0, settle_gc
before = gc.get_freeze_count()
settle_gc()
print(gc.get_threshold()[0] == GC_GEN0, before == 0 < gc.get_freeze_count())
"""


def test_settle_gc_freezes_what_start_up_built_and_collects_the_young_less_often():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", "True"]


def test_only_a_served_app_settles_the_collector():
    from kv_preflight.predictor.http.app import create_app

    app = create_app(Config(valkey_url="redis://127.0.0.1:1/0"))
    assert not getattr(app.state, "settle_gc", False)
    assert served(app).state.settle_gc is True
