"""KV wire: gRPC block server/client, leases, the Redis index and the embedded Redis launcher."""
