"""benchmarks/varlen.py on tiny shapes: the two computations it times agree (to float32 rounding: the padded
batch runs its products batched over sequences), its records are consistent, and its line fit is right (the figures
themselves are in benchmarks/results)."""
import json
import re
from pathlib import Path

import numpy as np
import pytest

from benchmarks import environment, varlen


def test_varlen_case_times_equal_results():
    rec = varlen.varlen_case(3, rounds=1, heads=2, d=16)
    assert rec["max_abs_diff"] <= 8 * np.finfo(np.float32).eps  # a few roundings of outputs of magnitude <= 1
    assert rec["total_tokens"] <= rec["padded_tokens"] == 3 * rec["longest"]
    assert rec["input_bytes"]["varlen"] * rec["padded_tokens"] == rec["input_bytes"]["padded"] * rec["total_tokens"]
    assert rec["ms"]["varlen"] > 0 and rec["ms"]["padded"] > 0 and rec["varlen_over_padded"] > 0


def test_lengths_are_clipped_log_normal():
    lens = varlen.lengths(1000, np.random.default_rng(0))
    assert lens.dtype == np.int32 and lens.min() >= 1 and lens.max() <= 2048
    assert 200 <= np.median(lens) <= 320


def test_decode_case_and_fit():
    rec = varlen.decode_case(64, rounds=1, batch=2, heads=4, heads_kv=2, d=16)
    assert rec["cache_bytes"] == 2 * 2 * 64 * 2 * 16 * 4 and rec["ms"] > 0
    a, b, r2 = varlen.linear_fit([1, 2, 3, 4], [3, 5, 7, 9])
    assert np.allclose([a, b, r2], [1, 2, 1])


def test_an_existing_out_file_is_refused_before_measuring(tmp_path, monkeypatch, capsys):
    """``--out`` is checked before any case runs: an existing file is kept unless ``--replace``."""
    out = tmp_path / "varlen.json"
    out.write_text("kept")
    monkeypatch.setattr(varlen, "varlen_case", lambda *a, **k: pytest.fail("measured before --out was checked"))
    with pytest.raises(SystemExit) as exc:
        varlen.main(["--out", str(out)])
    assert exc.value.code == 2 and "exists" in capsys.readouterr().err and out.read_text() == "kept"
    with pytest.raises(SystemExit) as exc:
        varlen.main(["--replace"])
    assert exc.value.code == 2 and "--replace needs --out" in capsys.readouterr().err


@pytest.mark.parametrize("variable, value", [("CUFLASH_BLAS", "x"), ("CUFLASH_NUM_THREADS", "0")])
def test_a_bad_environment_variable_is_named_before_measuring(variable, value, tmp_path, monkeypatch, capsys):
    """CUFLASH_BLAS=x printed the table's header, then a traceback at the first case (status 1): now one line naming
    the variable, status 2, before anything is printed, measured or made, as benchmarks.numpy_backend does."""
    from cuflash import _env

    monkeypatch.setenv(variable, value)
    monkeypatch.setattr(varlen, "varlen_case",
                        lambda *a, **k: pytest.fail("measured before the environment was checked"))
    with pytest.raises(SystemExit) as exc:
        varlen.main(["--quick", "--out", str(tmp_path / "new" / "varlen.json")])
    captured = capsys.readouterr()
    assert exc.value.code == 2 and not captured.out and not (tmp_path / "new").exists()
    assert captured.err.strip().splitlines() == [
        f"python -m benchmarks.varlen: error: environment variable {variable}={value!r} is not valid: "
        f"expected {_env.VARIABLES[variable].accepted}"]


def test_a_file_made_at_out_during_the_run_is_kept_and_the_results_too(tmp_path, monkeypatch, capsys):
    """Checked up front, --out may still appear before the end (another run): that file is kept, and the write's
    failure, a FileExistsError traceback, is one line naming the temporary file that keeps the results; these
    record this checkout's commit and whether its tree is dirty (environment.git_commit)."""
    out = tmp_path / "varlen.json"

    def someone_writes(batch, rounds):
        out.write_text("theirs\n")
        return dict(batch=batch, total_tokens=10, padded_tokens=20, ms={"varlen": 1.0, "padded": 2.0},
                    varlen_over_padded=0.5, input_bytes={"varlen": 1, "padded": 2},
                    peak_bytes={"varlen": 1, "padded": 2})

    monkeypatch.setattr(varlen, "varlen_case", someone_writes)
    monkeypatch.setattr(varlen, "decode_case", lambda n, rounds: dict(cache_len=n, ms=1 + n / 1e3, gb_per_s=1.0))
    monkeypatch.delenv("CUFLASH_BLAS", raising=False)
    assert varlen.main(["--quick", "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    kept = re.fullmatch(rf"python -m benchmarks\.varlen: error: cannot write --out {re.escape(str(out))}: File exists; "
                        r"the results are kept in (\S+)", err.strip()).group(1)
    assert out.read_text() == "theirs\n"
    result = json.loads(Path(kept).read_text())
    assert [r["batch"] for r in result["varlen"]] == [8, 32] and len(result["decode"]) == 3
    assert (result["commit"], result["dirty"]) == environment.git_commit()
