"""The KV wire only: gRPC block server and client, leases, chunking, checksums (docs/kv-wire.md)."""
