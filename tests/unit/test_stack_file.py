"""<data-dir>/env and up.lock (kv_preflight/cli/stack_file.py), and `up --fresh` (issue 27, findings 1, 2, 7)."""
from __future__ import annotations

import click
import pytest
from click.testing import CliRunner

from kv_preflight.cli import stack_file
from kv_preflight.cli.main import cli
from kv_preflight.cli.stack_checks import fresh_start


def test_the_env_file_counts_only_while_its_up_holds_the_lock(tmp_path, monkeypatch):
    lock = stack_file.DataDirLock(tmp_path).acquire("predictor http://127.0.0.1:9")
    stack_file.write(tmp_path, {"KVPF_VALKEY_URL": "redis://127.0.0.1:1234/0", "KVPF_PREDICTOR_URL": "http://x:1"})
    assert stack_file.read(tmp_path) == {"KVPF_VALKEY_URL": "redis://127.0.0.1:1234/0", "KVPF_PREDICTOR_URL": "http://x:1"}
    with pytest.raises(stack_file.DataDirInUse, match=r"kv-preflight up \(pid \d+, predictor http://127.0.0.1:9\)"):
        stack_file.DataDirLock(tmp_path).acquire("another")
    env = {"KVPF_PREDICTOR_URL": "http://mine:2"}  # what is set wins; what is unset (or empty) is filled
    monkeypatch.setenv("KVPF_DATA_DIR", str(tmp_path))
    assert stack_file.apply_defaults(env) == tmp_path / "env"
    assert env == {"KVPF_PREDICTOR_URL": "http://mine:2", "KVPF_VALKEY_URL": "redis://127.0.0.1:1234/0"}
    lock.release()  # as the kernel does when up dies, kill -9 too: a file left behind is not read
    assert stack_file.read(tmp_path) == {}
    assert stack_file.apply_defaults({}) is None


def test_fresh_removes_the_index_and_logs_only(tmp_path):
    for d in ("valkey/appendonlydir", "valkey-cluster/node-0", "logs", "mine"):
        (tmp_path / d).mkdir(parents=True)
    gone = fresh_start(tmp_path)
    assert sorted(p.name for p in gone) == ["logs", "valkey", "valkey-cluster"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["logs", "mine"]


def test_fresh_refuses_a_valkey_up_did_not_start(tmp_path):
    r = CliRunner().invoke(cli, ["up", "--fresh", "--valkey-url", "redis://127.0.0.1:9/0", "--data-dir", str(tmp_path)])
    assert r.exit_code == 2 and "--fresh empties the Valkey up starts" in r.output


def test_the_banner_claims_the_default_lookup_only_where_it_holds(tmp_path, monkeypatch):
    """`up --data-dir /tmp/x` said "every kv-preflight command run from <cwd> reads it": they read ./.data
    (or KVPF_DATA_DIR) only, and went to 127.0.0.1:6379. Elsewhere the banner gives the export line."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("KVPF_DATA_DIR", raising=False)
    elsewhere = tmp_path / "x"
    line = stack_file.banner_env_line(elsewhere, elsewhere / "env")
    assert f"export KVPF_DATA_DIR={elsewhere.resolve()}" in line and "every kv-preflight command" not in line
    assert not stack_file.found_by_default(elsewhere)
    line = stack_file.banner_env_line(stack_file.default_data_dir(), tmp_path / ".data" / "env")
    assert f"every kv-preflight command run from {tmp_path} reads it" in line
    assert f"export KVPF_DATA_DIR={(tmp_path / '.data').resolve()}" in line  # for a shell elsewhere
    monkeypatch.setenv("KVPF_DATA_DIR", str(elsewhere))  # up run with it: commands with it find the stack
    assert "with KVPF_DATA_DIR as now reads it" in stack_file.banner_env_line(elsewhere, elsewhere / "env")


def test_a_failed_default_connection_names_the_missing_stack_and_the_fix(tmp_path, monkeypatch):
    """`index stats` with no stack file said only "Error 111 connecting to 127.0.0.1:6379"."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("KVPF_DATA_DIR", raising=False)
    stack_file.apply_defaults({})

    @click.command()
    @click.option("--valkey-url", default=None)
    def cmd(valkey_url):
        click.echo(stack_file.no_stack_hint("valkey_url"))

    out = CliRunner().invoke(cmd, []).output
    assert f"{tmp_path / '.data' / 'env'} (./.data, as KVPF_DATA_DIR is unset) does not exist" in out, out
    assert "export KVPF_DATA_DIR=<its --data-dir>" in out and "or give --valkey-url" in out, out
    assert CliRunner().invoke(cmd, ["--valkey-url", "redis://h:1/0"]).output.strip() == ""  # theirs to check
