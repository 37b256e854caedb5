"""Regression data held in memory and fed as whole batches.

`data.batch_size` is the GLOBAL batch of one micro-step. Each of W ranks keeps a contiguous 1/W share of
every global batch, and the order of an epoch depends on the seed and the epoch alone, so changing the
device count or the strategy changes the speed, never the maths.
"""

import csv
from functools import cached_property
from pathlib import Path

import lightning as L
import numpy as np
import torch

from experiments.checks import ConfigError
from experiments.perf import TransferClock


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
    ):
        self.x, self.y = x, y
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
        start = self.resume_at[1] if self.resume_at and self.resume_at[0] == self.sampler.epoch else 0
        self.resume_at = None
        self.epoch, self.batches = self.sampler.epoch, start
        order = self.sampler.order().to(self.x.device)
        for i in range(start, len(self)):
            batch = order[i * self.batch_size : (i + 1) * self.batch_size]
            local = torch.tensor_split(batch, self.world_size)[self.rank]
            self.batches = i + 1
            yield self.x[local], self.y[local]


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

    def __init__(self, batch_size: int, val_fraction: float, seed: int, standardize: bool, on_device: bool | str):
        super().__init__()
        if on_device not in ("auto", True, False):
            raise ConfigError(f"data.on_device={on_device}: allowed: auto, true, false")
        self.on_device = on_device
        self.batch_size = batch_size
        self.val_fraction = val_fraction
        self.seed = seed
        self.standardize = standardize
        self.x_train = self.y_train = self.x_val = self.y_val = None
        self.transfer_clock = TransferClock()  # host-to-device copies of batches, read by PerfMonitor

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
        if len(self.x_train) < self.batch_size:
            raise ConfigError(
                f"data.batch_size={self.batch_size} is larger than the training split "
                f"({len(self.x_train)} samples); allowed: 1 to {len(self.x_train)}"
            )

    # Computed when first read (for metrics.json, after training), not in `setup`: the solve takes seconds
    # at d=1000 and would delay the first step.
    @cached_property
    def optimum(self) -> tuple[torch.Tensor, torch.Tensor]:
        return least_squares(self.x_train, self.y_train)

    @cached_property
    def optimal_val_mse(self) -> float:
        w, b = self.optimum
        return torch.mean((self.x_val.cpu().double() @ w + b - self.y_val.cpu().double()) ** 2).item()

    @property
    def num_features(self) -> int:
        return self.x_train.shape[1]

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
    ):
        super().__init__(batch_size, val_fraction, seed, standardize=False, on_device=on_device)
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
    """Features and one target read from a CSV with a header, a `.npy` matrix or a `.npz` archive.

    CSV: `target` names the target column (default: the last). `.npy`: a 2-D array, `target` is a column
    index (default: the last). `.npz`: arrays `x` and `y`, or a single 2-D array treated like `.npy`.
    Features are standardized with training-split statistics; the module keeps them in its checkpoint.
    """

    def __init__(
        self,
        path: str,
        target: str | int | None = None,
        val_fraction: float = 0.2,
        batch_size: int = 256,
        standardize: bool = True,
        seed: int = 0,
        on_device: bool | str = "auto",
    ):
        super().__init__(batch_size, val_fraction, seed, standardize, on_device)
        self.path = Path(path)
        self.target = target

    def _fail(self, problem: str) -> ConfigError:
        return ConfigError(f"data.path={self.path}: {problem}")

    def load(self) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.path.is_file():
            raise self._fail("no such file")
        suffix = self.path.suffix.lower()
        if suffix == ".csv":
            table, columns = self._read_csv()
        elif suffix in (".npy", ".npz"):
            table, columns = self._read_numpy(), None
        else:
            raise self._fail(f"unsupported file type {suffix!r}; allowed: .csv, .npy, .npz")
        if isinstance(table, dict):  # an .npz archive with arrays x and y
            x, y = table["x"], table["y"].reshape(len(table["y"]), -1)
            if x.ndim != 2 or len(x) != len(y):
                raise self._fail(f"arrays x {x.shape} and y {y.shape} do not form a dataset")
        else:
            if table.ndim != 2 or table.shape[1] < 2:
                raise self._fail(f"expected a table of at least 2 columns, found shape {table.shape}")
            column = self._target_column(columns, table.shape[1])
            x, y = np.delete(table, column, axis=1), table[:, [column]]
        if len(x) == 0:
            raise self._fail("no data rows")
        finite = np.isfinite(x).all(axis=1) & np.isfinite(y).all(axis=1)
        if not finite.all():
            raise self._fail(f"missing or non-finite value in data row {int(np.argmin(finite)) + 1}")
        return torch.from_numpy(x).float(), torch.from_numpy(y).float()

    def _read_csv(self) -> tuple[np.ndarray, list[str]]:
        # The csv module rather than np.loadtxt: its errors count rows from 0 after the header and do
        # not name the column, and a user fixing a file needs the line and the column.
        with self.path.open(newline="") as f:
            reader = csv.reader(f)
            columns = [c.strip() for c in next(reader, [])]
            if not columns:
                raise self._fail("empty file; expected a header row of column names")
            rows = []
            for row in reader:
                if not row:
                    continue
                line = reader.line_num
                if len(row) != len(columns):
                    raise self._fail(f"line {line} has {len(row)} fields but the header names {len(columns)}")
                try:
                    rows.append([float(v) for v in row])
                except ValueError:
                    name, value = next((n, v.strip()) for n, v in zip(columns, row, strict=True) if not _is_number(v))
                    problem = f"{value!r} is not a number" if value else "missing value"
                    raise self._fail(f"line {line}, column {name!r}: {problem}") from None
        if not rows:
            raise self._fail("no data rows")
        return np.array(rows, dtype=np.float64), columns

    def _read_numpy(self) -> np.ndarray | dict[str, np.ndarray]:
        try:
            loaded = np.load(self.path, allow_pickle=False)
        except (ValueError, OSError) as err:
            raise self._fail(f"not a readable NumPy file ({err})") from None
        if isinstance(loaded, np.lib.npyio.NpzFile):
            arrays = {k: loaded[k] for k in loaded.files}
            if len(arrays) == 1:
                loaded = next(iter(arrays.values()))
            elif arrays.keys() == {"x", "y"}:
                loaded = arrays
            else:
                raise self._fail(f"expected arrays 'x' and 'y' or a single table, found {sorted(arrays)}")
        for array in loaded.values() if isinstance(loaded, dict) else [loaded]:
            if not np.issubdtype(array.dtype, np.number):
                raise self._fail(f"holds {array.dtype} values, not numbers")
        if isinstance(loaded, dict):
            return {k: v.astype(np.float64) for k, v in loaded.items()}
        return loaded.astype(np.float64)

    def _target_column(self, columns: list[str] | None, width: int) -> int:
        if self.target is None:
            return width - 1
        if columns is not None and str(self.target) in columns:
            return columns.index(str(self.target))
        if isinstance(self.target, int) and -width <= self.target < width:
            return self.target % width
        allowed = ", ".join(columns) if columns else f"a column index from 0 to {width - 1}"
        raise ConfigError(f"data.target={self.target}: no such column in {self.path}; allowed: {allowed}")


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True
