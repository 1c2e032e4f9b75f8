"""Generated protobuf and gRPC code for proto/kvroute/v1 (make proto)."""
