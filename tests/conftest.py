"""Shared test fixtures. Async tests run on trio through anyio's pytest plugin
(libp2p is trio-native); SDK tests that must prove asyncio support use pytest-asyncio."""
from __future__ import annotations

import pytest


@pytest.fixture
def anyio_backend() -> str:
    return "trio"
