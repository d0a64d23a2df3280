"""What the tests that fork share: waiting for the child without letting a hang stall the run."""
import os
import time

import pytest


def child_exit_code(pid, seconds=60):
    """The exit code of the forked child ``pid``; one still running after ``seconds`` is killed and fails the test
    (a lock held at the fork), instead of stalling the run."""
    deadline = time.monotonic() + seconds
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            pytest.fail(f"the forked child still waited after {seconds} s: a lock held at the fork")
        time.sleep(0.05)
