"""The error of the simulated cluster, and the one kind of it a start retries."""

from __future__ import annotations


class SimnetError(RuntimeError):
    """A step of building, changing or tearing down the simulated cluster failed; the message says which."""


class RayStartError(SimnetError):
    """A node's ``ray start`` exited before it said it runs; the message has its log's tail."""
