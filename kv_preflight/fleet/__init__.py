"""Fleet records every process shares: pods, engines, leases, load and the index-wide settings, as values.

Below kv_preflight/index/: nothing here imports the index. Their reads and writes in Valkey are the index's
(kv_preflight/index/fleet_store.py, ``Index.fleet``), where every other command on its layout is; a pod's
leaving the index is kv_preflight/index/lifecycle.py (tests/unit/test_import_layers.py holds the line)."""
