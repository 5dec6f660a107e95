"""One rule for the environment: every option of every command reads ``KVPF_<NAME>``.

NAME is the option's long flag in capitals, dashes as underscores (``--hash-seed``: ``KVPF_HASH_SEED``,
``simulate --blocks``: ``KVPF_BLOCKS``). An option that fills a ``Config`` field of another name also
reads that field's name (``serve --tokenizer``: ``KVPF_TOKENIZER`` and ``KVPF_TOKENIZERS``), so the
names docs/operations.md lists keep working. A repeatable option takes a comma-separated list, as the
``Config`` variables always did. Flags win over the environment; an empty variable counts as unset.

It is applied once to the whole command tree (``apply_env``) rather than written into each option,
so a new command or option follows the rule without anyone remembering it.
"""
from __future__ import annotations

import copy
import dataclasses

import click

from kv_preflight.config import ENV_PREFIX, Config

_CONFIG_FIELDS = frozenset(f.name for f in dataclasses.fields(Config))


def env_names(opt: click.Option) -> list[str]:
    """The variables ``opt`` reads, the flag's name first."""
    longs = [o for o in opt.opts if o.startswith("--")] or opt.opts
    names = [ENV_PREFIX + longs[0].lstrip("-").replace("-", "_").upper()]
    if opt.name in _CONFIG_FIELDS and ENV_PREFIX + opt.name.upper() not in names:
        names.append(ENV_PREFIX + opt.name.upper())
    return names


def walk(cmd: click.Command, path: tuple[str, ...] = ()):
    """Every leaf command under ``cmd`` with its path of names, e.g. (("index", "stats"), <Command>)."""
    if isinstance(cmd, click.Group):
        for name, sub in sorted(cmd.commands.items()):
            yield from walk(sub, (*path, name))
    else:
        yield path, cmd


def _split_commas(raw: str) -> list[str]:
    return [item.strip() for item in raw.split(",") if item.strip()]


def apply_env(group: click.Group) -> None:
    for _, cmd in walk(group):
        for param in cmd.params:
            if not isinstance(param, click.Option) or param.envvar:
                continue
            param.envvar = env_names(param)
            if param.multiple:
                # comma-separated, as Config's KVPF_ENGINES=a,b; a copy, as click's types are shared singletons
                param.type = copy.copy(param.type)
                param.type.split_envvar_value = _split_commas

