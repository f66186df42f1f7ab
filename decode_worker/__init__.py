"""Decode worker: reserves KV blocks, receives prompt KV over KvTransfer, decodes in a continuous batch."""
