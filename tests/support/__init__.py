"""Helpers shared by the tests (real Redis, real models, polling, peers in other processes)."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
