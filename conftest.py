"""Repository-root pytest configuration: only puts the checkout on ``sys.path`` (pytest inserts the
directory of a root ``conftest.py``), so that tests import ``benchmarks.*`` under plain ``pytest`` as
under ``python -m pytest``. The ``benchmarks`` package is never part of the installed ``cuflash``."""
