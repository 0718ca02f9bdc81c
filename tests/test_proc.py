"""qual.proc with real processes and signals: the parent-death request (this test is the driver, a python child its
server), and signals held across code a raising handler must not interrupt."""

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


# qual's own handler (qual.cli.main.Interrupts, which raises KeyboardInterrupt) and a SIGINT sent inside the held
# block: the block must run to its end, and the interrupt arrive right after it.
_HELD = textwrap.dedent("""
    import os, signal
    from qual.cli.main import Interrupts
    from qual.proc import signals_held
    Interrupts().install()
    done = []
    try:
        with signals_held({signal.SIGINT, signal.SIGTERM}):
            os.kill(os.getpid(), signal.SIGINT)
            sum(range(10**6))  # bytecode on which an unheld signal's handler would have run
            done.append("block")
        done.append("after")
    except KeyboardInterrupt:
        print(",".join(done), signal.pthread_sigmask(signal.SIG_BLOCK, set()) == set())
""")


def test_a_held_signal_reaches_the_handler_after_the_block_not_inside_it():
    out = subprocess.run([sys.executable, "-c", _HELD], capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["block", "True"], out.stdout + out.stderr  # not "after": raised at the block's end


# A stop signal whose KeyboardInterrupt a C extension turns into its own error (safetensors' load_file, interrupted
# while it makes a tensor, raises ValueError about an UntypedStorage): the loader must end as an interrupt, not as an
# unreadable checkpoint. The extension's part is played by a load_file that takes the signal and raises that error.
_DISGUISED = textwrap.dedent("""
    import os, signal, sys
    import torch
    from qual.checkpoints import io
    from qual.cli.main import Interrupts
    from qual.errors import QualError
    import safetensors.torch
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(2)}, sys.argv[1] + "/model.safetensors")
    real = safetensors.torch.load_file  # what qual.userfiles.load_safetensors calls

    def interrupted_inside(path):
        try:
            os.kill(os.getpid(), signal.SIGHUP)
            sum(range(10**6))  # the handler runs here and raises KeyboardInterrupt
        except KeyboardInterrupt:
            pass  # swallowed, as inside the extension
        raise ValueError("could not determine the shape of object type 'torch.storage.UntypedStorage'")

    print(sorted(io.load_weights(sys.argv[1])))  # before any signal: loads
    safetensors.torch.load_file = interrupted_inside
    Interrupts(deadline_s=60).install()
    try:
        io.load_weights(sys.argv[1])
        print("loaded")
    except KeyboardInterrupt:
        print("interrupted")
    except QualError as exc:
        print("error:", exc)
""")


def test_a_stop_signal_disguised_as_a_loaders_error_still_ends_as_an_interrupt(tmp_path):
    out = subprocess.run([sys.executable, "-c", _DISGUISED, str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert out.stdout.split("\n")[:2] == ["['w']", "interrupted"], out.stdout + out.stderr


_INDUCTOR_CACHE = textwrap.dedent("""
    import os, tempfile
    from qual.proc import private_tmp
    private = private_tmp().path
    from torch._inductor.runtime.cache_dir_utils import cache_dir
    assert tempfile.gettempdir() == private
    print(cache_dir())
""")


@pytest.mark.parametrize("preset", [None, "mine"])
def test_torch_compiles_cache_outlives_the_private_temp_folder(tmp_path, preset):
    """torch.compile's cache (by default under the temp directory, which a command makes private and removes) is kept
    in qual's cache folder, so a later run reuses the compiled graphs; a TORCHINDUCTOR_CACHE_DIR the user set stays."""
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    env["XDG_CACHE_HOME"] = str(tmp_path / "cache")
    if preset:
        env["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path / preset)
    out = subprocess.run([sys.executable, "-c", _INDUCTOR_CACHE], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    expected = tmp_path / preset if preset else tmp_path / "cache" / "qual" / "torchinductor"
    assert out.stdout.strip() == str(expected)
