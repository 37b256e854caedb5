"""The `python` that tests run (tests/prefork.py): asks the pre-imported server to fork the command, then stands in
for it towards the caller (signals in, exit status out). Started with `python -S`: only the standard library's
built-in modules, so that it starts in milliseconds."""

import json
import os
import signal
import socket
import sys

# Variables that act while an interpreter starts (the server started long before): such a command runs for real.
SERVED_PYTHON_VARIABLES = {"PYTHONPATH", "PYTHONUNBUFFERED", "PYTHONDONTWRITEBYTECODE"}
# A rank: Lightning reads these once, at its import (lightning.fabric.utilities.rank_zero), and a rank that a
# launcher started watches its parent (experiments.distributed.ranks.end_with_parent), for a fork the server.
RANK_VARIABLES = {"RANK", "LOCAL_RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK"}
# What a signal sent to the shim means for the command; the faults are the shim's own, and the child's own
# SIGCHLD, SIGPIPE and terminal stops are no caller's message.
NOT_FORWARDED = {signal.SIGKILL, signal.SIGSTOP, signal.SIGCHLD, signal.SIGPIPE, signal.SIGTSTP, signal.SIGTTIN,
                 signal.SIGTTOU, signal.SIGSEGV, signal.SIGBUS, signal.SIGFPE, signal.SIGILL, signal.SIGTRAP,
                 signal.SIGSYS}  # fmt: skip


def servable(args: list[str], env: dict) -> dict | None:
    """The request for `python ARGS`, or None where only the real interpreter behaves as the caller expects."""
    if any(k.startswith("PYTHON") and k not in SERVED_PYTHON_VARIABLES for k in env) or RANK_VARIABLES & set(env):
        return None
    # path0: sys.path's first entry, as the interpreter makes it (the working dir; the script's real dir).
    if len(args) >= 2 and args[0] == "-m" and not args[1].startswith("-"):
        return {"module": args[1], "args": args[2:], "path0": os.getcwd()}
    if args and not args[0].startswith("-"):
        return {
            "module": None,
            "script": args[0],
            "args": args[1:],
            "path0": os.path.dirname(os.path.realpath(args[0])),
        }
    return None


def shadows(request: dict, env: dict, modules: str) -> bool:
    """Would the command import its own copy of a module the server imported (a clone's `src` on its PYTHONPATH,
    a script beside its own package)? Its sys.path's first entry and PYTHONPATH's, as the interpreter makes them."""
    entries = [request["path0"], *(p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p)]
    with open(modules) as names:
        imported = set(json.load(names))
    for entry in entries:
        try:
            found = {name.removesuffix(".py").split(".")[0] for name in os.listdir(entry)}
        except OSError:
            continue
        if found & imported:
            return True
    return False


def main(python: str, path: str) -> None:
    request = servable(sys.argv[1:], os.environ)
    modules = os.path.join(os.path.dirname(path), "modules.json")
    connection = None
    if request is not None and os.path.exists(path) and not shadows(request, os.environ, modules):
        try:
            connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            connection.connect(path)
        except OSError:
            connection = None
    if connection is None:
        os.execv(python, [python, *sys.argv[1:]])
    forwarded = signal.valid_signals() - NOT_FORWARDED
    signal.pthread_sigmask(signal.SIG_BLOCK, forwarded)  # until the child's pid is known; then delivered to it
    fds = []
    for name in os.listdir("/proc/self/fd"):  # every descriptor the caller left open here (pass_fds too)
        fd = int(name)
        if fd != connection.fileno():
            try:
                os.fstat(fd)
                fds.append(fd)
            except OSError:
                pass  # listdir's own, closed by now
    request.update(cwd=os.getcwd(), env=dict(os.environ), fd_numbers=fds)
    socket.send_fds(connection, [json.dumps(request).encode()], fds)
    replies = connection.makefile("rb")
    line = replies.readline()
    if not line.startswith(b"pid "):
        sys.exit(f"prefork: the server did not start {sys.argv[1:]}: {line!r} (tests/prefork.py; its log)")
    child = int(line.split()[1])

    def forward(signum, _frame):
        try:
            os.kill(child, signum)
        except ProcessLookupError:
            pass  # it has just ended: its status follows

    for signum in forwarded:
        try:
            signal.signal(signum, forward)
        except (OSError, ValueError):
            pass
    signal.pthread_sigmask(signal.SIG_UNBLOCK, forwarded)
    line = replies.readline()
    if not line.startswith(b"exit "):
        sys.exit(f"prefork: the server ended before pid {child}'s exit status (tests/prefork.py; its log)")
    status = int(line.split()[1])
    sys.stdout.flush()
    if os.WIFSIGNALED(status):
        signum = os.WTERMSIG(status)
        if signum != signal.SIGKILL:
            signal.signal(signum, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signum})
        os.kill(os.getpid(), signum)
        os._exit(128 + signum)  # a signal that does not end a process by default
    os._exit(os.WEXITSTATUS(status))
