"""Index backends: what differs between a single Valkey node and a Valkey Cluster (the write path
and the lookup); kv_preflight/index/index.py is the one interface both sit behind."""
