"""Decode worker: a Ray actor that pulls KV blocks and continues generation."""
