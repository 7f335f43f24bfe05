"""Generated gRPC stubs for proto/duo.proto (scripts/gen_proto.py writes them; do not edit)."""
