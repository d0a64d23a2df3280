"""Emulated kernel tests skip cleanly (with the reason) where g++ or the CUDA headers are missing."""
from pathlib import Path

import pytest


def pytest_collection_modifyitems(config, items):
    from cuflash.emulate import available

    ok, reason = available()
    for item in items:
        if Path(str(item.fspath)).parent == Path(__file__).parent:
            item.add_marker(pytest.mark.emulate)
            if not ok:
                item.add_marker(pytest.mark.skip(reason=f"CPU emulation unavailable: {reason}"))
