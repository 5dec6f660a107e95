from kv_preflight.cli.main import cli

cli()
