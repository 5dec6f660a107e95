"""docs/cli.md, written from the click commands themselves, so the reference cannot drift from the flags.

    python -m kv_preflight.cli.reference            # rewrite docs/cli.md (from a checkout)
    python -m kv_preflight.cli.reference --check    # exit 1 if docs/cli.md differs from the commands

tests/unit/test_cli_reference.py fails when the file and the commands disagree.
"""
from __future__ import annotations

import argparse
import inspect
import re
import sys
from pathlib import Path

import click

from kv_preflight.cli.env import env_names, walk

DOC = Path(__file__).resolve().parents[2] / "docs" / "cli.md"

HEADER = """# CLI reference

Generated from the commands by `python -m kv_preflight.cli.reference`; do not edit by hand
(`tests/unit/test_cli_reference.py` fails when this file and the commands disagree). `kv-preflight COMMAND
--help` prints the same. How the commands fit together: [usage.md](usage.md); the HTTP API: [api.md](api.md).

**The environment.** Every option of every command also reads `KVPF_<NAME>` from the environment, NAME
being its flag in capitals with `_` for `-` (`--hash-seed`: `KVPF_HASH_SEED`, `simulate --blocks`:
`KVPF_BLOCKS`, `up --port`: `KVPF_PORT`); a repeatable option takes a comma-separated list
(`KVPF_ENGINE=http://a:8000,http://b:8000`); an option that fills a setting of another name also reads that
name (`KVPF_TOKENIZERS=m1=/dir1,m2=/dir2`, `KVPF_METRICS_INTERVAL_S`, `KVPF_REQUEST_READ_TIMEOUT_S`);
`KVPF_API_KEYS=k1,k2` has no flag. Flags win; an empty variable counts as unset (except `KVPF_API_KEYS`:
set but naming no key is a start-up error). A variable applies to every command with that option:
`KVPF_JSON=1` makes each `--json` command print JSON. The rule lives in `kv_preflight/cli/env.py`; the
column "environment" below lists each option's names. `KVPF_LISTEN_PORTS=LO-HI` (no flag) is the range the
servers `up` starts (and the test suite's) draw their loopback ports from, 10000-20000 by default.
"""

_ENV_NOTE = re.compile(r"\s*\[env [A-Z0-9_, ]+\]")


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _paragraphs(text: str) -> str:
    """A docstring's paragraphs, each on one line (click's \\b no-rewrap marks dropped)."""
    paras = re.split(r"\n\s*\n", inspect.cleandoc(text.replace("\b", "")))
    return "\n\n".join(" ".join(p.split()) for p in paras if p.strip())


def _click_rows(cmd: click.Command, ctx: click.Context) -> list[str]:
    rows = []
    for param in cmd.params:
        if isinstance(param, click.Argument):
            rows.append(f"| `{param.make_metavar(ctx)}` | argument{' (required)' if param.required else ''} | | |")
            continue
        record = param.get_help_record(ctx)
        if record is None:  # hidden
            continue
        flags, help_text = record
        help_text = _ENV_NOTE.sub("", help_text)
        env = ", ".join(f"`{n}`" for n in env_names(param)) if isinstance(param, click.Option) else ""
        rows.append(f"| `{_cell(flags)}` | {_cell(help_text)} | {env} |")
    return rows


def render() -> str:
    from kv_preflight.cli.main import cli

    out = [HEADER]
    commands = list(walk(cli))
    out.append("| command | what |\n|---|---|")
    for path, cmd in commands:
        name = " ".join(path)
        anchor = "kv-preflight-" + "-".join(path)
        out.append(f"| [`kv-preflight {name}`](#{anchor}) | {_cell(cmd.get_short_help_str(limit=120))} |")
    out.append("")
    root = click.Context(cli, info_name="kv-preflight")
    for path, cmd in commands:
        name = " ".join(path)
        ctx = click.Context(cmd, info_name=name, parent=root)
        out.append(f"## kv-preflight {name}\n")
        out.append(_paragraphs(cmd.help or "") + "\n")
        usage = " ".join(["kv-preflight", name, *cmd.collect_usage_pieces(ctx)])
        rows = _click_rows(cmd, ctx)
        out.append(f"```text\n{usage}\n```\n")
        if rows:
            out.append("| option | what | environment |\n|---|---|---|")
            out.extend(rows)
            out.append("")
    return "\n".join(out).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kv_preflight.cli.reference", description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if docs/cli.md differs from the commands")
    ap.add_argument("--output", type=Path, default=DOC, help=f"where to write (default {DOC})")
    a = ap.parse_args(argv)
    text = render()
    if a.check:
        current = a.output.read_text() if a.output.exists() else ""
        if current != text:
            print(f"{a.output} differs from the commands: run python -m kv_preflight.cli.reference", file=sys.stderr)
            return 1
        return 0
    a.output.write_text(text)
    print(f"wrote {a.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
