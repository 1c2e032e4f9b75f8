"""Generated protobuf and gRPC code for proto/kvroute/v1 (make proto): the wire types of the
GenerationService, ReplicaService, RouterService and the KV event schema. Imports only protobuf and grpcio."""
