"""One row of `python scripts/benchmark.py`'s table: the seed's loop as an expert writes it (`raw_loop`) against the
project's Lightning path (`project_run`), the same steps, side by side in one process.

raw: the seed's loop in plain PyTorch as an expert writes it, on the same data, batch, device and precision:
each epoch a `randperm`, batches gathered with `index_select` into two reused tensors, then zero_grad, forward,
`mse_loss`, backward, `SGD.step`; after each epoch the validation split's MSE, as the project validates (a pass
over 50 MB of validation data at d=1000 slows the next steps of either loop by about 5%: the caches it evicts).
project: `experiments.commands.train.train` on the real config, shrunk only by overrides: TensorBoard logging,
the progress bar (drawn into /dev/null), a validation each epoch, last.ckpt.

A path's step time is its steady state: the raw loop's (T(N) - T(N1)) / (N - N1) with N1 = N / 5 steps, the
project's own `step_time_ms` (PerfMonitor: after 5 warm-up steps, validation and last.ckpt's saves left out,
their cost printed on its own line), checked against the benchmark's own clock on the same run (`check_ms`: a
callback's marks from step N / 5 on, validation and saves taken out). The two paths run the same number of
steps, one after the other, in `--reps` interleaved repetitions (raw first, then the project first, ...). The
ratio is the median of the repetitions' paired ratios (a repetition's two sides ran back to back, on the same
machine's mood), printed with their range; each side's own figures are its minimum, the least disturbed by the
other work of a shared machine.
"""

import contextlib
import os
import statistics
import tempfile
import warnings
from pathlib import Path

import lightning
import torch
from hydra import compose, initialize_config_dir

from experiments import internals
from experiments.commands.entry import CONFIG_DIR
from experiments.commands.train import train
from experiments.training.clocks import synchronized_clock
from experiments.training.last_checkpoint import LastCheckpoint

TARGETS = {64: 1.10, 1024: 1.10}  # B: the project's step at most this times the raw loop's (CPU, fp32, d=1000)
FRAMEWORK_SHARE = {16384: 0.10}  # B: framework_ms at most this share of the project's step
AUTOCAST = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


def raw_loop(x, y, batch_size: int, steps: int, device: torch.device, precision: str, placement: str, val=None):
    """Milliseconds a step of the seed's loop, steady state: from step steps // 5 to the last.

    `val` (x, y): after every epoch the MSE of the validation split, in batches of `batch_size`, as the project
    validates; its time is left out, as the project's is.

    `x` and `y` are on the device (placement "device"), or on the host: pageable (each batch gathered into a
    reused host tensor, then copied into a reused device tensor) or pinned (two pinned tensors in turn, each
    reused once its copy is done, so that a copy overlaps the next gather).
    """
    torch.manual_seed(0)
    model = torch.nn.Linear(x.shape[1], y.shape[1]).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler(device.type) if precision == "16-mixed" else None
    autocast = torch.autocast(device.type, dtype=AUTOCAST[precision]) if precision in AUTOCAST else None
    pinned = placement == "pinned"
    shapes = [(batch_size, x.shape[1]), (batch_size, y.shape[1])]
    host = [tuple(torch.empty(shape, pin_memory=pinned) for shape in shapes) for _ in range(2 if pinned else 1)]
    copied = [None] * len(host)  # the event after each host pair's last copy (pinned)
    xb, yb = torch.empty(batch_size, x.shape[1], device=device), torch.empty(batch_size, y.shape[1], device=device)
    start, step = steps // 5, 0
    while True:
        order = torch.randperm(len(x), device=x.device)
        for i in range(len(x) // batch_size):
            index = order[i * batch_size : (i + 1) * batch_size]
            if x.device.type == torch.device(device).type:
                torch.index_select(x, 0, index, out=xb)
                torch.index_select(y, 0, index, out=yb)
            else:
                k = step % len(host)
                if copied[k] is not None:
                    copied[k].synchronize()
                hx, hy = host[k]
                torch.index_select(x, 0, index, out=hx)
                torch.index_select(y, 0, index, out=hy)
                xb.copy_(hx, non_blocking=pinned)
                yb.copy_(hy, non_blocking=pinned)
                if pinned:
                    copied[k] = torch.cuda.Event()
                    copied[k].record()
            optimizer.zero_grad()
            with autocast or contextlib.nullcontext():
                loss = torch.nn.functional.mse_loss(model(xb), yb)
            if scaler:
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
            else:
                loss.backward()
                optimizer.step()
            step += 1
            if step == start:
                began = synchronized_clock(device)
            if step == steps:
                return 1e3 * (synchronized_clock(device) - began) / (steps - start)
        if val is not None:
            validating = synchronized_clock(device)
            with torch.no_grad():
                mse = sum(torch.nn.functional.mse_loss(model(a), b, reduction="sum")
                          for a, b in zip(val[0].split(batch_size), val[1].split(batch_size), strict=True))  # fmt: skip
                mse.item()
            if step >= start:
                began += synchronized_clock(device) - validating


class StepClock(lightning.Callback):
    """The benchmark's own clock on the project's run: a mark at the end of every window of steps (where
    Lightning's hooks run, training.windows) and the time spent in validation and saving last.ckpt (the run's
    own count of it), for `check_ms`."""

    latest = None  # the clock of the latest run: the config builds it, the benchmark reads it

    def __init__(self):
        self.marks, self.validating, self.in_validation = [], None, 0.0
        StepClock.latest = self

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        processed = internals.micro_batches_done(trainer)[1]  # the window's micro-batches too
        saver = next(c for c in trainer.callbacks if isinstance(c, LastCheckpoint))
        paused = self.in_validation + saver.seconds_saving  # validation and last.ckpt's saves are not steps
        self.marks.append((synchronized_clock(pl_module.device), processed, paused))

    def on_validation_start(self, trainer, pl_module):
        self.validating = synchronized_clock(pl_module.device)

    def on_validation_end(self, trainer, pl_module):
        self.in_validation += synchronized_clock(pl_module.device) - self.validating

    def step_ms(self, steps: int) -> float:
        """Milliseconds a step from step steps // 5 to the last mark, validation and saves left out."""
        (t0, s0, v0) = next(m for m in self.marks if m[1] >= steps // 5)
        (t1, s1, v1) = self.marks[-1]
        return 1e3 * ((t1 - t0) - (v1 - v0)) / max(s1 - s0, 1)


CLOCK = f"{__name__}.StepClock"  # instantiated by the project's callbacks group (+callbacks.benchmark_clock)


def project_run(overrides: list[str], steps: int) -> tuple[dict, float]:
    """`experiments.commands.train.train` on the composed config: (its metrics, the outside clock's step ms)."""
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose("config", overrides=[*overrides, f"+callbacks.benchmark_clock._target_={CLOCK}"])
    with tempfile.TemporaryDirectory() as run_dir:
        # The progress bar draws as in a terminal, into /dev/null; Lightning's notices would bury the table.
        with open(os.devnull, "w") as null, contextlib.redirect_stdout(null), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            metrics = train(cfg, Path(run_dir))
    return metrics, StepClock.latest.step_ms(steps)


def choose_steps(x, y, batch_size: int, device: torch.device, args, placement: str) -> int:
    """Enough steps for about `--seconds` of the raw loop, at least `--min-steps`."""
    per_step = raw_loop(x, y, batch_size, 50, device, "32-true", placement) / 1e3
    return max(args.min_steps, round(args.seconds / per_step))


def measure(args, data, device: torch.device, placement: str, batch_size: int, precision: str) -> dict:
    """One row: `--reps` interleaved repetitions of the raw loop and the project: the median of their paired
    ratios, each side's minimum."""
    on_device = placement == "device" and device.type != "cpu"
    x, y = (data.x_train.to(device), data.y_train.to(device)) if on_device else (data.x_train, data.y_train)
    val = (data.x_val.to(device), data.y_val.to(device))  # the project validates on the device too
    steps = choose_steps(x, y, batch_size, device, args, placement)
    overrides = [
        f"data.num_samples={args.samples}",
        f"data.num_features={args.features}",
        f"data.batch_size={batch_size}",
        f"data.on_device={str(on_device).lower()}",
        f"data.pin_memory={str(placement == 'pinned').lower()}",
        f"trainer.accelerator={device.type}",
        f"trainer.precision={precision}",
        f"trainer.max_steps={steps}",
        "trainer.max_epochs=-1",
    ]
    raws, runs = [], []
    for rep in range(args.reps):
        for side in ("raw", "project") if rep % 2 == 0 else ("project", "raw"):
            if side == "raw":
                raws.append(raw_loop(x, y, batch_size, steps, device, precision, placement, val))
            else:
                runs.append(project_run(overrides, steps))
    raw = min(raws)
    metrics, check = min(runs, key=lambda run: run[0]["step_time_ms"])
    project = metrics["step_time_ms"]
    pairs = [m["step_time_ms"] / r for (m, _), r in zip(runs, raws, strict=True)]
    return {
        "device": device.type,
        "data": placement if device.type != "cpu" else "host",
        "precision": precision,
        "B": batch_size,
        "steps": steps,
        "raw_ms": raw,
        "project_ms": project,
        "ratio": statistics.median(pairs),
        "ratio_range": f"{min(pairs):.2f}-{max(pairs):.2f}",
        "check_ms": check,
        "raw_spread": max(raws) / raw,  # how much the repetitions of a side differed: the machine's noise
        "project_spread": max(m["step_time_ms"] for m, _ in runs) / project,
        "data_ms": metrics["data_ms"],
        "transfer_ms": metrics["transfer_ms"],
        "compute_ms": metrics["compute_ms"],
        "framework_ms": metrics["framework_ms"],
        "framework_pct": 100 * metrics["framework_ms"] / project,
    }


COLUMNS = [
    ("device", "{}"), ("data", "{}"), ("precision", "{}"), ("B", "{}"), ("steps", "{}"), ("raw_ms", "{:.3f}"),
    ("project_ms", "{:.3f}"), ("ratio", "{:.2f}"), ("ratio_range", "{}"), ("check_ms", "{:.3f}"),
    ("raw_spread", "{:.2f}"), ("project_spread", "{:.2f}"), ("data_ms", "{:.3f}"), ("transfer_ms", "{:.3f}"),
    ("compute_ms", "{:.3f}"), ("framework_ms", "{:.3f}"), ("framework_pct", "{:.1f}"),
]  # fmt: skip


def table(rows: list[dict]) -> list[str]:
    cells = [[name for name, _ in COLUMNS]] + [[fmt.format(row[name]) for name, fmt in COLUMNS] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(COLUMNS))]
    return ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in cells]


def verdicts(rows: list[dict]) -> list[str]:
    lines = []
    for row in rows:
        if row["device"] != "cpu" or row["precision"] != "32-true":
            continue
        if row["B"] in TARGETS:
            bound = TARGETS[row["B"]]
            verdict = "met" if row["ratio"] <= bound else "MISSED"
            lines.append(f"target B={row['B']}: project/raw {row['ratio']:.2f} (at most {bound}): {verdict}")
        if row["B"] in FRAMEWORK_SHARE:
            bound = FRAMEWORK_SHARE[row["B"]]
            verdict = "met" if row["framework_pct"] <= 100 * bound else "MISSED"
            lines.append(
                f"target B={row['B']}: framework_ms {row['framework_pct']:.1f}% of a step "
                f"(under {100 * bound:.0f}%): {verdict}"
            )
    return lines
