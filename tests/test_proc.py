"""qual.proc's parent-death request with real processes: this test is the driver, a python child its server."""

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl and /proc are Linux's")

# The child forks a grandchild that asks for its parent's death signal and checks its grandparent; the child's
# exit status is the grandchild's.
_SERVER = textwrap.dedent("""
    import os, sys
    from qual.proc import die_with_parent
    pid = os.fork()
    if pid == 0:
        armed = die_with_parent(int(sys.argv[1]), via_server=True)
        os._exit(0 if armed else 3)
    os._exit(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
""")


def _grandchild_exit(expected_grandparent: int) -> int:
    return subprocess.run([sys.executable, "-c", _SERVER, str(expected_grandparent)], timeout=60).returncode


def test_a_process_forked_by_a_server_of_the_driver_arms_and_stays():
    assert _grandchild_exit(os.getpid()) == 0


def test_a_process_whose_grandparent_is_not_the_driver_exits_at_once():
    assert _grandchild_exit(os.getppid()) == 1  # as if the server had died and left it to another process
