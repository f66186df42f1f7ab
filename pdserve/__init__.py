"""pdserve: LLM serving with disaggregated prefill and decode. This package holds the CLI, the local-cluster
launcher, the Python client and the benchmark; the serving pieces live in the sibling top-level packages."""

__version__ = "0.1.0"
