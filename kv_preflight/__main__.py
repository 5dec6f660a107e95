"""``python -m kv_preflight``: the ``kv-preflight`` command."""
from kv_preflight.cli.main import cli

if __name__ == "__main__":
    cli()
