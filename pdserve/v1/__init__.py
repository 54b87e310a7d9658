"""Generated protobuf/gRPC code (scripts/gen_proto.py); do not edit."""
