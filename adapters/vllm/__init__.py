"""A real vLLM engine (CPU build) for kvcc: a generated tiny model, an engine harness, and a
subscriber that keeps kvcc's view of each engine's prefix cache from vLLM's KV events."""
