"""tests/background.py, the start and the wait that the tests of faults, ranks and sweeps act on: a wait returns once
its condition holds, and fails, with the command's output, when the time runs out or the command ends first."""

import sys

import pytest
from background import start, wait_for

# Prints a line, then makes the file its argument names after 0.3 s (or never, given no argument), then sleeps.
SLOW = """import sys, time
print("started", flush=True)
time.sleep(0.3)
if len(sys.argv) > 1:
    open(sys.argv[1], "w").close()
time.sleep(60)
"""


def test_a_wait_returns_once_the_command_has_done_it(tmp_path):
    made = tmp_path / "made"
    process = start([sys.executable, "-c", SLOW, str(made)], log=tmp_path / "slow.log")
    try:
        waited = wait_for(made.exists, "the file", process, timeout=60)
        assert process.poll() is None and waited > 0
    finally:
        process.kill()
        process.wait()
    assert process.output() == "started\n"


def test_a_wait_for_what_never_comes_fails_with_the_commands_output(tmp_path):
    process = start([sys.executable, "-c", SLOW], log=tmp_path / "slow.log")
    try:
        with pytest.raises(AssertionError) as failed:
            wait_for(lambda: (tmp_path / "made").exists(), "the file", process, timeout=1)
    finally:
        process.kill()
        process.wait()
    log = tmp_path / "slow.log"
    assert str(failed.value) == f"waiting for the file: not after 1 s; its last output ({log}):\nstarted\n"


def test_a_wait_fails_as_soon_as_the_command_ends_without_it(tmp_path):
    code = "import sys; print('no such file', file=sys.stderr); sys.exit(3)"
    process = start([sys.executable, "-c", code], log=tmp_path / "ends.log")
    with pytest.raises(AssertionError, match=r"^waiting for the file: the command ended \(exit 3\) first; .*\nno such"):
        wait_for(lambda: (tmp_path / "made").exists(), "the file", process, timeout=600)
    assert process.returncode == 3


def test_a_condition_that_came_true_as_the_command_ended_is_not_a_failure(tmp_path):
    process = start([sys.executable, "-c", "pass"], log=tmp_path / "quick.log")
    process.wait()
    asked = []
    assert wait_for(lambda: asked.append(1) or len(asked) > 1, "the second look", process) >= 0  # false, then true
    assert len(asked) == 2


def test_a_wait_without_a_command_names_what_it_waited_for():
    with pytest.raises(AssertionError, match=r"^waiting for the job to leave the queue: not after 0\.2 s$"):
        wait_for(lambda: False, "the job to leave the queue", timeout=0.2)
