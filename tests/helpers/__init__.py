"""Helpers shared by the tests (plain functions and constants; shared pytest fixtures live in the
``conftest.py`` files next to the tests that use them)."""

from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]  # the checkout: tools/, pretrain_*.py, docs/
