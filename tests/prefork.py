"""A pre-imported interpreter for the tests' commands: `python train.py ...` in a few milliseconds, not seconds.

Most of the suite's CPU is start-up: each `python train.py` a CLI test runs imports torch, Lightning and Hydra
(about 5 s of CPU on this machine, docs/testing.md). Here one server process imports them once, and each command
is a fork of it. pytest's controller starts the server (tests/conftest.py); a test runs `python()`, a shim in
the server's dir that behaves as the interpreter does for the caller:

- its own process: the command runs in a forked child with its own pid, its argv, environment, working dir and
  the caller's open file descriptors (stdin, stdout, stderr and any other it passed);
- signals: the shim forwards every signal it can catch to the child; SIGKILL of the shim kills the child (it
  watches the shim's end of their socket);
- the exit: the shim exits with the child's code, or dies of the child's signal.

What it cannot make the same, the shim leaves to the real interpreter (it `exec`s it): any form other than
`python SCRIPT ARGS` and `python -m MODULE ARGS`, a PYTHON* variable other than PYTHONPATH, PYTHONUNBUFFERED
and PYTHONDONTWRITEBYTECODE (they act while an interpreter starts), and a rank (RANK, LOCAL_RANK, SLURM_PROCID:
Lightning reads the rank once, at its import; and a rank that a launcher started watches its parent, which for
a fork would be the server: experiments.distributed.ranks.end_with_parent), and a command whose sys.path holds its
own copy of a module the server imported (prefork_shim.shadows). A test about the interpreter itself (startup_s,
the process tree under the test, a pid compared with the one it started, a SIGKILL that must land at once) names
`sys.executable`.
GPU_LAB_TEST_PREFORK=0 runs every command on the real interpreter. tests/test_prefork.py proves the above.

By hand: no library forks a pre-imported Python for arbitrary commands (pytest-xdist forks nothing, and
multiprocessing's forkserver runs functions, not commands with their own fds and exit status).
"""

import builtins
import fcntl
import gc
import importlib.machinery
import io
import json
import os
import runpy
import selectors
import signal
import socket
import sys
import threading
import types
from pathlib import Path

import prefork_shim

SHIM = """#!{python} -S
# gpu-lab's test shim (tests/prefork.py): `python ARGS` as a fork of a pre-imported interpreter.
import sys
sys.path.insert(0, {tests!r})
import prefork_shim
prefork_shim.main({python!r}, {socket!r})
"""

# What every command the tests run imports: once here, not once a command.
PRELOAD = ["experiments.commands.train", "experiments.commands.evaluate", "experiments.commands.predict",
           "experiments.sweeps.record", "tensorboard.backend.event_processing.event_accumulator"]  # fmt: skip


def start(directory: Path) -> tuple:
    """Start a server in `directory` (its socket, its log and the shim `python`); returns (process, shim path).
    The shim runs the real interpreter until the server listens."""
    import subprocess

    directory.mkdir(parents=True, exist_ok=True)
    shim = directory / "python"
    tests = str(Path(__file__).resolve().parent)
    shim.write_text(SHIM.format(python=sys.executable, tests=tests, socket=str(directory / "socket")))
    shim.chmod(0o755)
    # A command's own PYTHONPATH (and -u, -B) comes with the command; the server is no rank (Lightning reads it
    # at its import).
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in {*prefork_shim.SERVED_PYTHON_VARIABLES, *prefork_shim.RANK_VARIABLES}
    }
    # numpy's OpenBLAS starts its thread pool at import, and a fork copies no threads (its own pool is for numpy's
    # matrix products, which a run does not do: torch's are its own).
    env["OPENBLAS_NUM_THREADS"] = "1"
    log = open(directory / "log", "a")
    process = subprocess.Popen([sys.executable, __file__, str(directory)], env=env, stdin=subprocess.DEVNULL,
                               stdout=log, stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    log.close()
    return process, shim


def serve(directory: Path) -> tuple[socket.socket, dict]:
    """The server's loop; returns only in a forked child: (the connection to its shim, the request)."""
    for module in PRELOAD:
        __import__(module)
    # What the imports made stays out of every child's garbage collections (`gc.freeze`): a collection that walks
    # the server's objects writes to their pages, which a fork then copies, child after child.
    gc.collect()
    gc.freeze()
    tasks = os.listdir("/proc/self/task")
    if len(tasks) != 1:  # forking a process that runs other threads copies their locks, not the threads
        raise SystemExit(f"prefork: {len(tasks)} threads after the imports; not serving")
    base_path = sys.path[1:]  # without this file's dir: each command gets its own sys.path[0] and PYTHONPATH
    children: dict[int, socket.socket] = {}
    wakeup_read, wakeup_write = os.pipe()
    os.set_blocking(wakeup_write, False)
    signal.set_wakeup_fd(wakeup_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    # What a command's own sys.path must not hold another copy of (prefork_shim.shadows); the server's own aside.
    names = {name.split(".")[0] for name in sys.modules} - {"__main__", "prefork", "prefork_shim"}
    (directory / "modules.json").write_text(json.dumps(sorted(names)))
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    path = directory / "socket"
    path.unlink(missing_ok=True)
    listener.bind(str(path) + ".new")
    listener.listen(64)
    os.rename(str(path) + ".new", path)  # the shims connect only once it listens
    print(f"prefork: serving {path} as pid {os.getpid()}", flush=True)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    selector.register(wakeup_read, selectors.EVENT_READ)
    parent = os.getppid()
    while os.getppid() == parent:  # a session that ended without stopping it (killed) takes it along
        for key, _ in selector.select(timeout=1.0):
            if key.fileobj is listener:
                connection, _ = listener.accept()
                try:
                    message, fds, _, _ = socket.recv_fds(connection, 1 << 20, 256)
                    request = json.loads(message)
                except (OSError, ValueError) as error:  # a shim killed while it asked: the others go on
                    print(f"prefork: a request failed: {error!r}", flush=True)
                    connection.close()
                    continue
                sys.stdout.flush()
                pid = os.fork()
                if pid == 0:
                    selector.close()
                    listener.close()
                    signal.set_wakeup_fd(-1)
                    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                    os.close(wakeup_read)
                    os.close(wakeup_write)
                    for other in children.values():
                        other.close()
                    request["fds"], request["base_path"] = fds, base_path
                    return connection, request
                for fd in fds:
                    os.close(fd)
                children[pid] = connection
                command = [request.get("script") or f"-m {request['module']}", *request["args"]]
                print(f"prefork: pid {pid} runs {command} in {request['cwd']}", flush=True)
            else:
                os.read(wakeup_read, 4096)
                while children:
                    pid, status = os.waitpid(-1, os.WNOHANG)
                    if pid == 0:
                        break
                    connection = children.pop(pid, None)
                    if connection is not None:
                        try:
                            connection.sendall(f"exit {status}\n".encode())
                        except OSError:
                            pass  # the shim is gone (killed): the child has followed it
                        connection.close()
    print("prefork: the session has ended; so does the server", flush=True)
    raise SystemExit(0)


def become(connection: socket.socket, request: dict) -> None:
    """In the forked child: take the caller's fds, dir, environment and argv, then run the command."""
    targets = request["fd_numbers"]
    # Out of the way of the numbers the caller's fds go to: their copies, and this process's own connection.
    above = max([*targets, 2]) + 1
    high = [fcntl.fcntl(fd, fcntl.F_DUPFD, above) for fd in request["fds"]]
    for fd in request["fds"]:
        os.close(fd)
    connection = socket.socket(fileno=fcntl.fcntl(connection.detach(), fcntl.F_DUPFD_CLOEXEC, above + len(high)))
    for number in range(3):
        if number not in targets:
            os.close(number)
    for fd, number in zip(high, targets, strict=True):
        os.dup2(fd, number)
    for fd in high:
        if fd not in targets:
            os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.dont_write_bytecode = bool(os.environ.get("PYTHONDONTWRITEBYTECODE"))
    if os.environ.get("PYTHONUNBUFFERED"):  # as `python -u` makes them: no buffer under the text layer
        for name, fd in (("stdout", 1), ("stderr", 2)):
            stream = getattr(sys, name)
            unbuffered = io.TextIOWrapper(open(fd, "wb", 0, closefd=False), stream.encoding, stream.errors,
                                          write_through=True)  # fmt: skip
            setattr(sys, name, unbuffered)
            setattr(sys, f"__{name}__", unbuffered)
    try:
        import numpy

        numpy.random.seed()  # a new process draws its own; a fork would share the server's
    except ImportError:
        pass
    module, args = request["module"], request["args"]
    python_path = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [request["path0"], *python_path, *request["base_path"]]
    connection.sendall(f"pid {os.getpid()}\n".encode())

    def follow_the_shim() -> None:  # the shim's end closes when it ends: a SIGKILL of it reaches here
        try:
            while connection.recv(1):
                pass
        except OSError:
            pass
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=follow_the_shim, name="prefork-shim", daemon=True).start()
    if module:
        sys.argv = [module, *args]
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    else:  # as the interpreter runs a script: argv[0] as given, __file__ absolute (runpy.run_path makes both one)
        sys.argv = [request["script"], *args]
        path = os.path.abspath(request["script"])
        main = types.ModuleType("__main__")
        loader = importlib.machinery.SourceFileLoader("__main__", path)
        main.__dict__.update(__file__=path, __loader__=loader, __cached__=None, __builtins__=builtins)
        sys.modules["__main__"] = main
        exec(compile(Path(path).read_bytes(), path, "exec"), main.__dict__)


if __name__ == "__main__":
    become(*serve(Path(sys.argv[1])))
