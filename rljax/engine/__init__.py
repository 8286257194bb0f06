"""Decode engine: paged KV cache, continuous batching, group prefix sharing."""
