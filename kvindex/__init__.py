"""The Redis block index: who holds which KV block, the events stream, hit-rate counters,
the worker registry, and the embedded ``redis-server`` launcher (docs/redis.md)."""
