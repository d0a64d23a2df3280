"""Command lines: they end quietly when their reader stops reading (``python -m cuflash | head -1``), and the test
suite's own variable (HYPOTHESIS_PROFILE) is checked like cuflash's."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_a_reader_that_stops_early_ends_the_command_without_a_traceback():
    """What ``python -m cuflash`` and ``python -m cuflash.distributed`` run their main with (cuflash._cli): here a main
    that writes far more than a pipe holds, so that the reader is gone before it is done (without it: a
    BrokenPipeError traceback, status 1)."""
    command = ["-c", "from cuflash._cli import exit_with\nexit_with(lambda: [print('x' * 4096) for _ in range(1000)] "
               "and 0)"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([sys.executable, *command], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    proc.stdout.readline()
    proc.stdout.close()  # as `| head -1` does
    err = proc.stderr.read().decode()
    code = proc.wait(timeout=120)
    assert "Traceback" not in err and "BrokenPipeError" not in err, err
    assert code == 1, (code, err)


def test_a_misspelt_hypothesis_profile_is_a_usage_error_naming_the_variable(tmp_path):
    """A typo (or a space) in HYPOTHESIS_PROFILE was hypothesis' traceback from conftest.py, naming neither the
    variable nor the profiles; surrounding spaces are taken away, as in cuflash's own variables. (A one-test suite
    in its own folder under a copy of this suite's conftest.py.)"""
    shutil.copy(ROOT / "tests" / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_one.py").write_text("def test_one():\n    pass\n")
    path = os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])  # golden.py
    for value, code, says in [("cii", 4, "HYPOTHESIS_PROFILE='cii' is not valid: expected one of ci, dev, fuzz"),
                              (" ci ", 0, "1 passed")]:
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_one.py"],
                              env=dict(os.environ, HYPOTHESIS_PROFILE=value, PYTHONPATH=path), capture_output=True,
                              text=True, timeout=120, cwd=tmp_path)
        out = proc.stdout + proc.stderr
        assert proc.returncode == code and says in out and "Traceback" not in out, (value, proc.returncode, out)
