"""The one error of the simulated cluster."""

from __future__ import annotations


class SimnetError(RuntimeError):
    """A step of building, changing or tearing down the simulated cluster failed; the message says which."""
