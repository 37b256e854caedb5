"""Sizes checked before anything is allocated: the data, the model and a batch against the memory that is there.

A run whose data cannot fit would otherwise pass every check and fail in the allocator minutes later (or be
killed by the kernel's out-of-memory killer, leaving nothing). Each check refuses, with one line and exit 2,
when the bytes the run needs at least exceed the bytes available, and says what to change:

- synthetic data (from the config, before anything is made): float32 features and targets, held twice while
  the split is made, once per process of the node (DDP ranks each make their own);
- a data file (from its size or header, before it is read): a NumPy array as stored plus its float64
  conversion; a CSV's fields as text (estimated from its first lines) plus their float64 values;
- the model (its parameters, gradients and optimizer state, counted on the meta device: nothing allocated)
  and, on a GPU, a batch and the data when it is to be held there, against the GPU's free memory.

Available host memory is the kernel's MemAvailable, or less where a cgroup (a container, a SLURM job) limits
the process. Where it cannot be read, nothing is refused.
"""

import os
from pathlib import Path

import numpy as np

from experiments.config.errors import ConfigError
from experiments.config.topology import local_processes

FLOAT32 = 4
CSV_FIELD_OVERHEAD = 57  # bytes of a Python str (49) and its list slot (8), beside the field's own characters
CSV_SAMPLE_LINES = 1000  # lines read to estimate a CSV's row count and field length
CGROUP_V2 = ("memory.max", "memory.current")  # a cgroup's limit ("max": none) and its usage
CGROUP_V1 = ("memory.limit_in_bytes", "memory.usage_in_bytes")  # no limit: a number near 2**63


def _size(n: int) -> str:
    return f"{n:,} bytes ({n / 2**30:.1f} GiB)" if n >= 2**30 else f"{n:,} bytes ({n / 2**20:.1f} MiB)"


def _cgroup_room() -> int | None:
    """Bytes left under the tightest memory limit of this process's cgroups (v2, or v1's memory controller), its
    own or an ancestor's (a SLURM job sets the limit on the job, its steps run below it); None without a limit."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    base, rooms = Path("/sys/fs/cgroup"), []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2: the whole hierarchy at /sys/fs/cgroup, or beside v1 at unified/
            mount, files = (base if (base / "cgroup.controllers").exists() else base / "unified"), CGROUP_V2
        elif "memory" in controllers.split(","):
            mount, files = base / "memory", CGROUP_V1
        else:
            continue
        # From the process's own cgroup up to the mount's root (in a container the root is the container's).
        leaf = mount / path.lstrip("/")
        for group in [leaf, *leaf.parents[: len(leaf.parents) - len(mount.parents)]]:
            try:
                limit = group.joinpath(files[0]).read_text().strip()
                if limit != "max" and int(limit) < 2**60:
                    rooms.append(int(limit) - int(group.joinpath(files[1]).read_text()))
            except (OSError, ValueError):
                continue
    return min(rooms) if rooms else None


def host_available() -> int | None:
    """Bytes of host memory this process can still take: the kernel's MemAvailable, or less under a cgroup's
    limit; None when the system says neither. The one reader of it: every size check and batch.effective's
    budget (experiments.training.batch_fit)."""
    found = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    room = _cgroup_room()
    if room is not None:
        found.append(room)
    return min(found) if found else None


def _first_local_rank() -> bool:
    # Ranks > 0 of a node start once the first has made its data, which MemAvailable then counts: the first
    # rank vouches for the node's processes, and the others do not count themselves twice.
    return int(os.environ.get("LOCAL_RANK", 0)) == 0


def check_synthetic_memory(cfg) -> None:
    data = cfg.get("data")
    if not data or data.get("num_samples") is None or data.get("num_features") is None or not _first_local_rank():
        return
    available = host_available()
    if available is None:
        return
    samples, features, targets = data.num_samples, data.num_features, data.get("num_targets", 1)
    processes = local_processes(cfg)
    per_sample = 2 * FLOAT32 * (features + targets) + 16  # x and y twice while split, and the split's indices
    weights = FLOAT32 * features * targets  # the true weights the targets are drawn from
    needed = (samples * per_sample + weights) * processes
    if needed <= available:
        return
    each = f", x {processes} processes (trainer.devices)" if processes > 1 else ""
    fits = (available // processes - weights) // per_sample
    if fits >= 1:
        allowed = f"fewer samples or features, e.g. data.num_samples={_round_down(fits)} data.num_features={features}"
    else:  # the weights alone do not fit
        allowed = f"fewer features or targets (data.num_features={features} x model.out_features={targets})"
    raise ConfigError(
        f"data.num_samples={samples} data.num_features={features}: the synthetic data needs at least "
        f"{_size(needed)} of host memory (float32 features and targets, twice while the split is made, and "
        f"{features} x {targets} true weights{each}) and {_size(available)} are available; allowed: {allowed}"
    )


def _round_down(n: int) -> int:
    """`n` cut to two significant digits: a number a user would type."""
    if n < 100:
        return max(int(n), 1)
    scale = 10 ** (len(str(int(n))) - 2)
    return int(n) // scale * scale


def file_needs(path: Path) -> tuple[int, str] | None:
    """(bytes at least needed to read `path` into a table, how that was counted); None when it cannot tell."""
    suffix = path.suffix.lower()
    try:
        if suffix == ".npy":
            with path.open("rb") as f:
                shape, dtype = _npy_header(f)
            return int(np.prod(shape)) * (dtype.itemsize + 8), f"a {'x'.join(map(str, shape))} {dtype} array"
        if suffix == ".npz":
            import zipfile

            total, shapes = 0, []
            with zipfile.ZipFile(path) as archive:
                for name in archive.namelist():
                    with archive.open(name) as f:
                        shape, dtype = _npy_header(f)
                    total += int(np.prod(shape)) * (dtype.itemsize + 8 + 8)  # as stored, float64, stacked
                    shapes.append(f"{name.removesuffix('.npy')} {'x'.join(map(str, shape))}")
            return total, f"arrays {', '.join(shapes)}"
        if suffix == ".csv":
            return _csv_needs(path)
    except (OSError, ValueError, KeyError, EOFError):
        return None  # a damaged file: read_table says what is wrong with it
    return None


def _npy_header(f) -> tuple[tuple[int, ...], np.dtype]:
    version = np.lib.format.read_magic(f)
    if version == (1, 0):
        shape, _, dtype = np.lib.format.read_array_header_1_0(f)
    else:
        shape, _, dtype = np.lib.format.read_array_header_2_0(f)
    return shape, dtype


def _csv_needs(path: Path) -> tuple[int, str] | None:
    size = path.stat().st_size
    with path.open("rb") as f:
        header = f.readline()
        lines = [f.readline() for _ in range(CSV_SAMPLE_LINES)]
    lines = [line for line in lines if line.strip()]
    if not lines:
        return None
    width = header.count(b",") + 1
    sampled = sum(len(line) for line in lines)
    rows = int((size - len(header)) / (sampled / len(lines)))
    field = sampled / (len(lines) * width)  # characters of a field, its separator included
    needed = int(rows * width * (CSV_FIELD_OVERHEAD + field + 8))  # text, then float64 values
    return needed, f"about {rows:,} rows x {width} columns of text"


def check_file_memory(path: Path) -> None:
    """Refuse a data file that cannot be read into memory here (data.path), before reading it."""
    if not _first_local_rank():
        return
    needs, available = file_needs(Path(path)), host_available()
    if needs is None or available is None or needs[0] <= available:
        return
    raise ConfigError(
        f"data.path={path}: reading it needs at least {_size(needs[0])} of host memory ({needs[1]}, and its "
        f"values as float64) and {_size(available)} are available; allowed: a smaller file (fewer rows, or "
        "only the columns used), or a machine with more memory"
    )


def model_bytes(model_cfg, in_features: int, optimizer_cfg) -> int:
    """Bytes of the model's parameters, gradients and optimizer state, counted without allocating them."""
    import torch
    from hydra.utils import instantiate

    with torch.device("meta"):
        net = instantiate(model_cfg, in_features=in_features)
    params = sum(p.numel() * p.element_size() for p in net.parameters())
    target = str(optimizer_cfg.get("_target_", "")) if optimizer_cfg else ""
    states = 2 if target.endswith("Adam") or target.endswith("AdamW") else int(bool(optimizer_cfg.get("momentum")))
    return params * (2 + states)


def check_model_memory(cfg, in_features: int, device) -> None:
    """The model (parameters, gradients, optimizer state) against the memory of where it goes."""
    needed = model_bytes(cfg.model, in_features, cfg.optimizer)
    available = device_free(device) if device.type == "cuda" else host_available()
    if available is None or needed <= available:
        return
    where = f"{device}'s free memory" if device.type == "cuda" else "host memory"
    hidden = cfg.model.get("hidden")
    outputs = cfg.model.get("out_features")
    setting = f"model.hidden={list(hidden)}" if hidden is not None else f"model.out_features={outputs}"
    smaller = "fewer or narrower hidden layers" if hidden is not None else "fewer features or outputs"
    raise ConfigError(
        f"{setting} with {in_features} input features: the model needs at least {_size(needed)} (parameters, "
        f"gradients and optimizer state) and {_size(available)} of {where} are available; allowed: {smaller}"
    )


def device_free(device) -> int | None:
    import torch

    try:
        return torch.cuda.mem_get_info(device)[0]
    except (RuntimeError, AssertionError):
        return None


def check_run_memory(cfg, device, num_features: int, num_targets: int, samples: int, ranks: int) -> None:
    """The model against the memory where it goes and, on a GPU, a batch (its inputs, outputs and their gradients)
    and the data when it is to be held there (the data on the host was checked before it was made or read)."""
    check_model_memory(cfg, num_features, device)
    per_sample = FLOAT32 * (num_features + num_targets)
    batch_bytes = 3 * per_sample * cfg.data.batch_size // max(ranks, 1)
    check_device_memory(cfg, device, per_sample * samples if cfg.data.get("on_device") is True else None, batch_bytes)


def check_device_memory(cfg, device, data_bytes: int | None, batch_bytes: int) -> None:
    """On a GPU: a batch (and the data, when it is to be held there) against its free memory."""
    if device.type != "cuda":
        return
    free = device_free(device)
    if free is None:
        return
    if data_bytes is not None and data_bytes + batch_bytes > free:
        raise ConfigError(
            f"data.on_device={cfg.data.on_device}: the data needs {_size(data_bytes)} on {device} and "
            f"{_size(free)} are free there; allowed: data.on_device=auto or false (batches are then copied from "
            "the host), or less data"
        )
    if batch_bytes > free:
        smaller = max(cfg.data.batch_size // 2, 1)
        raise ConfigError(
            f"data.batch_size={cfg.data.batch_size}: a batch needs about {_size(batch_bytes)} on {device} and "
            f"{_size(free)} are free there; allowed: a smaller batch, e.g. data.batch_size={smaller} "
            f"trainer.accumulate_grad_batches={2 * cfg.trainer.accumulate_grad_batches}, which keeps the "
            "effective batch"
        )
