"""The client-facing service: request validation, routing policy, the gRPC edge (router core and actor)."""
