"""Regression data held in memory and fed as whole batches.

`data.batch_size` is the GLOBAL batch of one micro-step. Each of W ranks keeps a contiguous 1/W share of
every global batch, and the order of an epoch depends on the seed and the epoch alone, so changing the
device count or the strategy changes the speed, never the maths.
"""

import csv
import os
import threading
import time
from concurrent.futures import Future
from functools import cached_property
from pathlib import Path

import lightning as L
import numpy as np
import torch

from experiments.checks import ConfigError
from experiments.perf import BatchClock, TransferClock


class EpochShuffle:
    """The sample order of one epoch: a permutation drawn from (seed, epoch) only.

    Lightning calls `set_epoch` on a loader's `sampler` before every epoch (fabric's `_set_sampler_epoch`).
    """

    def __init__(self, num_samples: int, seed: int, shuffle: bool = True):
        self.num_samples = num_samples
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def order(self) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(self.num_samples)
        seed = np.random.SeedSequence([self.seed, self.epoch]).generate_state(1)[0]
        generator = torch.Generator().manual_seed(int(seed))
        return torch.randperm(self.num_samples, generator=generator)


class BatchLoader:
    """Yields `(x, y)` batches sliced whole from in-memory tensors.

    Hand-written because `DataLoader(TensorDataset)` collates sample by sample, which costs far more than
    the step itself for a model this small (design.md, known traps). Indexing with one index tensor per
    batch is a single gather, on the device when the tensors live there.

    Training batches drop the incomplete last global batch so that every rank always holds an equal share;
    evaluation batches keep it and split it as evenly as it goes (torchmetrics sums over ranks exactly).

    `clock` (a BatchClock) adds up the host time spent forming batches. `pin_memory` gathers each batch
    straight into page-locked host memory, from which a copy to a GPU is a DMA that need not block the host
    (`non_blocking`); the batches come from PyTorch's caching host allocator, which hands a block out again only
    once the copies that read it have completed.
    """

    batch_sampler = None  # Lightning treats an object with a `sampler` like a DataLoader and reads this

    def __init__(
        self,
        x: torch.Tensor,
        y: torch.Tensor,
        batch_size: int,
        sampler: EpochShuffle,
        rank: int = 0,
        world_size: int = 1,
        drop_last: bool = True,
        clock: BatchClock | None = None,
        pin_memory: bool = False,
    ):
        self.x, self.y = x, y
        self.clock = clock or BatchClock()
        self.pin_memory = pin_memory
        self.batch_size = batch_size
        self.sampler = sampler
        self.rank, self.world_size = rank, world_size
        self.drop_last = drop_last
        self.epoch, self.batches = sampler.epoch, 0  # the position: batches handed out in this epoch
        self.resume_at: tuple[int, int] | None = None

    def __len__(self) -> int:
        n = len(self.x)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def state_dict(self) -> dict[str, int]:
        # Lightning keeps this in its checkpoints and hands it back on resume, so that an epoch interrupted
        # half-way goes on from the next batch. Batches handed out are batches the loop has taken: Lightning
        # prefetches nothing from a loader that has a length (`_PrefetchDataFetcher.__iter__`).
        return {"epoch": self.epoch, "batches": self.batches}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.resume_at = (state["epoch"], state["batches"])

    def __iter__(self):
        # The body runs at the first batch, after Lightning has called `sampler.set_epoch`: a saved position
        # applies only to the epoch it was saved in (a checkpoint at an epoch's end starts the next one whole).
        began = time.perf_counter()
        start = self.resume_at[1] if self.resume_at and self.resume_at[0] == self.sampler.epoch else 0
        self.resume_at = None
        self.epoch, self.batches = self.sampler.epoch, start
        order = self.sampler.order().to(self.x.device)
        for i in range(start, len(self)):
            batch = order[i * self.batch_size : (i + 1) * self.batch_size]
            local = torch.tensor_split(batch, self.world_size)[self.rank]
            self.batches = i + 1
            xb, yb = (
                (self._pinned(t, local) for t in (self.x, self.y))
                if self.pin_memory
                else (self.x[local], self.y[local])
            )
            self.clock.seconds += time.perf_counter() - began
            yield xb, yb
            began = time.perf_counter()

    @staticmethod
    def _pinned(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        out = torch.empty((len(index), *t.shape[1:]), dtype=t.dtype, pin_memory=True)
        return torch.index_select(t, 0, index, out=out)


def least_squares(x: torch.Tensor, y: torch.Tensor, block_rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact minimum-norm least-squares fit `y ~ x @ w + b`, in float64 on the CPU: returns (w, b).

    Computed a block of rows at a time (TSQR): the R factor of [x 1 y] is updated block by block, so the
    float64 working set is a few blocks of about 16 MB (about 100 MB at d=1000), where a float64 copy of
    the whole design matrix would double a run's peak memory. R[:, :d+1] has the singular values of [x 1],
    so the SVD-based solve on R, with the cut-off that LAPACK would use on the full matrix, gives the same
    minimum-norm answer.
    """
    n, d = x.shape
    block_rows = block_rows or max(2 * (d + 2), 2**21 // (d + 2))  # 16 MB of float64, or twice R's rows
    r = torch.zeros(0, d + 1 + y.shape[1], dtype=torch.float64)
    for xb, yb in zip(x.split(block_rows), y.split(block_rows), strict=True):
        ones = torch.ones(len(xb), 1, dtype=torch.float64)
        block = torch.cat([xb.to("cpu", torch.float64), ones, yb.to("cpu", torch.float64)], dim=1)
        r = torch.linalg.qr(torch.cat([r, block]), mode="r").R
    cutoff = torch.finfo(torch.float64).eps * max(n, d + 1)
    solution = torch.linalg.lstsq(r[:, : d + 1], r[:, d + 1 :], rcond=cutoff, driver="gelsd").solution
    return solution[:-1], solution[-1]


# data.on_device=auto keeps the data on a GPU when it takes at most this share of the GPU's memory; the rest
# is left for the model, its gradients and optimizer state, and the batches sliced from the data.
DEVICE_MEMORY_SHARE = 0.5


def keep_on_device(setting: bool | str, device: torch.device, nbytes: int) -> bool:
    """What `data.on_device` (auto, true, false) decides for `nbytes` of data on `device`.

    False on the CPU, whatever the setting: the data is there already.
    """
    if device.type == "cpu":
        return False
    if setting != "auto":
        return setting
    if device.type != "cuda":
        return False
    return nbytes <= DEVICE_MEMORY_SHARE * torch.cuda.get_device_properties(device).total_memory


class RegressionData(L.LightningDataModule):
    """Shared by every data source: split, standardize, batch and shard, and the reference optimum.

    Subclasses implement `load()`, returning all features and targets as float32 tensors.
    """

    def __init__(
        self,
        batch_size: int,
        val_fraction: float,
        seed: int,
        standardize: bool,
        on_device: bool | str,
        pin_memory: bool | str = "auto",
    ):
        super().__init__()
        for name, value in (("on_device", on_device), ("pin_memory", pin_memory)):
            if value not in ("auto", True, False):
                raise ConfigError(f"data.{name}={value}: allowed: auto, true, false")
        self.on_device = on_device
        self.pin_memory = pin_memory
        self.batch_size = batch_size
        self.val_fraction = val_fraction
        self.seed = seed
        self.standardize = standardize
        self.x_train = self.y_train = self.x_val = self.y_val = None
        # A CSV's column names, which the checkpoint keeps so that predict.py matches columns by name; None
        # for data without names (synthetic, NumPy).
        self.feature_names: list[str] | None = None
        self.target_name: str | None = None
        self.transfer_clock = TransferClock()  # host-to-device copies of batches, read by PerfMonitor
        self.batch_clock = BatchClock()  # forming the training batches, read by PerfMonitor

    def load(self) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def setup(self, stage: str | None = None) -> None:
        if self.x_train is not None:  # called again by the Trainer after train.py has looked at the data
            return
        x, y = self.load()
        num_val = round(len(x) * self.val_fraction)
        # The split is fixed by the seed, so every run of a sweep validates on the same samples.
        order = torch.randperm(len(x), generator=torch.Generator().manual_seed(self.seed))
        train, val = order[num_val:], order[:num_val]
        self.x_train, self.y_train = x[train], y[train]
        # With no held-out share (the seed's examples), the fit is measured on the training split.
        self.x_val, self.y_val = (x[val], y[val]) if num_val else (self.x_train, self.y_train)
        self.feature_mean = torch.zeros(x.shape[1])
        self.feature_std = torch.ones(x.shape[1])
        if self.standardize:
            self.feature_mean = self.x_train.mean(0)
            # A constant column keeps scale 1 rather than dividing by zero.
            std = self.x_train.std(0)
            self.feature_std = torch.where(std > 0, std, torch.ones(()))
            self.x_train = (self.x_train - self.feature_mean) / self.feature_std
            self.x_val = (self.x_val - self.feature_mean) / self.feature_std

    def solve_optimum_in_background(self) -> None:
        """Start solving `optimum` in a thread, so that validations during training can compare with it
        (time to target) without delaying the first step.

        Why a thread rather than accumulating the TSQR factor over the training batches: the QR update of a
        batch costs (B + d) d^2 flops, far more than the step of a linear model (2 B d). The solve is the same
        blockwise one as after training (least_squares: a float64 working set of a few 16 MB blocks, against
        the 2 x dataset peak of `setup`, which is over by now), and LAPACK releases the GIL. The thread runs at
        the lowest priority (nice 19, inherited by its intra-op threads on Linux) so that on a machine with
        few cores the training steps get them first; the cost in step time is measured in docs/benchmarks.md.
        The tensors are held until it ends, even if the data then moves to a GPU (host memory, a few seconds).
        """
        if "optimum" in self.__dict__ or getattr(self, "_optimum_future", None) is not None:
            return
        future, x, y = Future(), self.x_train, self.y_train

        def solve() -> None:
            try:
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)  # this thread only (Linux)
            except (AttributeError, OSError):
                pass
            try:
                future.set_result(least_squares(x, y))
            except BaseException as err:  # handed to whoever reads `optimum`
                future.set_exception(err)

        self._optimum_future = future
        threading.Thread(target=solve, name="least-squares", daemon=True).start()

    # Solved when first read (for metrics.json, after training) unless `solve_optimum_in_background` started
    # it: never in `setup`, where the solve (seconds at d=1000) would delay the first step.
    @cached_property
    def optimum(self) -> tuple[torch.Tensor, torch.Tensor]:
        future = getattr(self, "_optimum_future", None)
        return future.result() if future is not None else least_squares(self.x_train, self.y_train)

    @cached_property
    def optimal_val_mse(self) -> float:
        w, b = self.optimum
        return torch.mean((self.x_val.cpu().double() @ w + b - self.y_val.cpu().double()) ** 2).item()

    @property
    def num_features(self) -> int:
        return self.x_train.shape[1]

    @property
    def pins_batches(self) -> bool:
        """Whether batches are gathered into pinned memory: `pin_memory` (auto or true; false: pageable) applies
        to host-resident data copied to a CUDA GPU, the one case where the copy can use it."""
        device = self.trainer.strategy.root_device if self.trainer else torch.device("cpu")
        return self.pin_memory is not False and device.type == "cuda" and self.x_train.device.type == "cpu"

    def _loader(self, x: torch.Tensor, y: torch.Tensor, shuffle: bool) -> BatchLoader:
        trainer = self.trainer
        return BatchLoader(
            x,
            y,
            self.batch_size,
            EpochShuffle(len(x), self.seed, shuffle=shuffle),
            rank=trainer.global_rank if trainer else 0,
            world_size=trainer.world_size if trainer else 1,
            drop_last=shuffle,
            clock=self.batch_clock if shuffle else None,  # training batches only: validation is left out
            pin_memory=self.pins_batches,
        )

    def _place_on_device(self) -> None:
        """Move the splits to the accelerator once, if `on_device` says so: batches are then sliced there."""
        device = self.trainer.strategy.root_device if self.trainer else torch.device("cpu")
        tensors = {id(t): t for t in (self.x_train, self.y_train, self.x_val, self.y_val)}  # val may be train
        if self.x_train.device == device or not keep_on_device(
            self.on_device, device, sum(t.nbytes for t in tensors.values())
        ):
            return
        moved = {key: t.to(device) for key, t in tensors.items()}
        for name in ("x_train", "y_train", "x_val", "y_val"):
            setattr(self, name, moved[id(getattr(self, name))])

    def transfer_batch_to_device(self, batch, device: torch.device, dataloader_idx: int):
        # Here rather than in the module: the data decides where it lives (`on_device`), and Lightning warns
        # when a module overrides this hook while a DataModule is in use.
        if batch[0].device == device:  # device-resident data, or the CPU: nothing to copy
            return batch
        # Lightning copies with non_blocking=True to CUDA (fabric's `move_data_to_device`): from pinned batches
        # the copy is queued and the host goes on; from pageable ones CUDA stages it and the host waits.
        with self.transfer_clock.timing(device):
            return super().transfer_batch_to_device(batch, device, dataloader_idx)

    def train_dataloader(self) -> BatchLoader:
        self._place_on_device()
        # trainer.overfit_batches: the same first batches every epoch. Lightning turns shuffling off only in a
        # DataLoader (it warns that it does so for this loader too: here it is done).
        overfit = bool(self.trainer and self.trainer.overfit_batches)
        return self._loader(self.x_train, self.y_train, shuffle=not overfit)

    def val_dataloader(self) -> BatchLoader:
        self._place_on_device()
        return self._loader(self.x_val, self.y_val, shuffle=False)


class SyntheticRegression(RegressionData):
    """`y = X w* + b* + noise` with X ~ N(0, 1) and known true weights, all drawn from the seed."""

    def __init__(
        self,
        num_samples: int = 40960,
        num_features: int = 100,
        num_targets: int = 1,
        noise_std: float = 0.1,
        val_fraction: float = 0.2,
        batch_size: int = 256,
        seed: int = 0,
        on_device: bool | str = "auto",
        pin_memory: bool | str = "auto",
    ):
        super().__init__(batch_size, val_fraction, seed, standardize=False, on_device=on_device, pin_memory=pin_memory)
        self.num_samples = num_samples
        self.features = num_features
        self.num_targets = num_targets
        self.noise_std = noise_std

    def load(self) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(self.seed)
        x = torch.randn(self.num_samples, self.features, generator=generator)
        # Unit-variance signal whatever the width: w* ~ N(0, 1/d).
        self.true_weight = torch.randn(self.features, self.num_targets, generator=generator) / self.features**0.5
        self.true_bias = torch.randn(self.num_targets, generator=generator)
        noise = self.noise_std * torch.randn(self.num_samples, self.num_targets, generator=generator)
        return x, x @ self.true_weight + self.true_bias + noise


class FileRegression(RegressionData):
    """Features and a target read from a CSV with a header, a `.npy` matrix or a `.npz` archive (`read_table`).

    CSV: `target` names the target column (default: the last); `features` names the feature columns, in any
    order (default: every other column). `.npy`: a 2-D array, `target` is a column index (default: the
    last). `.npz`: arrays `x` and `y`, or a single 2-D array treated like `.npy`. Features are standardized
    with training-split statistics; the module keeps them in its checkpoint.
    """

    def __init__(
        self,
        path: str,
        target: str | int | None = None,
        features: list[str] | None = None,
        val_fraction: float = 0.2,
        batch_size: int = 256,
        standardize: bool = True,
        seed: int = 0,
        on_device: bool | str = "auto",
        pin_memory: bool | str = "auto",
    ):
        super().__init__(batch_size, val_fraction, seed, standardize, on_device, pin_memory)
        self.path = Path(path)
        self.target = target
        self.features = None if features is None else [str(name) for name in features]

    def load(self) -> tuple[torch.Tensor, torch.Tensor]:
        table = read_table(self.path)
        targets = self._target_columns(table)
        if self.features is None:
            features = [i for i in range(table.width) if i not in targets]
        else:
            features = table.find(self.features)
            if used := sorted(set(features) & set(targets)):
                raise ConfigError(
                    f"data.features={self.features}: {table.columns[used[0]]!r} is the target; allowed: other columns"
                )
        if not features:
            raise table.error(f"no feature columns besides the target; found shape ({table.num_rows}, {table.width})")
        if table.columns is not None:
            self.feature_names = [table.columns[i] for i in features]
            self.target_name = table.columns[targets[0]] if len(targets) == 1 else None
        return torch.from_numpy(table.numbers(features)).float(), torch.from_numpy(table.numbers(targets)).float()

    def _target_columns(self, table: "Table") -> list[int]:
        if self.target is None:
            return list(range(table.width - table.num_targets, table.width))
        if table.columns is not None and str(self.target) in table.columns:
            return [table.columns.index(str(self.target))]
        if isinstance(self.target, int) and -table.width <= self.target < table.width:
            return [self.target % table.width]
        allowed = ", ".join(table.columns) if table.columns else f"a column index from 0 to {table.width - 1}"
        raise ConfigError(f"data.target={self.target}: no such column in {self.path}; allowed: {allowed}")


FLOAT32_MAX = float(np.finfo(np.float32).max)


class Table:
    """A data file as read, before any column becomes a number: shared by training, eval.py and predict.py.

    A CSV keeps its header and its fields as text (columns that are not used may hold anything, e.g. an id,
    and predict.py carries them through unchanged); a NumPy file is a 2-D array with no column names.
    `numbers` converts the columns that are used and checks each value where the user can find it: the line
    and column name of a CSV, the row and column index of an array.
    """

    def __init__(self, path: Path, columns: list[str] | None, rows, lines: list[int] | None, num_targets: int = 1):
        self.path = path
        self.columns = columns  # None for a NumPy array
        self.rows = rows  # a CSV's fields (list of lists of text) or a 2-D array
        self.lines = lines  # the CSV line of each row
        self.num_targets = num_targets  # the last columns that are the target by default (an .npz's y)

    @property
    def num_rows(self) -> int:
        return len(self.rows)

    @property
    def width(self) -> int:
        return len(self.columns) if self.columns is not None else self.rows.shape[1]

    def error(self, problem: str) -> ConfigError:
        return ConfigError(f"data.path={self.path}: {problem}")

    def find(self, names: list[str]) -> list[int]:
        """The columns with these names, in the order of `names`; a missing one is named in the error."""
        if self.columns is None:
            raise self.error(f"has no column names; allowed: a CSV with a header holding {', '.join(names)}")
        missing = [name for name in names if name not in self.columns]
        if missing:
            raise self.error(
                f"no column {missing[0]!r}{f' (nor {len(missing) - 1} more)' if len(missing) > 1 else ''}; "
                f"allowed: a header that holds every feature column ({', '.join(names)}), in any order; "
                f"found: {', '.join(self.columns)}"
            )
        return [self.columns.index(name) for name in names]

    def numbers(self, columns: list[int]) -> np.ndarray:
        """These columns as a float64 array, every value a finite number within float32's range."""
        if self.columns is None:
            values = self.rows[:, columns].astype(np.float64)
        else:
            values = np.empty((self.num_rows, len(columns)))
            for i, row in enumerate(self.rows):
                try:
                    values[i] = [float(row[c]) for c in columns]
                except ValueError:
                    c = next(c for c in columns if not _is_number(row[c]))
                    text = row[c].strip()
                    raise self._at(i, c, f"{text!r} is not a number" if text else "missing value") from None
        # float32 is what the model computes in: a value beyond its range becomes infinite (and a NaN or an
        # infinity poisons every sum), so it is refused here, where the user can find it, rather than as a
        # traceback from the least-squares solve or a NaN loss.
        bad = ~np.isfinite(values) | (np.abs(values) > FLOAT32_MAX)
        if bad.any():
            i, j = np.argwhere(bad)[0]
            c = columns[j]
            text = self.rows[i][c].strip() if self.columns is not None else repr(float(values[i, j]))
            if np.isfinite(values[i, j]):
                problem = f"{text} does not fit in float32; allowed: finite numbers up to {FLOAT32_MAX:.8g} in size"
            else:
                problem = f"{text} is not a finite number; allowed: finite numbers up to {FLOAT32_MAX:.8g} in size"
            raise self._at(i, c, problem)
        return values

    def _at(self, row: int, column: int, problem: str) -> ConfigError:
        if self.columns is None:
            return self.error(f"row {row}, column {column}: {problem}")
        return self.error(f"line {self.lines[row]}, column {self.columns[column]!r}: {problem}")


def read_table(path: str | Path) -> Table:
    """Read a CSV with a header, a 2-D `.npy`, or an `.npz` (arrays x and y, or one 2-D array)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"data.path={path}: no such file")
    suffix = path.suffix.lower()
    if suffix == ".csv":
        table = _read_csv(path)
    elif suffix in (".npy", ".npz"):
        table = _read_numpy(path)
    else:
        raise ConfigError(f"data.path={path}: unsupported file type {suffix!r}; allowed: .csv, .npy, .npz")
    if table.num_rows == 0:
        raise table.error("no data rows")
    return table


def _read_csv(path: Path) -> Table:
    # The csv module rather than np.loadtxt: its errors count rows from 0 after the header and do not name
    # the column, and a user fixing a file needs the line and the column.
    with path.open(newline="") as f:
        reader = csv.reader(f)
        columns = [c.strip() for c in next(reader, [])]
        if not columns:
            raise ConfigError(f"data.path={path}: empty file; expected a header row of column names")
        if len(set(columns)) < len(columns):
            twice = next(c for c in columns if columns.count(c) > 1)
            raise ConfigError(f"data.path={path}: column {twice!r} appears twice in the header")
        rows, lines = [], []
        for row in reader:
            if not row:
                continue
            if len(row) != len(columns):
                raise ConfigError(
                    f"data.path={path}: line {reader.line_num} has {len(row)} fields but the header names "
                    f"{len(columns)}"
                )
            rows.append(row)
            lines.append(reader.line_num)
    return Table(path, columns, rows, lines)


def _read_numpy(path: Path) -> Table:
    try:
        loaded = np.load(path, allow_pickle=False)
    except (ValueError, OSError) as err:
        raise ConfigError(f"data.path={path}: not a readable NumPy file ({err})") from None
    num_targets = 1
    if isinstance(loaded, np.lib.npyio.NpzFile):
        arrays = {k: loaded[k] for k in loaded.files}
        if len(arrays) == 1:
            loaded = next(iter(arrays.values()))
        elif arrays.keys() == {"x", "y"}:
            x, y = arrays["x"], arrays["y"].reshape(len(arrays["y"]), -1)
            if x.ndim != 2 or len(x) != len(y):
                raise ConfigError(f"data.path={path}: arrays x {x.shape} and y {y.shape} do not form a dataset")
            if not (np.issubdtype(x.dtype, np.number) and np.issubdtype(y.dtype, np.number)):
                raise ConfigError(f"data.path={path}: holds {x.dtype} and {y.dtype} values, not numbers")
            loaded, num_targets = np.hstack([x.astype(np.float64), y.astype(np.float64)]), y.shape[1]
        else:
            found = sorted(arrays)
            raise ConfigError(f"data.path={path}: expected arrays 'x' and 'y' or a single table, found {found}")
    if not np.issubdtype(loaded.dtype, np.number):
        raise ConfigError(f"data.path={path}: holds {loaded.dtype} values, not numbers")
    if loaded.ndim != 2:
        raise ConfigError(f"data.path={path}: expected a 2-D table, found shape {loaded.shape}")
    return Table(path, None, loaded, None, num_targets)


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True
