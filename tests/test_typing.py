"""Type checking (issue: typing): the public modules pass ``mypy --strict`` with the configuration in setup.cfg,
and a user's strictly typed script sees the annotations (``py.typed``): the residual's type, and a wrong argument
type caught before anything runs. mypy is a test dependency (``.[test]``)."""
from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _mypy():
    return pytest.importorskip("mypy.api", reason="mypy is not installed (it comes with the test extra)")


def test_public_modules_pass_mypy_strict(monkeypatch):
    api = _mypy()
    monkeypatch.chdir(ROOT)
    stdout, stderr, status = api.run(["--config-file", str(ROOT / "setup.cfg")])
    assert status == 0, stdout + stderr
    assert "Success: no issues found in 9 source files" in stdout


def test_a_users_typed_script_sees_the_annotations(tmp_path, monkeypatch):
    api = _mypy()
    assert (ROOT / "cuflash" / "py.typed").is_file()
    script = tmp_path / "user.py"
    script.write_text(textwrap.dedent("""
        import numpy as np
        import cuflash

        q = np.ones((1, 8, 2, 16), np.float32)
        out, residual = cuflash.attention(q, q, q, causal=True, return_residual=True)
        reveal_type(residual)
        grads = cuflash.attention_backward(out, residual)
        cuflash.attention(q, q, q, causal=True, window=(1, "2"))
    """))
    monkeypatch.setenv("MYPYPATH", str(ROOT))
    monkeypatch.chdir(tmp_path)
    stdout, stderr, status = api.run(["--strict", "--follow-imports=silent", "--no-incremental", str(script)])
    assert 'Revealed type is "cuflash.residual.AttentionResidual"' in stdout, stdout + stderr
    assert 'user.py:9: error: Argument "window" to "attention" has incompatible type' in stdout, stdout
    assert stdout.count("error:") == 1, stdout
