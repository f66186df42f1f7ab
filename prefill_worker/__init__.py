"""Prefill worker: batched, chunked prefill with its own prefix cache; pushes the KV a decode worker lacks."""
