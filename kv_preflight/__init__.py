"""kv-preflight: how many tokens of a prompt an LLM engine's prefix cache already holds, and on which pod.

The flow, one subpackage a step (docs/architecture.md has the tree):
engine frame -> ``engines`` (adapters) -> ``events`` -> ``ingester`` -> ``index`` (Valkey, llm-d's layout);
prompt -> ``predictor`` (tokens) -> ``keys`` (request keys) -> ``index`` (lookup) -> ``predictor`` (score).
``fleet`` holds the records both sides share, ``simulator`` a fake engine, ``cli`` the one command.
"""
