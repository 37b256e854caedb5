import fcntl
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import prefork
import pytest
import torch
from hydra import compose, initialize_config_dir
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from experiments.commands.entry import CONFIG_DIR
from experiments.commands.train import train

ROOT = Path(__file__).resolve().parents[1]

# A problem small enough for a test to train in a second or two on one CPU core, on the CPU also where a GPU is
# (accelerator=auto would take it, and the tests' budgets, DDP x2 and gloo are the CPU's): a GPU test says
# trainer.accelerator=gpu after it, and the later override wins.
TINY = [
    "trainer.accelerator=cpu",
    "data.num_samples=640",
    "data.num_features=8",
    "data.batch_size=64",
    "trainer.max_epochs=2",
    "trainer.log_every_n_steps=1",
    "trainer.enable_progress_bar=false",
]


def pytest_runtest_setup(item):
    """@pytest.mark.cuda: skipped where PyTorch sees no CUDA GPU (never faked); scripts/gpu_check.sh runs -m cuda."""
    if item.get_closest_marker("cuda") and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")


# Parallel workers ----------------------------------------------------------------------------------------------
# `pytest` runs the suite on several workers (pytest-xdist; `-n auto --dist loadfile` in pyproject.toml): most of a
# test's time is a subprocess starting or a job waiting, so workers overlap the waits. A test file runs on one worker,
# so that a module's fixtures (a shared run or sweep, a SLURM cluster's check) are made once. (`--dist loadgroup`
# would split files finer, but pytest-xdist 3.8 cannot group under pytest 9.2: it renames a node id pytest no longer
# reads.)
# A test marked `alone` compares timings (tests/test_timings.py, run last): no other test runs beside it.
# Every test holds a lock file shared, an `alone` test exclusively; a turnstile, taken before the lock, keeps new tests
# from starting while an `alone` one waits for the running ones (overlapping shared holders could otherwise starve
# it). By hand: neither pytest nor pytest-xdist has a lock across workers.
WORKERS_PER_CORE = 2
LOCKS = "GPU_LAB_TEST_LOCKS"  # the session's lock dir, made by the controller, inherited by the workers


# Commands run on a pre-imported interpreter (tests/prefork.py): the controller starts its server in the session's
# dir; GPU_LAB_TEST_PREFORK=0 runs them on the real one.
PREFORK = "GPU_LAB_TEST_PREFORK"
PREFORK_DIR = "GPU_LAB_TEST_PREFORK_DIR"  # the server's dir, inherited by the workers


def pytest_configure(config):
    if LOCKS not in os.environ:  # the controller (or a run without workers): the workers inherit it
        os.environ[LOCKS] = tempfile.mkdtemp(prefix="gpu-lab-test-locks-")
        # The runs' measured matmul rate (experiments.training.mfu): the session's own cache, not the user's.
        os.environ.setdefault("GPU_LAB_CACHE", str(Path(os.environ[LOCKS]) / "cache"))
        config.add_cleanup(lambda: shutil.rmtree(os.environ.pop(LOCKS), ignore_errors=True))
        if os.environ.get(PREFORK, "1") != "0":
            server, shim = prefork.start(Path(os.environ[LOCKS]) / "prefork")
            os.environ[PREFORK_DIR] = str(shim.parent)
            config.add_cleanup(lambda: stop_prefork(server))


def stop_prefork(server: subprocess.Popen) -> None:
    os.environ.pop(PREFORK_DIR, None)
    server.terminate()
    server.wait(timeout=30)


def python() -> str:
    """The interpreter that a test's command names: the pre-imported one's shim where the session started it
    (tests/prefork.py), else this one. A test about the interpreter's own start names `sys.executable`."""
    directory = os.environ.get(PREFORK_DIR)
    return str(Path(directory) / "python") if directory else sys.executable


def pytest_xdist_auto_num_workers(config):
    """`-n auto`: GPU_LAB_TEST_WORKERS, else WORKERS_PER_CORE workers a core, the tests being mostly waits."""
    return int(os.environ.get("GPU_LAB_TEST_WORKERS") or WORKERS_PER_CORE * (os.cpu_count() or 1))


def pytest_collection_modifyitems(config, items):
    """The order in which the files go to the workers (pyproject's --no-loadscope-reorder keeps it; by default
    pytest-xdist sends the files with most tests first). Stable: the order within a file is kept.
    - The files of SLURM jobs first: their tests wait on a scheduler, minutes each, one after another on one worker,
      while the other workers spend the CPU on the rest; last, they would be the suite's tail.
    - The files of `alone` tests last (tests/test_timings.py): an `alone` test waits for every running test to end
      and lets none start meanwhile; at the end there is none left to start."""
    slurm = {item.path for item in items if item.get_closest_marker("slurm")}
    alone = {item.path for item in items if item.get_closest_marker("alone")}
    items.sort(key=lambda item: 0 if item.path in slurm else 2 if item.path in alone else 1)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    alone = item.get_closest_marker("alone") is not None
    locks = Path(os.environ[LOCKS])
    with open(locks / "turnstile", "a") as turnstile, open(locks / "running", "a") as running:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        fcntl.flock(running, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        if not alone:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
        yield  # setup (a module's fixtures too), call, teardown; closing the files releases the locks


def sigint_heard() -> None:
    """SIGINT as a terminal's command has it: Python's KeyboardInterrupt, not ignored. An ignored signal survives
    exec, so every command a test runs would ignore it too (test_prefork's probe outlived its SIGINT in two runs of
    .ci/run, each time after other tests in its worker). Two ways it gets ignored: a script's background job starts
    with SIGINT ignored, and Lightning 2.6 ignores it for good once a KeyboardInterrupt reaches its fit
    (`_call_and_handle_interrupt`), which an in-process run (a module's fixture too) leaves to the tests after it."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


sigint_heard()  # in the controller before it starts the pre-imported interpreter's server, and in each worker


@pytest.fixture(autouse=True)
def sigint_heard_by_each_test():
    sigint_heard()
    yield
    sigint_heard()


def metrics(run_dir: Path) -> dict:
    """A run's metrics.json; {} while there is none (or it is being replaced)."""
    try:
        return json.loads((run_dir / "metrics.json").read_text())
    except (OSError, ValueError):
        return {}


def final_weights(run_dir: Path) -> dict:
    """A run's last.ckpt weights, and its step (bit-for-bit comparisons compare where the runs ended too)."""
    checkpoint = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=False)
    return {**checkpoint["state_dict"], "global_step": torch.tensor(checkpoint["global_step"])}


def shrink(overrides) -> list[str]:
    """TINY before the overrides; its synthetic-data keys only where the data is synthetic."""
    synthetic = all(not o.startswith("data=") or o == "data=synthetic" for o in overrides)
    return [o for o in TINY if synthetic or not o.startswith("data.")] + list(overrides)


def compose_config(*overrides: str, tiny: bool = True):
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        return compose("config", overrides=shrink(overrides) if tiny else list(overrides))


@pytest.fixture
def run_in_process(tmp_path):
    """Train in this process through `experiments.commands.train.train`; returns (metrics, run_dir)."""

    def run(*overrides: str, tiny: bool = True, run_dir: Path | None = None):
        run_dir = run_dir or tmp_path / "run"
        return train(compose_config(*overrides, tiny=tiny), run_dir), run_dir

    return run


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """One TINY run (2 epochs of 8 steps, logged every step) shared by a module's tests: (metrics, run_dir)."""
    run_dir = tmp_path_factory.mktemp("run")
    return train(compose_config(), run_dir), run_dir


def with_tests_on_path() -> dict:
    """The environment with tests/ on the PYTHONPATH: a run from the command line can name a test's own class in its
    config (`model._target_=slow_rank.SlowOnRankOne`, `+callbacks.x._target_=signal_rank.SignalPeer`)."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])}


def cli(*args: str, tiny: bool = True, timeout: float = 300, interpreter: str | None = None, **kwargs):
    """`python train.py ARGS` as a user types it, from the repository root (a subprocess.CompletedProcess)."""
    command = [interpreter or python(), "train.py", *(shrink(args) if tiny else args)]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout, **kwargs)


def logged_tags(run_dir: Path) -> list[str]:
    """The scalar tags on disk in a run's TensorBoard files (`glob` below `tensorboard/`): `train/loss` there
    means training is under way; the event file alone is made when the logger is, before the first step."""
    events = sorted(run_dir.glob("tensorboard/**/events.*"))
    if not events:
        return []
    accumulator = EventAccumulator(str(events[0].parent))
    accumulator.Reload()
    return accumulator.Tags()["scalars"]


@contextmanager
def tensorboard_server(logdir: Path, runs: int):
    """`tensorboard --logdir LOGDIR --port 0` (the OS picks a free port), stopped on exit; yields its URL once
    `/data/runs` lists `runs` runs (the server loads event files in the background)."""
    command = [python(), "-m", "tensorboard.main", "--logdir", str(logdir), "--host", "127.0.0.1", "--port", "0"]
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        url = None
        for line in server.stderr:  # "TensorBoard 2.x at http://127.0.0.1:PORT/ (Press CTRL+C to quit)"
            if match := re.search(r"http://127\.0\.0\.1:\d+/", line):
                url = match.group(0)
                break
        assert url, "TensorBoard printed no URL"
        deadline = time.monotonic() + 60
        while len(tensorboard_get(url, "data/runs")) < runs and time.monotonic() < deadline:
            time.sleep(0.5)
        yield url
    finally:
        server.terminate()
        server.wait(timeout=30)


def tensorboard_get(url: str, path: str, **query):
    """GET one of TensorBoard's data endpoints (`data/runs`, `data/plugin/scalars/tags`, ...) as JSON."""
    with urllib.request.urlopen(url + path + ("?" + urllib.parse.urlencode(query) if query else ""), timeout=30) as r:
        return json.loads(r.read())


def tensorboard_post(url: str, path: str, body: dict):
    """POST to one of TensorBoard's data endpoints (`data/plugin/hparams/experiment`, `.../session_groups`)."""
    request = urllib.request.Request(url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


@pytest.fixture
def tmpfs(tmp_path):
    """`mount(size)`: a real tmpfs of `size` bytes (and `inodes` file entries, when given) mounted at a fresh dir
    under tmp_path (unmounted afterwards),
    for tests of a full disk. Skipped where this process cannot mount (not root, no mount(8)); CI sets
    GPU_LAB_REQUIRE_TMPFS=1 (.ci/run), so a skip fails there."""
    mounted = []

    def mount(size: int, name: str = "disk", inodes: int | None = None) -> Path:
        point = tmp_path / name
        point.mkdir()
        options = f"size={size}" + (f",nr_inodes={inodes}" if inodes else "")
        command = ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(point)]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            reason = f"cannot mount a tmpfs here: {done.stderr.strip() or done.returncode}"
            if os.environ.get("GPU_LAB_REQUIRE_TMPFS"):
                pytest.fail(f"GPU_LAB_REQUIRE_TMPFS=1 but {reason}")
            pytest.skip(reason)
        mounted.append(point)
        return point

    yield mount
    for point in mounted:
        subprocess.run(["umount", "-l", str(point)], capture_output=True)


def resize(point: Path, size: int) -> None:
    """Grow (or shrink) a tmpfs of the `tmpfs` fixture in place: its files stay."""
    subprocess.run(["mount", "-o", f"remount,size={size}", str(point)], check=True, capture_output=True)


def used_pages(root: Path, skip: tuple[str, ...] = ()) -> int:
    """Bytes a tmpfs charges for the files under `root` (whole 4 KiB pages), leaving out the files and dirs
    named in `skip`."""
    files = (p for p in root.rglob("*") if p.is_file() and not set(p.relative_to(root).parts) & set(skip))
    return sum(-(-p.stat().st_size // 4096) * 4096 for p in files)


# A real browser (tests/test_tensorboard.py, tests/test_search.py) -------------------------------------------------


@pytest.fixture(scope="module")
def browser():
    reason = None
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        reason = "Playwright is not installed (pip install -e '.[dev]')"
    executable = os.environ.get("GPU_LAB_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    if reason is None and executable is None:
        reason = "no Chromium browser (Debian: apt-get install chromium; or GPU_LAB_CHROMIUM=path)"
    if reason:
        if os.environ.get("GPU_LAB_REQUIRE_BROWSER"):
            pytest.fail(f"GPU_LAB_REQUIRE_BROWSER=1 but {reason}")
        pytest.skip(reason)
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=executable, args=["--no-sandbox"])  # root in CI
        yield browser
        browser.close()


@pytest.fixture(scope="module")
def screenshots(tmp_path_factory) -> Path:
    out = Path(os.environ.get("GPU_LAB_SCREENSHOTS") or tmp_path_factory.mktemp("screenshots"))
    out.mkdir(parents=True, exist_ok=True)
    return out
