"""``CUFLASH_EMULATE_ARCH`` for the "emulate" backend, read when a launch is planned rather than at import.

The backend looks its shared-memory limit up as ``kernels.SMEM_LIMIT[ARCH]``. Parsing the variable at import
made a bad value break ``import`` of the backend (and so the backend listing) with a bare ValueError or
KeyError; this stand-in parses it through :mod:`cuflash._env` at each lookup, so a bad value is a ValueError
naming the variable and its accepted values, raised by the attention call that uses it.
"""
from __future__ import annotations

from .. import _env

VARIABLE = "CUFLASH_EMULATE_ARCH"


class _ArchFromEnvironment:
    """Hashes and compares as the current value of CUFLASH_EMULATE_ARCH (an int such as 80)."""

    @staticmethod
    def value() -> int:
        return _env.get(VARIABLE)

    def __index__(self) -> int:
        return self.value()

    __int__ = __index__

    def __hash__(self) -> int:
        return hash(self.value())

    def __eq__(self, other) -> bool:
        return self.value() == other

    def __repr__(self) -> str:
        return f"{VARIABLE}={self.value()}"


ARCH = _ArchFromEnvironment()
