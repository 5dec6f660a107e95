"""Every option of every command reads KVPF_<NAME>: the command tree is
walked, so a new command or option is covered without being listed here."""
from __future__ import annotations

import json
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from kv_preflight.cli.env import env_names, walk
from kv_preflight.cli.main import cli

COMMANDS = list(walk(cli))
# (command, whether its options are set by their second env names): a case only where it has options to check,
# the second only for a command with an option of two names (a config-file key's KVPF_ name beside the flag's)
CASES = [(path, cmd, alias) for path, cmd in COMMANDS for alias in (False, True)
         if any(isinstance(o, click.Option) and len(env_names(o)) > alias for o in cmd.params)]


def _sample(opt: click.Option, tmp: Path) -> tuple[str, object]:
    """An env value for ``opt`` that differs from its default, and the value the command should receive."""
    t = opt.type
    if opt.is_flag:
        return ("false", False) if opt.default is True else ("true", True)
    if isinstance(t, click.Choice):
        choice = next(c for c in reversed(t.choices) if c != opt.default)
        return choice, choice
    if isinstance(t, (click.IntRange, click.FloatRange)) or t in (click.INT, click.FLOAT):
        low = getattr(t, "min", None) or 0
        value = (int if isinstance(t, click.IntRange) or t is click.INT else float)(low + 3)
        return str(value), value
    if isinstance(t, click.File):
        path = tmp / f"{opt.name}.file"
        path.write_text("")
        return str(path), str(path)
    if isinstance(t, click.Path):
        path = tmp / f"{opt.name}.path"
        if t.file_okay:
            path.write_text("{}")
        else:
            path.mkdir(exist_ok=True)
        return str(path), str(path)
    return f"from-env-{opt.name}", f"from-env-{opt.name}"


def _received(value: object) -> object:
    if isinstance(value, Path):
        return str(value)
    if hasattr(value, "name") and not isinstance(value, (str, int, float)):  # an open click.File
        return value.name
    return value


@pytest.mark.parametrize("path, cmd, alias", CASES,
                         ids=[" ".join(p) + ("-config-name" if a else "-flag-name") for p, _, a in CASES])
def test_every_option_reads_its_env_var(path, cmd, alias, tmp_path, monkeypatch):
    expected = {}
    for opt in cmd.params:
        if not isinstance(opt, click.Option):
            continue
        names = env_names(opt)
        if alias and len(names) == 1:
            if opt.required:  # not what this case checks, but the command needs it to parse at all
                monkeypatch.setenv(names[0], _sample(opt, tmp_path)[0])
            continue
        raw, want = _sample(opt, tmp_path)
        if opt.multiple:
            raw, want = f"{raw}, {raw}-2", (want, f"{want}-2")
        monkeypatch.setenv(names[-1] if alias else names[0], raw)
        expected[opt.name] = want
    assert expected, "no option to check"
    if path == ("bench",) and "only" in expected:  # a comma list of row names, each checked
        monkeypatch.setenv("KVPF_ONLY", "keys,route")
        expected["only"] = {"keys", "route"}
    positional = []  # a command's required arguments (e.g. diagnose sessions FILE): given, so only options are read
    for arg in cmd.params:
        if isinstance(arg, click.Argument) and arg.required:
            (tmp_path / arg.name).write_text("")
            positional.append(str(tmp_path / arg.name))
    ctx = cmd.make_context(" ".join(path), positional, resilient_parsing=False)
    got = {name: tuple(_received(v) for v in ctx.params[name]) if isinstance(want, tuple) else _received(ctx.params[name])
           for name, want in expected.items()}
    assert got == expected


def test_kvpf_json_makes_bench_print_json_not_write_a_file_named_1(monkeypatch):
    """Issue 27, finding 9: bench's --json took a file, so KVPF_JSON=1 wrote one named "1"."""
    monkeypatch.setenv("KVPF_JSON", "1")
    bench = cli.commands["bench"]
    ctx = bench.make_context("bench", [])
    assert ctx.params["as_json"] is True and ctx.params["json_file"] is None


def test_keys_honours_hash_seed_and_block_size_from_env(monkeypatch):
    """The finding as reported: `keys` ignored KVPF_HASH_SEED and KVPF_BLOCK_SIZE."""
    args = ["keys", "--model", "m", "--tokens", json.dumps(list(range(32)))]
    plain = json.loads(CliRunner().invoke(cli, args).output)
    flags = json.loads(CliRunner().invoke(cli, [*args, "--hash-seed", "42", "--block-size", "8"]).output)
    monkeypatch.setenv("KVPF_HASH_SEED", "42")
    monkeypatch.setenv("KVPF_BLOCK_SIZE", "8")
    env = json.loads(CliRunner().invoke(cli, args).output)
    assert len(plain) == 2 and env == flags and len(env) == 4
    assert json.loads(CliRunner().invoke(cli, [*args, "--block-size", "16"]).output) != env  # the flag wins


def test_simulate_honours_blocks_from_env(monkeypatch):
    monkeypatch.setenv("KVPF_BLOCKS", "64")
    ctx = cli.commands["simulate"].make_context("simulate", ["--pod", "p", "--model", "m"])
    assert ctx.params["blocks"] == 64


def test_an_empty_env_var_is_unset(monkeypatch):
    """KVPF_ROUTE_STALE_S="" (a template's unset value) crashed Config parsing with a float error."""
    from kv_preflight.config import Config

    for name in ("KVPF_ROUTE_STALE_S", "KVPF_BLOCK_SIZE", "KVPF_LOG_JSON", "KVPF_ENGINES", "KVPF_VALKEY_URL"):
        monkeypatch.setenv(name, "")
    assert Config.load() == Config()
    res = CliRunner().invoke(cli, ["keys", "--model", "m", "--tokens", "[1]"], env={"KVPF_BLOCK_SIZE": ""})
    assert res.exit_code == 0, res.output
