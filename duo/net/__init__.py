"""The transport both processes stand on: the wire protocol (proto/duo.proto's stubs in _proto, and wire: its
messages to and from duo's types), TLS, gRPC's options, timeouts, reconnecting and listening. It knows nothing of
logits: it imports duo.llama (the vocabulary) and duo.sampling (the distributions sent) alone."""
