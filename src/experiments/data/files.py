"""Regression data read from a file: a CSV with a header, a 2-D `.npy`, or an `.npz` (arrays x and y).

`Table` and `read_table` are shared by training, eval.py and predict.py.
"""

import csv
from pathlib import Path

import numpy as np
import torch

from experiments.config.errors import ConfigError
from experiments.config.sizes import check_file_memory
from experiments.data.datamodule import RegressionData


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
    check_file_memory(path)  # before reading: a file larger than memory fails in the allocator, or gets killed
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
