"""benchmarks/varlen.py on tiny shapes: the two computations it times agree (to float32 rounding: the padded
batch runs its products batched over sequences), its records are consistent, and its line fit is right (the figures
themselves are in benchmarks/results)."""
import numpy as np
import pytest

from benchmarks import varlen


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
