"""docs/cli.md is what `python -m kv_preflight.cli.reference` writes from the click commands: a flag added,
renamed or re-described without regenerating it fails here."""
from __future__ import annotations

from kv_preflight.cli.env import walk
from kv_preflight.cli.main import cli
from kv_preflight.cli.reference import DOC, main, render


def test_docs_cli_md_is_the_commands_reference():
    assert DOC.read_text() == render(), "docs/cli.md drifted from the commands: run python -m kv_preflight.cli.reference"


def test_every_command_and_option_is_in_the_reference():
    text = DOC.read_text()
    for path, cmd in walk(cli):
        assert f"## kv-preflight {' '.join(path)}\n" in text
        for param in cmd.params:
            for flag in getattr(param, "opts", ()):
                if flag.startswith("-") and not getattr(param, "hidden", False):
                    assert flag in text, (path, flag)


def test_check_mode_says_when_the_file_differs(tmp_path, capsys):
    out = tmp_path / "cli.md"
    assert main(["--output", str(out)]) == 0 and main(["--check", "--output", str(out)]) == 0
    out.write_text(out.read_text().replace("--hash-seed", "--hash-sead", 1))
    assert main(["--check", "--output", str(out)]) == 1
    assert "python -m kv_preflight.cli.reference" in capsys.readouterr().err
