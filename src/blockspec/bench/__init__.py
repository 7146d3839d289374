"""Benchmark metrics and plotting helpers for block speculative decoding."""
