"""`scripts/bench --json-file`: a file, or a directory that gets one dated file per run (benchmarks/)."""
from __future__ import annotations

import calendar
import time

from kv_preflight.cli.bench.measure import source_commit
from kv_preflight.cli.bench.command import dated_in

STARTED = calendar.timegm(time.strptime("2026-12-02 09:56:08", "%Y-%m-%d %H:%M:%S"))


def test_a_file_is_written_as_named(tmp_path):
    assert dated_in(tmp_path / "out.json", STARTED) == tmp_path / "out.json"


def test_a_directory_gets_a_file_named_for_the_runs_start_in_utc(tmp_path):
    assert dated_in(tmp_path, STARTED) == tmp_path / "2026-12-02T09-56-08Z.json"


def test_runs_sort_by_date_and_never_overwrite_each_other(tmp_path):
    names = [dated_in(tmp_path, STARTED + dt).name for dt in (0, 1, 3600, 86400)]
    assert names == sorted(names) and len(set(names)) == 4


def test_a_checkout_names_its_commit():
    commit = source_commit()
    assert commit is None or len(commit.removesuffix("-dirty")) >= 7
