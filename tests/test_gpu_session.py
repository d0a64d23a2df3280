"""benchmarks/gpu_session.sh without a GPU: its dry run (``GPU_SESSION_DRY_RUN=1``) and its failure paths.

The dry run takes every step of a device call at toy size on a fake GPU (tests/fake_gpu: CuPy is
tests/fake_cupy_bench.py's fake, kernels run on the CPU emulator, a fake nvidia-smi answers for
``FAKE_GPUS``): the version probes, the golden-vector check, a one-test pytest call, a smoke benchmark on
the (emulated) cuda backend, and the packing. The tests check what comes back in ``$OUT`` and that each
missing precondition ends the script non-zero with a line saying what is missing.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from cuflash import emulate

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "gpu_session.sh"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
PACKED = {"session.json", "session.txt", "gpu_tests.txt", "gpu_tests.xml", "bench.txt", "results.tar.gz"}
needs_emulator = pytest.mark.skipif(not emulate.available()[0], reason=f"CPU emulation unavailable: "
                                                                       f"{emulate.available()[1]}")


def session(tmp_path: Path, *args: str, cwd=None, **env: str) -> tuple[subprocess.CompletedProcess, Path]:
    """Run the script's dry run with ``env`` on top of a clean environment (in the folder ``cwd``); ``(process,
    $OUT)``. As on a device machine, the tree is no git checkout there (GIT_DIR points nowhere): the commit is
    GPU_SESSION_COMMIT's."""
    out = tmp_path / "out"
    base = {k: v for k, v in os.environ.items() if not k.startswith(("FAKE_", "GPU_SESSION_", "CUFLASH_GOLDEN"))}
    base.update({"OUT": str(out), "PYTHON": sys.executable, "GPU_SESSION_DRY_RUN": "1", "GPU_SESSION_COMMIT": COMMIT,
                 "GIT_DIR": str(tmp_path / "no-git")}, **env)
    done = subprocess.run(["bash", str(SCRIPT), *args], env=base, capture_output=True, text=True, timeout=180,
                          cwd=cwd)
    return done, out


def session_json(out: Path) -> dict:
    return json.loads((out / "session.json").read_text())


@pytest.fixture
def golden_copy(tmp_path, golden):
    """A copy of the golden vectors in a folder of its own, as a device machine gets them in .golden/."""
    return Path(shutil.copytree(golden.directory, tmp_path / "golden"))


@needs_emulator
def test_dry_run_packs_what_a_gpu_session_would(tmp_path, golden_copy):
    done, out = session(tmp_path, "all", CUFLASH_GOLDEN_DIR=str(golden_copy))
    assert done.returncode == 0, done.stdout + done.stderr
    assert {p.name for p in out.iterdir()} == PACKED  # at most 8 files come back from a device call
    facts = session_json(out)
    assert facts["dry_run"] is True and facts["status"] == 0 and facts["commit"] == COMMIT
    assert facts["cupy"].endswith("+fake") and facts["nvrtc"] == "13.0" and facts["cuda_driver"] == 13000
    assert facts["device"]["name"] == "fake H100" and "fake H100" in facts["nvidia_smi"]
    assert facts["date"].endswith("Z") and facts["files"] == sorted(PACKED)
    # the golden vectors reached the tests: the one test run is a golden one and it passed
    assert facts["golden_dir"] == str(golden_copy) and facts["golden_files"] == len(list(golden_copy.glob("*.npz")))
    assert facts["tests"] == {"tests": 1, "run": 1, "failures": 0, "errors": 0, "skipped": 0, "golden_run": 1}
    cases = list(ET.parse(out / "gpu_tests.xml").getroot().iter("testcase"))
    assert [c.get("name") for c in cases] == ["test_golden[plain]"]  # a GPU test (-m gpu), on the fake GPU
    # the benchmark measured cuflash on the cuda backend, and says where and with what
    with tarfile.open(out / "results.tar.gz") as tar:
        names = {Path(n).name for n in tar.getnames()}
        assert {"fig4_tiles.json", "fig5_decode.json"} <= names
        payload = json.load(tar.extractfile("./fig4_tiles.json"))
    assert payload["commit"] == COMMIT and payload["device"]["kind"] == "cuda"
    assert payload["versions"]["nvrtc"] == "13.0" and payload["versions"]["cupy"] == facts["cupy"]
    recs = payload["records"]
    assert {r["block_k"] for r in recs} == {32, 64} and all(r["impl"] == "cuflash" and r["device"] == "cuda"
                                                            for r in recs)
    assert [r["tile"] for r in recs] == [[128, 64, 4], [64, 32, 4]]  # the smoke suite's whole tiles, table's first
    assert all(0 < r["host_ms"] <= r["ms"] for r in recs)  # the host's share of each call, before the sync


def test_suite_runs_the_tests_ci_runs_and_no_benchmark(tmp_path, golden_copy):
    """suite: the tests that are not marked gpu (what CI runs), on the device machine's compilers and libraries; no
    kernel warm-up and no benchmark. (The dry run: one golden test that is not a GPU test.)"""
    done, out = session(tmp_path, "suite", CUFLASH_GOLDEN_DIR=str(golden_copy))
    assert done.returncode == 0, done.stdout + done.stderr
    assert {p.name for p in out.iterdir()} == {"session.json", "session.txt", "gpu_tests.txt", "gpu_tests.xml"}
    facts = session_json(out)
    assert facts["status"] == 0 and facts["what"] == "suite" and facts["bench_rc"] is None
    assert facts["tests"] == {"tests": 1, "run": 1, "failures": 0, "errors": 0, "skipped": 0, "golden_run": 1}
    cases = list(ET.parse(out / "gpu_tests.xml").getroot().iter("testcase"))
    assert [c.get("classname") for c in cases] == ["tests.test_golden"]
    text = (out / "session.txt").read_text()
    assert "-m not gpu tests/test_golden.py" in text and "warm:" not in text and "bench:" not in text


@needs_emulator
def test_bench_args_narrow_a_short_lease_to_what_changed(tmp_path):
    """GPU_SESSION_BENCH_ARGS go after the mode's own options: the last --only wins. A test report an earlier session
    left in OUT is not this one's: session.json took it up as its tests (447 of them, with tests_rc null)."""
    stale = tmp_path / "out" / "gpu_tests.xml"
    stale.parent.mkdir()
    stale.write_text('<testsuite tests="447" failures="0" errors="0" skipped="0"><testcase name="golden_x"/>'
                     '</testsuite>')
    done, out = session(tmp_path, "bench", GPU_SESSION_BENCH_ARGS="--only decode")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "tests" not in session_json(out) and session_json(out)["tests_rc"] is None
    assert "--only decode --device cuda" in (out / "session.txt").read_text()
    with tarfile.open(out / "results.tar.gz") as tar:
        assert {Path(n).name for n in tar.getnames() if n.endswith(".json")} == {"fig5_decode.json"}


def test_missing_golden_vectors_fail_the_session(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    done, out = session(tmp_path, "tests", CUFLASH_GOLDEN_DIR=str(empty))
    assert done.returncode == 1
    facts = session_json(out)
    assert "golden vectors not found" in facts["failed"] and str(empty) in facts["failed"]
    assert ".golden" in facts["failed"]  # says how to provide them
    assert not (out / "gpu_tests.xml").exists() and facts["tests_rc"] is None  # no test ran without them


@pytest.mark.parametrize("env, message", [
    (dict(FAKE_GPUS=""), "no GPU visible to nvidia-smi"),
    (dict(FAKE_CUPY_MISSING="1"), "CuPy is not importable"),
])
def test_missing_gpu_or_cupy_fail_the_session(tmp_path, env, message):
    done, out = session(tmp_path, "bench", **env)
    assert done.returncode == 1
    assert f"gpu_session: FAIL: {message}" in done.stdout
    facts = session_json(out)
    assert message in facts["failed"] and facts["status"] == 1 and facts["bench_rc"] is None
    assert set(facts["files"]) == {"session.json", "session.txt"}


@pytest.mark.parametrize("what", ["tests", "bench"])
def test_a_gpu_the_cuda_backend_cannot_use_fails_at_the_probe(tmp_path, what):
    """A GPU cuflash's cuda backend cannot use (sm_75): every GPU test would skip and the benchmark refuse, so the
    probe fails the session before either runs."""
    done, out = session(tmp_path, what, FAKE_GPUS="T4")
    assert done.returncode == 1
    facts = session_json(out)
    assert "cuflash's CUDA backend is unusable here" in facts["failed"] and facts["status"] == 1
    assert facts["tests_rc"] is None and facts["bench_rc"] is None
    assert set(facts["files"]) == {"session.json", "session.txt"}


def test_benchmark_refuses_a_backend_other_than_cuda(tmp_path):
    """The runner itself, asked for cuda where cuflash's cuda backend is unusable, refuses instead of measuring
    elsewhere (its numbers must never be packed as GPU results)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FAKE_")}
    env.update(FAKE_GPUS="T4", PYTHONPATH=os.pathsep.join([str(REPO / "tests" / "fake_gpu"), str(REPO / "tests"),
                                                          str(REPO)]))
    done = subprocess.run([sys.executable, "-m", "benchmarks.run", "--smoke", "--only", "decode", "--device", "cuda",
                           "--require-device", "cuda", "--no-progress", "--out", str(tmp_path / "bench")],
                          env=env, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "cuda backend is unavailable" in done.stdout + done.stderr
    assert not (tmp_path / "bench").exists() or not any((tmp_path / "bench").iterdir())


def test_bench_without_a_commit_fails_before_measuring(tmp_path):
    """Benchmark numbers without their commit could not be committed as anyone's results: refused at the start."""
    out = tmp_path / "out"
    base = {k: v for k, v in os.environ.items() if not k.startswith(("FAKE_", "GPU_SESSION_", "CUFLASH_GOLDEN"))}
    base.update(OUT=str(out), PYTHON=sys.executable, GPU_SESSION_DRY_RUN="1", GIT_DIR=str(tmp_path / "no-git"))
    done = subprocess.run(["bash", str(SCRIPT), "bench"], env=base, capture_output=True, text=True, timeout=180)
    assert done.returncode == 1 and "commit unknown" in session_json(out)["failed"]
    assert session_json(out)["bench_rc"] is None


@needs_emulator
def test_a_killed_session_says_so(tmp_path, golden_copy):
    """SIGTERM to the call's process group in the middle of the GPU tests: the status is 143, never 0, the step
    that was running does not read as passed, and the session's facts are there."""
    import signal
    import time

    out = tmp_path / "out"
    base = {k: v for k, v in os.environ.items() if not k.startswith(("FAKE_", "GPU_SESSION_", "CUFLASH_GOLDEN"))}
    base.update(OUT=str(out), PYTHON=sys.executable, GPU_SESSION_DRY_RUN="1", GPU_SESSION_COMMIT=COMMIT,
                CUFLASH_GOLDEN_DIR=str(golden_copy))
    proc = subprocess.Popen(["bash", str(SCRIPT), "tests"], env=base, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    deadline = time.monotonic() + 150
    while not (out / "gpu_tests.txt").exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(0.5)  # pytest starting up
    assert proc.poll() is None, "the tests ended before they could be killed: " + proc.stdout.read()
    os.killpg(proc.pid, signal.SIGTERM)
    log = proc.communicate(timeout=120)[0]
    assert proc.returncode == 143, log
    facts = session_json(out)
    assert facts["status"] == 143 and facts["tests_rc"] not in (0, None) and "killed by SIGTERM" in facts["failed"]
    assert facts["commit"] == COMMIT and facts["tree_sha256"]


def test_unknown_step_is_a_usage_error(tmp_path):
    done, _ = session(tmp_path, "benchmark")
    assert done.returncode == 2 and "usage:" in done.stderr


@pytest.mark.parametrize("given, seconds", [("0600", 600), ("0900", 900), ("580", 580)])
def test_a_budget_with_a_leading_zero_is_read_in_decimal(tmp_path, given, seconds):
    """GPU_SESSION_SECONDS passed its check as decimal digits, but shell arithmetic read a leading 0 as octal: 0600
    gave every step the limits of 384 s, 0900 ended the script ("value too great for base") before it wrote
    session.json. (The fake nvidia-smi without GPUs ends the session at its probe: a second, not a dry run.)"""
    done, out = session(tmp_path, "bench", FAKE_GPUS="", GPU_SESSION_SECONDS=given)
    assert done.returncode == 1 and "no GPU visible to nvidia-smi" in done.stdout, done.stdout + done.stderr
    facts = session_json(out)
    assert facts["budget_s"] == seconds and facts["status"] == 1  # a number, as the steps' statuses are
    assert facts["sanitize"] is None and facts["tests_rc"] is None  # steps that did not run: null, not "null"
    assert f", {seconds} s, DRY RUN" in (out / "session.txt").read_text()


@pytest.mark.parametrize("variable, value", [
    ("GPU_SESSION_SECONDS", "0149"), ("GPU_SESSION_SECONDS", "1e3"), ("GPU_SESSION_SECONDS", "1" + "0" * 19),
    ("GPU_SESSION_DRY_RUN", "true"), ("GPU_SESSION_DRY_RUN", "yes"), ("GPU_SESSION_DRY_RUN", "2"),
    ("GPU_SESSION_DRY_RUN", " 1")])
def test_a_bad_budget_or_dry_run_flag_is_a_usage_error(tmp_path, variable, value):
    """GPU_SESSION_DRY_RUN=true ran the real session (the script tested "= 1") while session.json said "dry_run":
    true (session.py read the value as JSON). A budget of 20 digits, which the decimal arithmetic would wrap, stays
    refused. Each is refused, status 2, with a line naming the variable, before anything is run or written."""
    done, out = session(tmp_path, "bench", **{variable: value})
    assert done.returncode == 2 and f"{variable} must be " in done.stderr and repr(value) in done.stderr.replace(
        '"', "'"), done.stdout + done.stderr
    assert not out.exists()


def test_a_relative_out_is_under_the_callers_folder(tmp_path, request):
    """The script changes into the checkout before making $OUT: a relative OUT landed in the checkout, not in the
    folder the caller named it from."""
    name = f"out-{os.getpid()}-{tmp_path.name}"
    request.addfinalizer(lambda: shutil.rmtree(REPO / name, ignore_errors=True))  # where the defect put it
    done, _ = session(tmp_path, "bench", cwd=tmp_path, OUT=name, FAKE_GPUS="")
    assert done.returncode == 1, done.stdout + done.stderr
    assert session_json(tmp_path / name)["status"] == 1 and not (REPO / name).exists()


@pytest.mark.parametrize("xml", ['<testsuite tests="abc"/>', None])
def test_a_junit_report_that_is_no_pytest_report_is_named(tmp_path, xml, capsys):
    """A count that is no integer, or a folder in place of the report, was a traceback (int(), IsADirectoryError)."""
    from benchmarks import session as sess

    path = tmp_path / "gpu_tests.xml"
    if xml is None:
        path.mkdir()
    else:
        path.write_text(xml)
    assert sess.main(["junit", str(path)]) == 1
    assert "is not a complete JUnit report" in capsys.readouterr().out


def test_session_json_numbers_the_sanitize_step_and_the_budget(tmp_path):
    """"sanitize" is null where the step did not run (it was the text "null"), and budget_s a number (it was text);
    the tools' statuses stay text."""
    from benchmarks import session as sess

    out = tmp_path / "session.json"
    assert sess.main(["finish", "--out", str(out), "--set", "sanitize=null", "budget_s=580", "status=0"]) == 0
    facts = json.loads(out.read_text())
    assert facts["sanitize"] is None and facts["budget_s"] == 580
    for text in ("memcheck:0,racecheck:0,synccheck:0,initcheck:0", "unfinished", "warm-up=1"):
        assert sess.main(["finish", "--out", str(out), "--set", f"sanitize={text}"]) == 0
        assert json.loads(out.read_text())["sanitize"] == text


@needs_emulator
def test_cuda_tile_sweep_launches_the_swept_kernel(monkeypatch, request):
    """The tile figure on CUDA runs the tile table's specialization with ``block_n = block_k`` through
    ``cuda.forward(spec=)``: the launch recorded by the fake is that kernel, not the table's choice."""
    from dataclasses import replace

    import fake_cupy_bench
    from benchmarks import cases, impls, inputs, run, timing
    from cuflash.backends import cuda
    from cuflash.cuda import specs

    cp = fake_cupy_bench.make()
    for name, module in fake_cupy_bench.modules(cp).items():
        monkeypatch.setitem(sys.modules, name, module)
    cuda._memoized.cache_clear()  # kernels memoized for another (fake) CuPy, and again after this test
    request.addfinalizer(cuda._memoized.cache_clear)
    case = cases.Case("tiles", "cuda", "fwd", "float16", 1, 2, 128, 128, 32, block_k=32)
    table = specs.select("fwd", "float16", 32)
    assert table.block_n != 32
    record = run.measure(case, impls.IMPLS["cuflash"], inputs.make_inputs(case), timing=timing.TIMINGS["smoke"])
    assert record.block_k == 32 and record.ms > 0
    assert {launch.name for launch in cp._launches} == {replace(table, block_n=32).name_expression}


@needs_emulator
def test_cuda_tile_sweep_and_io_model_use_the_rows_of_this_gpu(monkeypatch, request):
    """On an H100 (the fake's default) the head_dim 128 forward runs its own row (specs.ARCH_TILES): the key-tile
    sweep varies that row's block_n, and the IO model counts the tile that ran."""
    from dataclasses import replace

    import fake_cupy_bench
    from benchmarks import cases, impls, inputs, run, timing
    from cuflash.backends import cuda
    from cuflash.cuda import specs
    from cuflash.io_cost import io_cost

    cp = fake_cupy_bench.make()
    for name, module in fake_cupy_bench.modules(cp).items():
        monkeypatch.setitem(sys.modules, name, module)
    cuda._memoized.cache_clear()
    request.addfinalizer(cuda._memoized.cache_clear)
    assert cuda._device()[1] == 90
    h100 = specs.select("fwd", "float16", 128, specs.SMEM_LIMIT[90], cc=90)
    # the launch below tells the H100 row from the A100's only if they differ with the swept key tile swapped in
    assert replace(h100, block_n=32).name_expression != replace(specs.select("fwd", "float16", 128),
                                                                 block_n=32).name_expression
    case = cases.Case("tiles", "cuda", "fwd", "float16", 1, 1, 128, 128, 128, block_k=32)
    record = run.measure(case, impls.IMPLS["cuflash"], inputs.make_inputs(case), timing=timing.TIMINGS["smoke"])
    assert {launch.name for launch in cp._launches} == {replace(h100, block_n=32).name_expression}
    want = io_cost(seqlen_q=128, head_dim=128, heads=1, dtype="float16", block_q=h100.block_m, block_k=32)
    assert record.io_bytes == want.tiled
    # float32/float64: the forward's own tile; no figure for their backward, which the ledger does not describe
    for dtype, precision in (("float64", "ieee"), ("float32", "tf32")):
        wide = specs.select("wfwd", dtype, 64, specs.SMEM_LIMIT[90], cc=90, math=specs.wide_math(dtype, precision, 90))
        fwd = cases.Case("wide", "cuda", "fwd", dtype, 1, 2, 4096, 4096, 64, precision=precision)
        want = io_cost(seqlen_q=4096, head_dim=64, heads=2, dtype=dtype, block_q=wide.block_m, block_k=wide.block_n)
        assert impls.model_io_bytes(fwd, impls.IMPLS["cuflash"]) == want.tiled
        assert impls.model_io_bytes(cases.Case("wide", "cuda", "bwd", dtype, 1, 2, 4096, 4096, 64,
                                               precision=precision), impls.IMPLS["cuflash"]) is None


# ------------------------------------------------------------------------------------------------ sanitize, profile
@needs_emulator
def test_dry_run_sanitize_runs_every_tool_over_the_kernel_cases(tmp_path):
    done, out = session(tmp_path, "sanitize")
    assert done.returncode == 0, done.stdout + done.stderr
    assert {p.name for p in out.iterdir()} == {"session.json", "session.txt", "sanitize.txt"}
    facts = session_json(out)
    assert facts["sanitize"] == "memcheck:0,racecheck:0,synccheck:0,initcheck:0" and facts["status"] == 0
    report = (out / "sanitize.txt").read_text()
    for tool in ("memcheck", "racecheck", "synccheck", "initcheck"):
        assert f"==== compute-sanitizer --tool {tool}" in report
    assert report.count("f16-d64-causal: ok") == 5  # the warm-up and each tool ran the cases
    log = (out / "session.txt").read_text()
    assert "racecheck rc=0, ========= RACECHECK SUMMARY: 0 hazards" in log  # its own summary line, quoted
    assert "memcheck rc=0, ========= ERROR SUMMARY: 0 errors" in log


@needs_emulator
def test_sanitizer_errors_fail_the_session(tmp_path):
    done, out = session(tmp_path, "sanitize", FAKE_SANITIZER_ERRORS="racecheck")
    assert done.returncode == 1
    facts = session_json(out)
    assert facts["sanitize"] == "memcheck:0,racecheck:86,synccheck:0,initcheck:0"
    assert "compute-sanitizer found errors" in facts["failed"] and "racecheck:86" in facts["failed"]


@needs_emulator
def test_dry_run_profile_brings_back_the_ncu_report(tmp_path):
    done, out = session(tmp_path, "profile")
    assert done.returncode == 0, done.stdout + done.stderr
    assert {p.name for p in out.iterdir()} == {"session.json", "session.txt", "ncu.txt", "profile.ncu-rep"}
    assert session_json(out)["profile_rc"] == 0
    assert "f16-d64-causal: ok" in (out / "ncu.txt").read_text()


def test_profile_takes_only_the_cases_named(tmp_path):
    """GPU_SESSION_CASES: a short lease profiles (or sanitizes) the kernel cases it names, and no other."""
    done, out = session(tmp_path, "profile", GPU_SESSION_CASES="float32-3xtf32-d64")
    assert done.returncode == 0, done.stdout + done.stderr
    log = (out / "ncu.txt").read_text()
    assert "float32-3xtf32-d64: ok" in log and "f16-d64-causal" not in log


def test_host_cost_profiles_the_python_side_of_a_call():
    """benchmarks.host_cost on the fake GPU with launches that do nothing: each case's host and event times and a
    cProfile table whose rows are cuflash's own functions (the params packing among them)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FAKE_")}
    env.update(PYTHONPATH=os.pathsep.join([str(REPO / "tests" / "fake_gpu"), str(REPO / "tests"), str(REPO)]))
    done = subprocess.run([sys.executable, "-m", "benchmarks.host_cost", "--no-kernels", "--calls", "2", "--top", "40",
                           "--only", "fwd-n512-b32"], env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    host, events = map(float, lines[-1].split()[1:])
    assert lines[-2].split() == ["case", "host", "ms", "events", "ms"] and lines[-1].startswith("fwd-n512-b32")
    assert 0 < host <= events
    assert "cuda/params.py" in done.stdout and "(pack)" in done.stdout


@needs_emulator
def test_cuda_tile_candidate_launches_that_whole_tile(monkeypatch, request):
    """A case with ``tile=(block_m, block_n, warps)`` runs exactly that specialization of the forward kernel."""
    from dataclasses import replace

    import fake_cupy_bench
    from benchmarks import cases, impls, inputs, run, timing
    from cuflash.backends import cuda
    from cuflash.cuda import specs

    cp = fake_cupy_bench.make()
    for name, module in fake_cupy_bench.modules(cp).items():
        monkeypatch.setitem(sys.modules, name, module)
    cuda._memoized.cache_clear()
    request.addfinalizer(cuda._memoized.cache_clear)
    case = cases.Case("tiles", "cuda", "fwd", "float16", 1, 2, 128, 128, 32, block_k=32, tile=(64, 32, 4))
    record = run.measure(case, impls.IMPLS["cuflash"], inputs.make_inputs(case), timing=timing.TIMINGS["smoke"])
    assert record.tile == [64, 32, 4] and record.block_k == 32
    want = replace(specs.select("fwd", "float16", 32), block_m=64, block_n=32, warps=4)
    assert {launch.name for launch in cp._launches} == {want.name_expression}
    # the backward's main kernel likewise (after an untimed forward with the table's tile)
    cp._launches.clear()
    case = cases.Case("tiles", "cuda", "bwd", "float16", 1, 2, 128, 128, 32, block_k=64, tile=(64, 64, 4))
    record = run.measure(case, impls.IMPLS["cuflash"], inputs.make_inputs(case), timing=timing.TIMINGS["smoke"])
    assert record.tile == [64, 64, 4] and record.op == "bwd"
    want = replace(specs.select("bwd", "float16", 32), block_m=64, block_n=64, warps=4)
    assert want.name_expression in {launch.name for launch in cp._launches}
    assert specs.select("bwd", "float16", 32).name_expression not in {launch.name for launch in cp._launches}
    with pytest.raises(ValueError, match="block_n == block_k"):
        cases.Case("tiles", "cuda", "fwd", "float16", 1, 2, 128, 128, 32, block_k=64, tile=(64, 32, 4))


@needs_emulator
def test_kernel_cases_launch_every_kernel_family(monkeypatch, request):
    """What the sanitizer runs covers every kernel cuflash launches: the six families, the split-KV combine and the
    backward's helpers, each run once on the (fake, emulated) cuda backend."""
    import fake_cupy_bench
    from benchmarks import kernel_cases
    from cuflash.backends import cuda
    from cuflash.cuda import specs

    cp = fake_cupy_bench.make()
    for name, module in fake_cupy_bench.modules(cp).items():
        monkeypatch.setitem(sys.modules, name, module)
    cuda._memoized.cache_clear()
    request.addfinalizer(cuda._memoized.cache_clear)
    for case in kernel_cases.small_cases().values():
        case(cp, "cuda")
    launched = {launch.name.split("<")[0] for launch in cp._launches}
    kernels = set(specs.KERNEL_NAMES.values()) | set(specs.HELPERS) | set(specs.WIDE_HELPERS) | {specs.COMBINE}
    assert kernels <= launched, f"never launched: {sorted(kernels - launched)}"
    dims = {int(launch.name.split("<")[1].split(",")[1]) for launch in cp._launches
            if launch.name.startswith(specs.KERNEL_NAMES["fwd"] + "<")}
    assert dims == set(kernel_cases.HEAD_DIMS)


@needs_emulator
def test_profile_without_a_report_fails_the_session(tmp_path):
    """ncu without access to the counters ends 0 with no report: the session must not call that a profile."""
    done, out = session(tmp_path, "profile", FAKE_NCU_NO_COUNTERS="1")
    assert done.returncode == 1
    facts = session_json(out)
    assert facts["profile_rc"] == 1 and "ncu failed" in facts["failed"]
    assert not (out / "profile.ncu-rep").exists() and "ERR_NVGPUCTRPERM" in (out / "ncu.txt").read_text()


def test_profile_report_over_the_return_limit_stays_behind_and_an_unreadable_one_fails(tmp_path):
    """A device call returns files of at most 16 MiB: a larger report is left behind (ncu.txt has its details), and
    a report ncu cannot read back fails the profile."""
    done, out = session(tmp_path / "big", "profile", FAKE_NCU_REPORT_BYTES=str(17 * 1024 * 1024))
    assert done.returncode == 0 and not (out / "profile.ncu-rep").exists()
    assert "over 16 MiB" in (out / "session.txt").read_text()
    done, out = session(tmp_path / "bad", "profile", FAKE_NCU_IMPORT_FAILS="1")
    assert done.returncode == 1 and session_json(out)["profile_rc"] == 1
    assert "Failed to import report" in (out / "ncu.txt").read_text()


def test_session_json_keeps_text_as_text(tmp_path):
    """Only the status and step fields are numbers: a commit that looks like one (0e12345, 1234567) stays text."""
    from benchmarks import session as sess

    out = tmp_path / "session.json"
    assert sess.main(["finish", "--out", str(out), "--set", "commit=0e12345", "date=1234567", "tests_rc=3",
                      "bench_rc=unfinished", "profile_rc=null", "status=143", "dry_run=0"]) == 0
    facts = json.loads(out.read_text())
    assert facts["commit"] == "0e12345" and facts["date"] == "1234567"
    assert facts["tests_rc"] == 3 and facts["bench_rc"] == "unfinished" and facts["profile_rc"] is None
    assert facts["status"] == 143 and facts["dry_run"] is False


def test_a_cut_probe_file_is_reported_not_taken_up(tmp_path):
    """finish reads the probe's JSON back: cut short by a kill, it is named in session.json (it was a traceback, and
    gpu_session.sh fell back to a two-field session.json)."""
    from benchmarks import session as sess

    probe, out = tmp_path / "probe.json", tmp_path / "session.json"
    probe.write_text('{"python": "3.12", "cupy"')
    assert sess.main(["finish", "--out", str(out), "--probe", str(probe), "--set", "status=0"]) == 0
    facts = json.loads(out.read_text())
    assert "probe.json" in facts["probe_unreadable"] and facts["status"] == 0 and "python" not in facts


def test_junit_counts_named_cases_and_refuses_a_cut_report(tmp_path):
    """An interrupted xdist run leaves nameless <testcase time="0.000"/> entries (the first H100 report had 11): they
    ran nothing. A report cut short fails the check instead of crashing it."""
    from benchmarks import session as sess

    xml = tmp_path / "r.xml"
    xml.write_text('<testsuites><testsuite tests="4" failures="1" errors="0" skipped="1">'
                   '<testcase name="test_golden_a" time="1"/><testcase name="test_b" time="1"><failure/></testcase>'
                   '<testcase name="test_c" time="0"><skipped/></testcase><testcase time="0.000"/>'
                   '</testsuite></testsuites>')
    s = sess.junit_summary(xml)
    assert s["run"] == 2 and s["golden_run"] == 1
    xml.write_text(xml.read_text()[:80])
    assert "unreadable" in sess.junit_summary(xml)
    assert sess.main(["junit", str(xml)]) == 1


def test_tree_hash_names_the_code_that_ran(tmp_path):
    """The device's copy has no .git: the probe's tree_sha256 is what says which code ran; any change of a source
    file changes it, results and caches do not."""
    from benchmarks import session as sess

    tree = tmp_path / "tree"
    for rel in ("cuflash/a.py", "kernels/k.cuh", "benchmarks/results/x/fig.json", "cuflash/__pycache__/a.pyc"):
        (tree / rel).parent.mkdir(parents=True, exist_ok=True)
        (tree / rel).write_text(rel)
    first = sess.tree_hash(tree)
    (tree / "benchmarks/results/x/fig.json").write_text("other numbers")
    (tree / "cuflash/__pycache__/a.pyc").write_text("other bytes")
    assert sess.tree_hash(tree) == first
    (tree / "kernels/k.cuh").write_text("// changed")
    assert sess.tree_hash(tree) != first


def test_a_sharded_property_spreads_its_examples_over_its_shards(monkeypatch):
    """gpu_support.sharded (the GPU suite's long properties, one per xdist worker): each shard a test of its own with
    its share of the examples; derandomized, each draws from a seed of its own (shard and test), the same on every
    run."""
    from hypothesis import strategies as st

    import gpu_support

    monkeypatch.setattr(gpu_support, "_derandomized", lambda: True)  # the ci profile's, whatever this run's profile
    drawn = []

    def check_a(x):
        drawn.append(x)

    def check_b(x):
        drawn.append(x)

    def draws(check):
        test = gpu_support.sharded(st.integers(0, 2**60), max_examples=12, shards=3)(check)
        assert [m.args for m in test.pytestmark if m.name == "parametrize"] == [("shard", range(3))]
        assert test.__name__ == check.__name__
        per_shard = []
        for shard in range(3):
            drawn.clear()
            test(shard)
            per_shard.append(set(drawn))
        return per_shard

    a = draws(check_a)
    assert a == draws(check_a) and all(1 <= len(s) <= 4 for s in a)  # reproducible; a share each
    b = draws(check_b)
    # other draws in every shard and every test (the simplest example, 0, may open any of them)
    shards = a + b
    assert all(len(x & y - {0}) == 0 for i, x in enumerate(shards) for y in shards[i + 1:])
