"""The pre-imported interpreter (tests/prefork.py) behaves as the real one for the commands the tests run: each test
runs the same probe on both and compares, and checks that the shim's was a fork (torch already imported)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import prefork
import pytest
from background import start, wait_for
from conftest import ROOT, TINY

# What a command sees of its process, printed as one JSON line; then what the test asks of it (argv[1]).
PROBE = """
import json, os, signal, sys, time
print(json.dumps({
    "preloaded": "torch" in sys.modules, "pid": os.getpid(), "argv": sys.argv, "cwd": os.getcwd(),
    "file": __file__, "name": __name__, "path0": sys.path[0], "var": os.environ.get("PROBE_VAR"),
    "stdin": sys.stdin.readline(), "executable": sys.executable,
}), flush=True)
os.write(int(os.environ["PROBE_FD"]), b"through a passed fd")
action = sys.argv[1]
if action == "exit":
    sys.exit(int(sys.argv[2]))
if action == "raise":
    raise RuntimeError("the probe's own error")
if action == "die":
    os.kill(os.getpid(), signal.SIGUSR2)
if action == "handle":
    # os.write, not print: the signal may land inside print's own flush of "waiting" (a reentrant call).
    signal.signal(signal.SIGTERM, lambda n, f: (os.write(1, f"handled {n}\\n".encode()), sys.exit(7)))
if action in ("handle", "wait"):
    print("waiting", flush=True)
    time.sleep(60)
"""


@pytest.fixture(scope="module")
def shim(tmp_path_factory):
    """A server of the test's own (the session's, where there is one, serves the other tests)."""
    directory = tmp_path_factory.mktemp("prefork")
    server, shim = prefork.start(directory)
    deadline = time.monotonic() + 120
    while not (directory / "socket").exists():
        assert server.poll() is None, (directory / "log").read_text()
        assert time.monotonic() < deadline, "the server did not listen within 120 s"
        time.sleep(0.1)
    yield shim
    server.terminate()
    server.wait(timeout=30)


def environment(**extra) -> dict:
    """The caller's environment without its PYTHON* variables (some would send the shim to the real interpreter)."""
    return {**{k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}, **extra}


def probe(interpreter: str, tmp_path: Path, *args: str, wait: bool = True, **env):
    """Run the probe script (by a relative path, from tmp_path) with one extra fd passed; returns (process, fd)."""
    (tmp_path / "probe.py").write_text(PROBE)
    read, write = os.pipe()
    process = subprocess.Popen(
        [interpreter, "probe.py", *args],
        cwd=tmp_path,
        env=environment(PROBE_VAR="from the caller", PROBE_FD=str(write), **env),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        pass_fds=(write,),
    )
    os.close(write)
    process.stdin.write("a line on stdin\n")
    process.stdin.flush()
    return process, read


def seen(process: subprocess.Popen) -> dict:
    return json.loads(process.stdout.readline())


@pytest.mark.parametrize("code", [0, 3])
def test_a_command_runs_in_its_own_forked_process_with_the_callers_argv_dir_env_and_fds(shim, tmp_path, code):
    results = {}
    for name, interpreter in (("real", sys.executable), ("shim", str(shim))):
        process, fd = probe(interpreter, tmp_path, "exit", str(code))
        results[name] = seen(process), process.wait(timeout=60), os.read(fd, 100), process.pid
        os.close(fd)
    (real, real_code, real_fd, _), (served, served_code, served_fd, shim_pid) = results["real"], results["shim"]
    assert served["preloaded"] and not real["preloaded"]  # a fork of the server, which imported torch
    assert served["pid"] != shim_pid and Path(f"/proc/{served['pid']}").exists() is False  # its own, now ended
    for key in ("argv", "cwd", "file", "name", "path0", "var", "stdin"):
        assert served[key] == real[key], key
    assert served["argv"] == ["probe.py", "exit", str(code)] and served["file"] == str(tmp_path / "probe.py")
    assert served["executable"] == real["executable"] == sys.executable  # what a command of its own starts
    assert served_fd == real_fd == b"through a passed fd"
    assert served_code == real_code == code


def test_an_error_and_a_death_by_signal_reach_the_caller_as_they_are(shim, tmp_path):
    for action, expected in (("raise", 1), ("die", -signal.SIGUSR2)):
        codes, errors = [], []
        for interpreter in (sys.executable, str(shim)):
            process, fd = probe(interpreter, tmp_path, action)
            _, stderr = process.communicate(timeout=60)
            os.close(fd)  # after the probe wrote to it
            codes.append(process.returncode)
            errors.append(stderr.strip().splitlines()[-1:] if stderr.strip() else [])
        assert codes == [expected, expected], action
        assert errors[0] == errors[1], action  # `RuntimeError: the probe's own error`, or nothing


@pytest.mark.parametrize(
    ("action", "signum", "expected"),
    [("handle", signal.SIGTERM, 7), ("wait", signal.SIGINT, -signal.SIGINT), ("wait", signal.SIGTERM, -15)],
)
def test_a_signal_to_the_shim_is_a_signal_to_the_command(shim, tmp_path, action, signum, expected):
    outputs = []
    for interpreter in (sys.executable, str(shim)):
        process, fd = probe(interpreter, tmp_path, action)
        seen(process)
        assert process.stdout.readline() == "waiting\n"
        process.send_signal(signum)
        stdout, _ = process.communicate(timeout=60)
        os.close(fd)
        outputs.append((process.returncode, stdout))
    assert outputs[0] == outputs[1] and outputs[0][0] == expected


def test_a_sigkill_of_the_shim_ends_the_command(shim, tmp_path):
    process, fd = probe(str(shim), tmp_path, "wait")
    child = seen(process)["pid"]
    assert process.stdout.readline() == "waiting\n"
    process.kill()  # SIGKILL: no handler forwards it
    process.wait(timeout=10)
    os.close(fd)
    # Its server reaps it.
    wait_for(lambda: not Path(f"/proc/{child}").exists(), "the command to end with its shim", timeout=10)


def test_what_the_shim_cannot_serve_runs_on_the_real_interpreter(shim, tmp_path):
    code = "import sys; print('torch' in sys.modules)"
    done = subprocess.run([str(shim), "-c", code], env=environment(), capture_output=True, text=True, timeout=60)
    assert done.stdout == "False\n"  # `-c`
    for variable in ({"PYTHONHASHSEED": "0"}, {"LOCAL_RANK": "1"}):  # acts at start; a rank: Lightning reads it
        process, fd = probe(str(shim), tmp_path, "exit", "0", **variable)
        assert not seen(process)["preloaded"] and process.wait(timeout=60) == 0, variable
        os.close(fd)
    # A command's own copy of a module the server imported: a clone's package on its PYTHONPATH.
    (tmp_path / "clone" / "experiments").mkdir(parents=True)
    process, fd = probe(str(shim), tmp_path, "exit", "0", PYTHONPATH=str(tmp_path / "clone"))
    assert not seen(process)["preloaded"] and process.wait(timeout=60) == 0
    os.close(fd)


def test_the_users_commands_run_as_with_the_real_interpreter(shim, tmp_path):
    """Hydra's own start-up in the fork: a bad setting is one line and exit 2; a run completes and interrupted by
    SIGTERM exits 143 with its checkpoint, as docs/failures.md says."""
    env = environment()
    bad = subprocess.run([str(shim), "train.py", "data.batch_size=0"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=120)  # fmt: skip
    assert bad.returncode == 2 and bad.stderr.startswith("error: data.batch_size=0"), bad.stderr
    long = ["data.num_samples=100000", "data.batch_size=4", "trainer.max_epochs=1", "logger=csv"]
    command = [str(shim), "train.py", *TINY, *long, f"hydra.run.dir={tmp_path / 'run'}"]
    process = start(command, log=tmp_path / "run.log", env=env)
    wait_for((tmp_path / "run" / "csv" / "metrics.csv").exists, "a logged step", process, timeout=120)
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=60) == 128 + signal.SIGTERM, process.output()
    assert json.loads((tmp_path / "run" / "metrics.json").read_text())["status"] == "interrupted"
    assert (tmp_path / "run" / "checkpoints" / "last.ckpt").exists()
    log = (shim.parent / "log").read_text()
    assert f"runs ['train.py', {command[2]!r}" in log  # both were forks
    assert log.count("runs ['train.py'") == 2
