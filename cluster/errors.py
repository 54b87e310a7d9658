"""Errors of starting a service, importable without Ray (the CLI catches them)."""

from __future__ import annotations


class WorkerStartError(RuntimeError):
    """A worker died while starting (its engine, model or ports); the message names it and why."""
