"""Request keys: llm-d's content address of each canonical block of a prompt (FNV-64a/CBOR or xxh64)."""
