"""Command-line defects of the benchmark tools found by a hunt: an ``--out`` that the up-front check and the write
read as different folders, ``session tree-hash`` of a ROOT that is no checkout, ``--commit`` in a dirty checkout,
``kernel_cases`` without a GPU or with a bad ``CUFLASH_*`` value, and ``session probe/finish`` paths and numbers.

Each refusal is one ``prog: error: ...`` line with status 2, before anything is measured or written; nothing here
times or compiles anything.
"""
import json
import os
import re
import sys

import pytest

import benchmarks.kernel_cases as kernel_cases
import benchmarks.numpy_backend as nb_bench
from benchmarks import environment, run, session, varlen
from test_bench_tools_cli import _error_line, _fake_cupy, _measured  # the same checks as the other tools' errors

NB = "python -m benchmarks.numpy_backend"
SESSION = "python3 -m benchmarks.session"
KC = "python -m benchmarks.kernel_cases"


def _exits_2(main, argv, capsys, prog) -> str:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    return _error_line(capsys.readouterr().err, prog)


# ---------------------------------------------------------------------------------------------
# --out of benchmarks.numpy_backend and benchmarks.varlen (numpy_backend.check_out / write_json)
# ---------------------------------------------------------------------------------------------
@pytest.fixture
def nb(monkeypatch):
    monkeypatch.delenv("CUFLASH_NUM_THREADS", raising=False)
    monkeypatch.delenv("CUFLASH_BLAS", raising=False)
    for name in ("time_case", "memory_case", "_torch"):
        monkeypatch.setattr(nb_bench, name, _measured)
    return nb_bench


@pytest.mark.parametrize("tail", ["newdir/.", "newdir/sub/..", "newdir/sub/../."])
def test_an_out_ending_in_dot_or_dotdot_names_a_folder(nb, tail, tmp_path, capsys, monkeypatch):
    """``--out newdir/.`` passed the check (abspath read it as the parent folder, where the probe was written) and the
    write failed after all the measuring: now refused up front like ``newdir/``, nothing made."""
    out = f"{tmp_path}/{tail}"
    line = _exits_2(nb.main, ["--out", out], capsys, NB)
    assert f"--out {out}: names a folder; name the JSON file to write" in line
    assert not (tmp_path / "newdir").exists()
    monkeypatch.setattr(varlen, "varlen_case", _measured)
    line = _exits_2(varlen.main, ["--quick", "--out", out], capsys, "python -m benchmarks.varlen")
    assert f"--out {out}: names a folder" in line and not (tmp_path / "newdir").exists()


@pytest.mark.parametrize("rel", ["a/../b.json", "c/d/../e/f.json"])
def test_check_out_and_write_json_agree_on_the_folder(rel, tmp_path, monkeypatch, capsys):
    """A ``..`` under a folder that does not exist yet: the check made and probed the normalised folder, the write
    then opened its temporary file through the missing one (FileNotFoundError after the measuring)."""
    monkeypatch.chdir(tmp_path)
    assert nb_bench.check_out(rel, False) is None
    nb_bench.write_json(rel, {"a": 1}, replace=False)
    assert json.loads((tmp_path / rel).read_text()) == {"a": 1}
    assert capsys.readouterr().out == f"wrote {rel}\n"


# ---------------------------------------------------------------------------------------------
# benchmarks.session tree-hash
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("what", ["missing", "file", "no-checkout"])
def test_tree_hash_of_a_root_that_is_no_checkout_is_an_error(what, tmp_path, capsys):
    """It printed the SHA-256 of no files, status 0: a hash that proves nothing about which code ran."""
    root = tmp_path / "root"
    if what == "file":
        root.write_text("x")
    elif what == "no-checkout":
        (root / "src").mkdir(parents=True)
    line = _exits_2(session.main, ["tree-hash", str(root)], capsys, f"{SESSION} tree-hash")
    assert f"ROOT {root}: " in line
    assert ("not a cuflash checkout" if what == "no-checkout" else "not a folder") in line


def test_tree_hash_of_a_checkout_is_printed(tmp_path, capsys):
    (tmp_path / "cuflash").mkdir()
    (tmp_path / "cuflash" / "a.py").write_text("a = 1\n")
    assert session.main(["tree-hash", str(tmp_path)]) == 0
    assert capsys.readouterr().out == session.tree_hash(tmp_path) + "\n"


# ---------------------------------------------------------------------------------------------
# --commit in a git checkout (environment.git_commit)
# ---------------------------------------------------------------------------------------------
SHA = "ab" * 20


@pytest.fixture
def dirty_checkout(monkeypatch):
    """A dirty git checkout whose git knows no other commit than its HEAD; no gpu_session.sh around."""
    monkeypatch.delenv("GPU_SESSION_COMMIT", raising=False)
    head = "cd" * 20
    monkeypatch.setattr(environment, "_git_head", lambda: (head, True))
    monkeypatch.setattr(environment, "_git_knows", lambda commit: head.startswith(commit))
    return head


def test_an_unknown_commit_in_a_dirty_checkout_is_refused(dirty_checkout, tmp_path, capsys, monkeypatch):
    """Any hex git did not know was recorded as the commit, with dirty null, in a checkout with uncommitted changes;
    the README says a --commit git contradicts is an error, and the tree is recorded as dirty."""
    with pytest.raises(ValueError, match=f"--commit {SHA} is not this checkout's HEAD .* git does not know it"):
        environment.git_commit(given=SHA)
    assert environment.git_commit() == (dirty_checkout, True)
    assert environment.git_commit(given=dirty_checkout[:8]) == (dirty_checkout, True)
    monkeypatch.setattr(run, "run_cases", _measured)
    argv = ["--smoke", "--only", "decode", "--impl", "cuflash", "--no-progress", "--no-plot", "--commit", "1234567",
            "--out", str(tmp_path / "out")]
    line = _exits_2(run.main, argv, capsys, "python -m benchmarks.run")
    assert "--commit 1234567 is not this checkout's HEAD" in line and not (tmp_path / "out").exists()


def test_a_device_copy_under_a_stale_git_records_the_sessions_commit(dirty_checkout, monkeypatch):
    """gpu_session.sh on a device machine: the copy may carry the .git of the session's start under a newer tree, and
    GPU_SESSION_COMMIT (which the script passes as --commit) names the tree's commit: recorded, dirty None. Another
    --commit, or one git knows that is not HEAD, is still refused there."""
    monkeypatch.setenv("GPU_SESSION_COMMIT", SHA.upper())
    assert environment.git_commit(given=SHA) == (SHA, None)
    with pytest.raises(ValueError, match="is not this checkout's HEAD"):
        environment.git_commit(given="1234567")
    monkeypatch.setattr(environment, "_git_knows", lambda commit: True)
    with pytest.raises(ValueError, match="is not this checkout's HEAD"):
        environment.git_commit(given=SHA)
    monkeypatch.setattr(environment, "_git_knows", lambda commit: False)
    monkeypatch.setattr(environment, "_git_head", lambda: (dirty_checkout, False))  # clean: the tree is HEAD's
    with pytest.raises(ValueError, match="is not this checkout's HEAD"):
        environment.git_commit(given=SHA)


# ---------------------------------------------------------------------------------------------
# benchmarks.kernel_cases
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def kc(monkeypatch):
    """kernel_cases with its cases' calls replaced by failures and the CUFLASH_* variables it checks unset."""
    for name in [n for n in os.environ if n.startswith("CUFLASH_")]:
        monkeypatch.delenv(name)
    monkeypatch.setattr(kernel_cases, "_fwd_bwd", _measured)
    return kernel_cases


@pytest.mark.parametrize("cupy, match", [
    ("missing", "CuPy is not installed"),
    ("no-driver", r"no usable CUDA device \(cudaErrorNoDevice: no CUDA-capable device is detected\)"),
    ("no-device", "no CUDA device")])
def test_kernel_cases_needs_a_usable_backend(kc, cupy, match, capsys, monkeypatch):
    """Without a GPU the first case ended in a CUDARuntimeError traceback (status 1)."""
    if cupy == "missing":
        monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy: ImportError
    else:
        _fake_cupy(monkeypatch, count=0, error=RuntimeError("cudaErrorNoDevice: no CUDA-capable device is detected")
                   if cupy == "no-driver" else None)
    line = _exits_2(kc.main, ["--only", "f16-d64-causal"], capsys, KC)
    assert re.fullmatch(f"{KC}: error: --backend cuda cannot run here: {match}.*", line), line
    assert kc.main(["--list", "--only", "f16-d64-causal"]) == 0  # the names need no GPU
    assert capsys.readouterr().out == "f16-d64-causal\n"


@pytest.mark.parametrize("backend", ["cuda", "emulate"])
def test_kernel_cases_names_a_bad_environment_variable(kc, backend, capsys, monkeypatch):
    """CUFLASH_EMULATE_ARCH=75 was a ValueError traceback from the first case."""
    _fake_cupy(monkeypatch)
    monkeypatch.setenv("CUFLASH_EMULATE_ARCH", "75")
    with pytest.raises(SystemExit) as exc:
        kc.main(["--backend", backend, "--only", "f16-d64-causal"])
    assert exc.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"{KC}: error: environment variable CUFLASH_EMULATE_ARCH='75' is not valid: expected 80, 86, 89 or 90"]


# ---------------------------------------------------------------------------------------------
# benchmarks.session probe --json, finish --out and --set
# ---------------------------------------------------------------------------------------------
def _strict(text: str):
    """``text`` as JSON without NaN or Infinity, which json.loads would take."""
    def refuse(constant):
        raise ValueError(f"non-standard JSON constant {constant}")

    return json.loads(text, parse_constant=refuse)


@pytest.mark.parametrize("where", ["folder", "folder-slash", "folder-dot", "missing-folder", "under-a-file"])
@pytest.mark.parametrize("command", ["probe", "finish"])
def test_a_json_path_session_cannot_write_is_one_error_line(command, where, tmp_path, capsys, monkeypatch):
    """A folder as probe --json or finish --out was an IsADirectoryError traceback, a missing folder a
    FileNotFoundError: now one line naming the option, status 2, before probing."""
    (tmp_path / "adir").mkdir()
    (tmp_path / "afile").write_text("x")
    path = {"folder": "adir", "folder-slash": "adir/", "folder-dot": "adir/.", "missing-folder": "nodir/s.json",
            "under-a-file": "afile/s.json"}[where]
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(session, "probe", _measured)
    option = {"probe": "--json", "finish": "--out"}[command]
    line = _exits_2(session.main, [command, option, path], capsys, f"{SESSION} {command}")
    assert f"{option} {path}: " in line
    assert ("names a folder" if where.startswith("folder") else "does not exist") in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adir", "afile"] and not any((tmp_path / "adir").iterdir())


def test_probe_still_writes_its_failure(tmp_path, capsys, monkeypatch):
    def no_gpu(*, need_pytest):
        raise session.SessionError("no GPU visible to CuPy")

    monkeypatch.setattr(session, "probe", no_gpu)
    assert session.main(["probe", "--json", str(tmp_path / "probe.json")]) == 1
    assert _strict((tmp_path / "probe.json").read_text()) == {"failed": "no GPU visible to CuPy"}
    assert "gpu_session: FAIL: no GPU visible to CuPy" in capsys.readouterr().out


@pytest.mark.parametrize("item", ["status=NaN", "bench_rc=1e999", "tests_rc=-Infinity", "budget_s=Infinity"])
def test_set_refuses_a_number_that_is_not_finite(item, tmp_path, capsys):
    """status=NaN and bench_rc=1e999 were written as NaN and Infinity: session.json was no strict JSON."""
    out = tmp_path / "session.json"
    line = _exits_2(session.main, ["finish", "--out", str(out), "--set", "status=0", item], capsys,
                    f"{SESSION} finish")
    assert f"--set {item}: not a finite number" in line and not out.exists()


def test_session_json_is_strict_json(tmp_path, capsys):
    """A probe file with NaN is not taken up (it would have made session.json non-standard); a KEY=VALUE without a
    key is a usage error (it was SystemExit's status 1)."""
    probe, out = tmp_path / "probe.json", tmp_path / "session.json"
    probe.write_text('{"python": "3.12", "gpus": NaN}\n')
    assert session.main(["finish", "--out", str(out), "--probe", str(probe), "--set", "status=1", "nan=NaN"]) == 0
    facts = _strict(out.read_text())
    assert "probe.json" in facts["probe_unreadable"] and "gpus" not in facts
    assert facts["status"] == 1 and facts["nan"] == "NaN"  # a field that is no number keeps its text
    line = _exits_2(session.main, ["finish", "--out", str(out), "--set", "=1"], capsys, f"{SESSION} finish")
    assert "--set takes KEY=VALUE, got '=1'" in line


@pytest.mark.parametrize("kind", ["deep", "fifo"])
def test_a_probe_file_too_deep_or_not_a_file_is_recorded_unreadable(tmp_path, kind):
    """finish --probe read the probe with json.loads on read_text(): 100000 nested arrays (a corrupted file) ended
    in a bare RecursionError traceback and no session.json, and a FIFO at that path hung the read. It goes through
    report.read_json now, as every JSON the benchmarks read back: recorded as unreadable, session.json written."""
    probe, out = tmp_path / "probe.json", tmp_path / "session.json"
    if kind == "deep":
        probe.write_text("[" * 100000)
    else:
        os.mkfifo(probe)
    assert session.main(["finish", "--out", str(out), "--probe", str(probe)]) == 0
    reason = _strict(out.read_text())["probe_unreadable"]
    assert str(probe) in reason and ("nested too deeply" if kind == "deep" else "a FIFO") in reason


# ---------------------------------------------------------------------------------------------
# a second hunt (2026-11-28): a rerun refused as another run's, cuflash-kvcache's errors, session's --set and warm
# ---------------------------------------------------------------------------------------------
def test_results_written_under_benchmarks_results_do_not_make_the_checkout_dirty(tmp_path, monkeypatch):
    """A run rewrites the committed figures under benchmarks/results/: counted as a dirty tree, the same command run
    again was refused as "another run than this one" (its run key holds the flag). Code changes still count."""
    import subprocess

    repo = tmp_path / "repo"
    (repo / "benchmarks" / "results").mkdir(parents=True)
    (repo / "cuflash.py").write_text("x = 1\n")
    (repo / "benchmarks" / "results" / "fig.json").write_text("{}\n")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(repo)]
    subprocess.run(git[:5] + ["init", "-q", str(repo)], check=True)
    subprocess.run(git + ["add", "."], check=True)
    subprocess.run(git + ["commit", "-qm", "c"], check=True)
    monkeypatch.setattr(environment, "REPO", repo.resolve())
    assert environment._git_head()[1] is False
    (repo / "benchmarks" / "results" / "fig.json").write_text('{"records": []}\n')
    assert environment._git_head()[1] is False
    (repo / "cuflash.py").write_text("x = 2\n")
    assert environment._git_head()[1] is True


def test_an_error_of_cuflash_kvcache_fails_the_run_as_cuflashs_own(monkeypatch):
    """Only the impl named exactly "cuflash" failed a run: cuflash-kvcache raising was a skipped baseline, status 0,
    and gpu_session.sh reported a broken decode path as a good benchmark."""
    from benchmarks import cases, timing

    def broken(case, impl, *args, **kw):
        raise RuntimeError("cudaErrorIllegalAddress")

    monkeypatch.setattr(run, "measure", broken)
    pair = cases.Case("decode", "cpu", "fwd", "float32", 1, 2, 1, 64, 16, impls=("cuflash-kvcache",))
    result = run.run_cases([pair], timing=timing.TIMINGS["smoke"], progress=False)
    assert [e["impl"] for _, e in result.failures] == ["cuflash-kvcache"] and not result.skipped


def test_every_set_of_finish_is_taken(tmp_path):
    """--set given twice kept only the last one's items (argparse's default store)."""
    out = tmp_path / "session.json"
    assert session.main(["finish", "--out", str(out), "--set", "status=0", "a=1", "--set", "b=2"]) == 0
    facts = json.loads(out.read_text())
    assert facts["status"] == 0 and str(facts["a"]) == "1" and str(facts["b"]) == "2"


def test_warm_without_a_gpu_or_with_a_bad_variable_is_one_line(capsys, monkeypatch):
    """session warm printed a RuntimeError's traceback (status 1) without a GPU, and one for a bad CUFLASH_*."""
    from cuflash.backends import cuda

    monkeypatch.setattr(cuda, "available", lambda: (False, "no GPU here"))
    line = _exits_2(session.main, ["warm"], capsys, f"{SESSION} warm")
    assert "needs a usable GPU: no GPU here" in line
    monkeypatch.setenv("CUFLASH_NUM_THREADS", "abc")
    assert "CUFLASH_NUM_THREADS" in _exits_2(session.main, ["warm"], capsys, f"{SESSION} warm")


def test_require_device_with_impls_that_leave_out_cuflash_is_refused_before_measuring(capsys, monkeypatch):
    monkeypatch.setattr(run, "run_cases", lambda *a, **k: pytest.fail("measured"))
    line = _exits_2(run.main, ["--smoke", "--device", "cpu", "--require-device", "cpu", "--impl", "numpy"], capsys,
                    "python -m benchmarks.run")
    assert "--require-device cpu needs cuflash's own records, which --impl numpy leaves out" in line


def test_the_default_out_is_the_checkouts_results_folder_whatever_the_working_folder(tmp_path, monkeypatch):
    """Run from another folder, the results went to ./benchmarks/results/ there, recorded with the checkout's commit."""
    seen = {}

    def stop(out_dir, *args):
        seen["out"] = out_dir
        raise SystemExit(0)

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(run, "_out_folder", stop)
    with pytest.raises(SystemExit):
        run.main(["--smoke", "--device", "cpu", "--no-progress"])
    assert seen["out"].parent == environment.REPO / "benchmarks" / "results"


def test_kernel_cases_only_with_a_trailing_comma_names_the_cases_before_it(capsys):
    line = _exits_2(kernel_cases.main, ["--only", ","], capsys, KC)
    assert "--only names no case in ','" in line


def test_kernel_cases_no_pool_with_the_emulator_is_refused(capsys):
    line = _exits_2(kernel_cases.main, ["--no-pool", "--backend", "emulate"], capsys, KC)
    assert "--no-pool is CuPy's (backend cuda)" in line
