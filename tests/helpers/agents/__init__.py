"""The e2e tests' forcing of the agents' model calls (the machinery to run them is duo/bench/live)."""
