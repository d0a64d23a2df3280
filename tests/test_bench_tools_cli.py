"""The command lines of the benchmark tools beside the runner (``benchmarks.numpy_backend``, ``benchmarks.host_cost``),
the runner's start-up check of the environment, and ``python -m cuflash bench --help``.

Every bad option or ``CUFLASH_*`` variable is refused in one line with a nonzero status before anything is measured:
these tests replace the measuring with functions that fail when called, so that a refusal found late fails here, and
none of them times anything (a few seconds in all).
"""
import json
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest

import benchmarks.host_cost as host_cost
import benchmarks.numpy_backend as nb_bench
from benchmarks import run

REPO = Path(__file__).resolve().parents[1]


def _measured(*args, **kw):
    raise AssertionError("measured before every argument and variable was checked")


def _error_line(err: str, prog: str) -> str:
    """The one ``prog: error: ...`` line of ``err`` (argparse prints its usage above it); no traceback."""
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith(f"{prog}: error: ")]
    assert len(lines) == 1, err
    return lines[0]


# ---------------------------------------------------------------------------------------------
# benchmarks.numpy_backend
# ---------------------------------------------------------------------------------------------
NB = "python -m benchmarks.numpy_backend"


@pytest.fixture
def nb(monkeypatch):
    """numpy_backend with its measuring replaced by failures (torch not imported either: it takes seconds), and
    CUFLASH_NUM_THREADS, which main() sets, restored after the test."""
    monkeypatch.delenv("CUFLASH_NUM_THREADS", raising=False)
    monkeypatch.delenv("CUFLASH_BLAS", raising=False)
    for name in ("time_case", "memory_case", "_torch"):
        monkeypatch.setattr(nb_bench, name, _measured)
    return nb_bench


def _memory_only(nb, monkeypatch):
    """``--no-speed --quick`` in no time: the memory grid's cases replaced by records of their shape (torch, which
    only the speed cases use, not imported)."""
    monkeypatch.setattr(nb, "_torch", lambda threads: None)
    monkeypatch.setattr(nb, "memory_case", lambda b, h, n: dict(
        batch=b, heads=h, seqlen=n, fwd_peak_bytes=1, bwd_peak_bytes=1, fwd_rss_bytes=None, bwd_rss_bytes=None,
        array_bytes=1, naive_scores_bytes=1))
    return ["--no-speed", "--quick"]


def _refused(bench, argv, capsys) -> str:
    with pytest.raises(SystemExit) as exc:
        bench.main(argv)
    assert exc.value.code == 2
    return _error_line(capsys.readouterr().err, NB)


def test_an_existing_out_file_is_kept_unless_replace(nb, tmp_path, capsys, monkeypatch):
    """--out overwrote an existing file without a word (after minutes of measuring): now refused up front, and
    --replace overwrites it."""
    out = tmp_path / "numpy_backend.json"
    out.write_text("earlier results\n")
    line = _refused(nb, ["--out", str(out)], capsys)
    assert str(out) in line and "exists" in line and "--replace" in line
    assert out.read_text() == "earlier results\n"
    assert nb.main(_memory_only(nb, monkeypatch) + ["--out", str(out), "--replace"]) == 0
    assert '"threads"' in out.read_text()
    assert [p.name for p in tmp_path.iterdir()] == [out.name]  # no temporary or probe file left behind


def test_a_new_out_file_is_written_in_folders_made_for_it(nb, tmp_path, monkeypatch):
    out = tmp_path / "a" / "b" / "r.json"
    assert nb.main(_memory_only(nb, monkeypatch) + ["--out", str(out)]) == 0
    assert out.read_text().startswith("{")


@pytest.mark.parametrize("where, match", [
    ("folder", "names a folder"), ("slash", "names a folder"), ("under-a-file", "a part of its folder path is a file"),
    ("link", "not a regular file"), ("fifo", "not a regular file")])
def test_a_bad_out_path_is_refused_before_measuring(nb, where, match, tmp_path, capsys):
    """--out DIR ended in IsADirectoryError after all the measuring; a link or a FIFO is no results file to replace."""
    (tmp_path / "afile").write_text("x")
    out = {"folder": str(tmp_path), "slash": str(tmp_path / "new") + os.sep,
           "under-a-file": str(tmp_path / "afile" / "r.json"), "link": str(tmp_path / "link"),
           "fifo": str(tmp_path / "fifo")}[where]
    if where == "link":
        os.symlink(tmp_path / "afile", out)
    if where == "fifo":
        os.mkfifo(out)
    line = _refused(nb, ["--out", out, "--replace"], capsys)
    assert f"--out {out}: " in line and match in line
    assert (tmp_path / "afile").read_text() == "x" and not (tmp_path / "new").exists()


def test_an_out_folder_that_cannot_be_written_is_refused(nb, tmp_path, capsys, monkeypatch):
    """The probe file's refusal (root writes into a 0500 folder anyway: the refusal made for everyone)."""
    real_open = open

    def refusing_open(path, *args, **kw):
        if os.path.basename(str(path)).startswith(".numpy_backend.write-test."):
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, *args, **kw)

    monkeypatch.setattr(nb, "open", refusing_open, raising=False)  # the module's global shadows the builtin
    line = _refused(nb, ["--out", str(tmp_path / "r.json")], capsys)
    assert "cannot be written (Permission denied)" in line


@pytest.mark.parametrize("text", ["", "   "])
def test_an_empty_out_is_refused(nb, text, capsys):
    """--out "" exited 0 writing nothing (the empty name read as no --out)."""
    assert "argument --out: must name a file" in _refused(nb, ["--out", text], capsys)


def test_replace_without_out_is_refused(nb, capsys):
    assert "--replace needs --out" in _refused(nb, ["--replace"], capsys)


def test_no_speed_with_no_memory_is_refused(nb, tmp_path, capsys):
    """Together they measured nothing, wrote a result without results and exited 0."""
    out = tmp_path / "r.json"
    line = _refused(nb, ["--no-speed", "--no-memory", "--out", str(out)], capsys)
    assert "--no-speed and --no-memory together leave nothing to measure" in line
    assert not out.exists()


def test_the_commit_recorded_is_this_checkouts_not_the_current_folders(nb, tmp_path, monkeypatch):
    """`git rev-parse HEAD` ran in the current folder: from inside another repository its HEAD was recorded (from
    outside any, null), and a dirty tree never said so. The commit and dirty flag are environment.git_commit's, as
    benchmarks.run records them, wherever the tool is started."""
    import shutil

    from benchmarks import environment

    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    other = tmp_path / "other-repo"
    other.mkdir()
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    for args in (["init", "-q"], ["commit", "-q", "--allow-empty", "-m", "other"]):
        subprocess.run(git + args, cwd=other, check=True, capture_output=True)
    theirs = subprocess.run(["git", "rev-parse", "HEAD"], cwd=other, check=True, capture_output=True,
                            text=True).stdout.strip()
    monkeypatch.chdir(other)
    out = tmp_path / "r.json"
    assert nb.main(_memory_only(nb, monkeypatch) + ["--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert (result["commit"], result["dirty"]) == environment.git_commit() and result["commit"] != theirs


@pytest.mark.parametrize("threads", ["1025", "2000", "50000", "+4", "0_2", "\u0664"])
def test_threads_take_what_cuflash_num_threads_takes(nb, threads, capsys):
    """2000 was a ValueError traceback from CUFLASH_NUM_THREADS at the first call, 50000 a segfault in torch; "+4",
    "0_2" and an Arabic-Indic four passed int() where the variable refuses them."""
    line = _refused(nb, ["--threads", threads], capsys)
    assert f"argument --threads: must be an integer from 1 to 1024 (what CUFLASH_NUM_THREADS takes), " \
           f"got {threads!r}" in line
    assert nb._threads("1024") == 1024 and nb._threads("1") == 1


@pytest.mark.parametrize("variable, value", [("CUFLASH_BLAS", "foo"), ("CUFLASH_NUM_THREADS", "abc"),
                                             ("CUFLASH_EMULATE_SEED", "-1")])
def test_numpy_backend_names_a_bad_environment_variable(nb, variable, value, tmp_path, capsys, monkeypatch):
    """CUFLASH_BLAS=foo was a traceback at the first call; CUFLASH_NUM_THREADS=abc was silently replaced by
    --threads' default. Checked first, as `python -m cuflash` does: nothing measured, no --out made."""
    monkeypatch.setenv(variable, value)
    with pytest.raises(SystemExit) as exc:
        nb.main(["--out", str(tmp_path / "new" / "r.json")])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"{NB}: error: environment variable {variable}={value!r} is not valid: "
                   f"expected {nb._env.VARIABLES[variable].accepted}"]
    assert not (tmp_path / "new").exists()


def test_a_file_made_at_out_during_the_run_is_not_overwritten(nb, tmp_path, capsys, monkeypatch):
    """Checked up front, the file may still appear before the end (another run): without --replace it is kept, and
    the results are kept beside it in the temporary file the error names."""
    out = tmp_path / "r.json"

    def someone_writes(threads):
        out.write_text("theirs\n")

    argv = _memory_only(nb, monkeypatch)
    monkeypatch.setattr(nb, "_torch", someone_writes)
    assert nb.main(argv + ["--out", str(out)]) == 1
    line = _error_line(capsys.readouterr().err, NB)
    kept = re.search(r"the results are kept in (\S+)$", line).group(1)
    assert out.read_text() == "theirs\n" and '"threads"' in Path(kept).read_text()


def test_write_json_without_hard_links_still_never_overwrites(tmp_path, monkeypatch, capsys):
    """A file system without hard links: an exclusive create instead of os.link."""
    def no_links(src, dst):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(nb_bench.os, "link", no_links)
    out = tmp_path / "r.json"
    nb_bench.write_json(str(out), {"a": 1}, replace=False)
    assert out.read_text() == '{\n "a": 1\n}\n' and [p.name for p in tmp_path.iterdir()] == ["r.json"]
    with pytest.raises(FileExistsError, match="the results are kept in"):
        nb_bench.write_json(str(out), {"a": 2}, replace=False)
    assert out.read_text() == '{\n "a": 1\n}\n'
    kept, = (p for p in tmp_path.iterdir() if p.name != "r.json")
    assert kept.read_text() == '{\n "a": 2\n}\n'
    nb_bench.write_json(str(out), {"a": 3})  # replace=True: what benchmarks.varlen asks for
    assert out.read_text() == '{\n "a": 3\n}\n'


def test_numpy_backend_help_documents_replace(capsys):
    with pytest.raises(SystemExit) as exc:
        nb_bench.main(["--help"])
    assert exc.value.code == 0 and "--replace" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------
# benchmarks.host_cost
# ---------------------------------------------------------------------------------------------
HC = "python -m benchmarks.host_cost"


def _fake_cupy(monkeypatch, count=1, error=None):
    """A CuPy module whose getDeviceCount returns ``count`` or raises ``error``."""
    def get_device_count():
        if error is not None:
            raise error
        return count

    cupy = types.ModuleType("cupy")
    cupy.__version__ = "0.0-fake"
    cupy.cuda = types.SimpleNamespace(runtime=types.SimpleNamespace(getDeviceCount=get_device_count))
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    return cupy


@pytest.fixture
def hc(monkeypatch):
    monkeypatch.delenv("CUFLASH_BLAS", raising=False)
    monkeypatch.setattr(host_cost, "measure", _measured)
    return host_cost


@pytest.mark.parametrize("argv, match", [
    (["--calls", "0"], "argument --calls: must be at least 1, got 0"),
    (["--calls", "-3"], "argument --calls: must be at least 1, got -3"),
    (["--calls", "x"], "argument --calls: not an integer: 'x'"),
    (["--top", "-1"], r"argument --top: must be at least 0 \(0: every row\), got -1"),
    (["--only", "bogus"], "--only: unknown case.s. bogus; choose from fwd-n512-b32, "),
    (["--only", "fwd-n512-b32,bogus"], "--only: unknown case.s. bogus; choose from "),
    (["--only", " , "], "--only names no case in ' , '; choose from ")],
    ids=["calls-0", "calls-negative", "calls-text", "top-negative", "only-bogus", "only-bogus-after-a-valid-one",
         "only-empty"])
def test_host_cost_refuses_bad_options_before_measuring(hc, argv, match, capsys, monkeypatch):
    """--calls 0 divided by zero, -3 printed negative milliseconds, --top -1 dropped a row, --only bogus was a KeyError
    after the valid names before it had been measured."""
    _fake_cupy(monkeypatch)
    with pytest.raises(SystemExit) as exc:
        hc.main(argv)
    assert exc.value.code == 2 and re.search(match, _error_line(capsys.readouterr().err, HC))


@pytest.mark.parametrize("cupy", ["missing", "no-driver", "no-device"])
def test_host_cost_needs_a_cuda_device(hc, cupy, capsys, monkeypatch):
    """Without a GPU the first case ended in a CUDARuntimeError traceback."""
    if cupy == "missing":
        monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy: ImportError
    else:
        _fake_cupy(monkeypatch, count=0, error=RuntimeError("cudaErrorNoDevice: no CUDA-capable device is detected")
                   if cupy == "no-driver" else None)
    with pytest.raises(SystemExit) as exc:
        hc.main(["--calls", "1"])
    line = _error_line(capsys.readouterr().err, HC)
    assert exc.value.code == 2 and "needs a CUDA device" in line
    assert {"missing": "CuPy cannot be imported", "no-driver": "RuntimeError: cudaErrorNoDevice",
            "no-device": "no CUDA device is visible"}[cupy] in line


def test_host_cost_names_a_bad_environment_variable(hc, capsys, monkeypatch):
    _fake_cupy(monkeypatch)
    monkeypatch.setenv("CUFLASH_BLAS", "foo")
    with pytest.raises(SystemExit) as exc:
        hc.main([])
    assert exc.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"{HC}: error: environment variable CUFLASH_BLAS='foo' is not valid: expected auto, numpy or mkl"]


def test_host_cost_runs_the_cases_named_in_order_once(hc, capsys, monkeypatch):
    """Valid names pass the checks (repeats measured once), in the order given."""
    _fake_cupy(monkeypatch)
    calls = []
    real_cases = hc.cases
    monkeypatch.setattr(hc, "cases", lambda xp: {name: (lambda name=name: lambda: name) for name in real_cases(None)})
    monkeypatch.setattr(hc, "measure", lambda xp, call, n, top: (calls.append((call(), n, top)), (1.0, 2.0, ""))[1])
    assert hc.main(["--only", "fwd-n512-b32-causal, fwd-n512-b32,fwd-n512-b32-causal", "--calls", "3"]) == 0
    assert calls == [("fwd-n512-b32-causal", 3, 12), ("fwd-n512-b32", 3, 12)]


def _fake_xp():
    event = types.SimpleNamespace(record=lambda: None, synchronize=lambda: None)
    cuda = types.SimpleNamespace(get_current_stream=lambda: types.SimpleNamespace(synchronize=lambda: None),
                                 Event=lambda: event, get_elapsed_time=lambda a, b: 1.0)
    return types.SimpleNamespace(cuda=cuda)


def test_host_cost_top_zero_is_every_row():
    def call():  # a few functions of its own, for cProfile to list
        return sorted(str(i) for i in range(50))

    _, _, everything = host_cost.measure(_fake_xp(), call, 2, 0)
    _, _, one = host_cost.measure(_fake_xp(), call, 2, 1)
    assert len(one.splitlines()) == 2 and len(everything.splitlines()) > 3  # a header line and the rows


# ---------------------------------------------------------------------------------------------
# benchmarks.run: the environment checked at start-up
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("variable, value", [("CUFLASH_NUM_THREADS", "abc"), ("CUFLASH_BLAS", "foo")])
def test_run_names_a_bad_environment_variable_before_measuring(variable, value, tmp_path, capsys, monkeypatch):
    """Every case ran, each cuflash pair failing on the variable, JSON full of failures was written and the run
    exited 3: now status 2 and one line, before anything is measured or the --out folder made."""
    monkeypatch.setenv(variable, value)
    monkeypatch.setattr(run, "run_cases", _measured)
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exc:
        run.main(["--smoke", "--no-plot", "--no-progress", "--out", str(out)])
    assert exc.value.code == 2 and not out.exists()
    assert capsys.readouterr().err.strip().splitlines() == [
        f"python -m benchmarks.run: error: environment variable {variable}={value!r} is not valid: expected "
        f"{run.cuflash_env.VARIABLES[variable].accepted}"]


# ---------------------------------------------------------------------------------------------
# python -m cuflash bench --help
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("argv", [["bench", "--help"], ["bench", "-h"], ["bench", "--quick", "--help"]])
def test_cuflash_bench_help_succeeds(argv, capsys):
    """--help printed the pointer to benchmarks.run and exited 2, as an error: help asked for is a success."""
    from cuflash.__main__ import main

    assert main(argv) == 0
    captured = capsys.readouterr()
    assert "python -m benchmarks.run --help" in " ".join(captured.out.split()) and not captured.err


def test_cuflash_bench_without_help_still_points_and_fails():
    """The process's own status and streams, and cuflash still never imports the benchmarks."""
    code = ("import sys; from cuflash.__main__ import main; status = main(sys.argv[1:]); "
            "assert not [m for m in sys.modules if m.split('.')[0] == 'benchmarks']; sys.exit(status)")
    helped = subprocess.run([sys.executable, "-c", code, "bench", "--help"], cwd=REPO, capture_output=True, text=True,
                            timeout=120)
    assert helped.returncode == 0 and "usage: python -m cuflash bench" in helped.stdout and not helped.stderr
    pointed = subprocess.run([sys.executable, "-c", code, "bench", "--full"], cwd=REPO, capture_output=True,
                             text=True, timeout=120)
    assert pointed.returncode == 2 and not pointed.stdout
    assert pointed.stderr.strip().splitlines() == [
        "the benchmarks live outside the package: from a checkout, run `python -m benchmarks.run --help`"]
