"""Fixtures of the integration tests (the leak checks are in ``tests/conftest.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from .conditions import Fifos


@pytest.fixture
def fifos(tmp_path: Path) -> Fifos:
    """FIFO gates and a log for the task under test (``conditions.Fifos``)."""
    return Fifos(tmp_path)
