"""Client-facing gRPC router, routing policy and the pdserve command line."""
