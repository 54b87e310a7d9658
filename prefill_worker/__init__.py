"""Prefill worker: a Ray actor over the engine and the KV-transfer server."""
