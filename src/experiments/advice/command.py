"""`python advise.py [train.py's overrides]`: the spine. Check and read the data as train.py would, time the user's
own command, then the options in order of what they can change (the layout of the same effective batch, precision,
the batch sweep, DDP, torch.compile), each while the budget lasts; then the verdicts, the table, advice.json and the
plot. `main(cfg)` is what advise.py runs (experiments.commands.entry) and what tests call."""

import math
import shutil
import sys
import time
from pathlib import Path

import torch
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from experiments.advice import plan, record, verdicts
from experiments.advice.trials import Measurement, measure_apart, measure_here
from experiments.config.checks import check_config
from experiments.config.errors import ConfigError
from experiments.distributed.cpu_cost import cores
from experiments.run.exits import RunFailed
from experiments.run.refused import remove_refused_start
from experiments.training.windows import WARMUP_BATCHES

APART_S = 15.0  # about what a DDP trial costs beyond its steps on this VM: two interpreters' imports, gloo's start
COMPILE_S = 15.0  # torch.compile's compilation of a small model on this VM's CPU, about


class Advice:
    """One advice run: the user's config, its budget and its trials, in the order they ran."""

    def __init__(self, cfg: DictConfig, run_dir: Path):
        self.knobs = cfg.advise
        self.base = OmegaConf.masked_copy(cfg, [k for k in cfg if k != "advise"])
        self.run_dir, self.trials = run_dir, run_dir / "trials"
        self.overrides = plan.user_overrides(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []
        self.started = time.perf_counter()
        self.seconds = max(0.1, self.knobs.budget_s / 300)  # a stretch: 0.3 s at the default budget
        self.measured: list[Measurement] = []
        self.notes: list[str] = []
        self.bar = tqdm(total=1, desc="advice", unit="trial", file=sys.stderr, leave=False, disable=None,
                        bar_format="{desc}: {n_fmt}/{total_fmt} trials |{bar}| {elapsed}")  # fmt: skip

    def expect(self, trials: int) -> None:
        self.bar.total += trials
        self.bar.refresh()

    def left(self) -> float:
        return self.knobs.budget_s - (time.perf_counter() - self.started)

    def run(self, option: plan.Option, extra: dict | None = None, max_steps: int | None = None) -> Measurement:
        self.bar.set_description(f"advice, {option.name}")
        run_dir = self.trials / str(len(self.measured))
        if option.apart:
            m = measure_apart(self.overrides, option, run_dir, self.seconds, self.knobs.repeats,
                              max_steps or 100, timeout_s=max(60.0, self.left() + 30))  # fmt: skip
        else:
            extra, steps = dict(extra or {}), None
            if max_steps:  # the same optimizer steps as another trial (their val_mse compare), cut in `repeats`
                extra.update({"trainer.max_steps": max_steps, "trainer.max_epochs": -1})
                micro_steps = max_steps * option.accumulate - WARMUP_BATCHES - option.accumulate
                steps = max(1, micro_steps // self.knobs.repeats)
            limit_s = max(3 * self.knobs.repeats * self.seconds, self.knobs.budget_s / 10)  # a far busier machine
            m = measure_here(self.base, option, run_dir, self.seconds, self.knobs.repeats, extra, limit_s, steps)
        self.measured.append(m)
        self.bar.update(1)
        if self.bar.disable:  # not a terminal (a log file, a pipe): a line a trial instead of a bar
            figure = m.error or f"{m.median:,.0f} samples/s"
            print(f"advice: {len(self.measured)} trials, {time.perf_counter() - self.started:.0f} s: {option.name}: "
                  f"{figure}", file=sys.stderr, flush=True)  # fmt: skip
        return m

    def skip(self, what: str, cost_s: float) -> bool:
        if self.left() >= cost_s:
            return False
        self.notes.append(f"{what}: the budget (advise.budget_s={self.knobs.budget_s}) had {max(self.left(), 0):.0f} s "
                          f"left, a trial takes about {cost_s:.0f} s")  # fmt: skip
        return True


def main(cfg: DictConfig) -> dict:
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    return advise(cfg, run_dir)


def advise(cfg: DictConfig, run_dir: Path) -> dict:
    """The advice for `cfg` (advise.yaml: train.py's config and `advise.*`), its trials under `run_dir`. A refusal
    (a bad setting, data that cannot be read, a model or a batch of the user's that does not fit) is one line and
    leaves nothing: not the trials, not Hydra's files."""
    advice = Advice(cfg, run_dir)
    try:
        check_config(advice.base)  # train.py's own checks of the settings together
        data = instantiate(advice.base.data)  # data that cannot be read: its one line, before any trial
        data.setup("fit")
        train_rows = len(data.x_train)
        del data
        with advice.bar:
            return _advise(advice, train_rows)
    except ConfigError:
        shutil.rmtree(advice.trials, ignore_errors=True)
        remove_refused_start(run_dir, f"{HydraConfig.get().job.name}.log" if HydraConfig.initialized() else "")
        raise


def _advise(a: Advice, train_rows: int) -> dict:
    knobs = a.knobs
    devices = a.base.trainer.devices
    own = plan.Option("your command", "yours", devices=1 if devices in (1, "1") else 2)  # 2: several, run apart
    apart_steps = WARMUP_BATCHES + 2 * (knobs.repeats + 1) * a.base.trainer.log_every_n_steps
    yours = a.run(own, max_steps=apart_steps if own.apart else None)
    if yours.error:  # the user's own command: a refusal is theirs to fix (a batch that does not fit), one line
        if yours.error.startswith("refused: "):
            raise ConfigError(yours.error.removeprefix("refused: "))
        raise RunFailed(f"your command did not train here: {yours.error}")
    run = yours.metrics
    setting = plan.Setting(
        micro=run["global_batch_size"], accumulate=run["effective_batch_size"] // run["global_batch_size"],
        devices=run.get("world_size") or 1, precision=str(a.base.trainer.precision), compile=bool(a.base.compile),
        accelerator=run.get("accelerator") or "cpu",
    )  # fmt: skip
    yours.option = plan.yours(setting)
    rate = yours.median
    trial_s = 1.0 + (WARMUP_BATCHES + knobs.repeats + 1) * a.seconds  # an in-process trial at the user's size

    counts, why = plan.device_counts(setting, cores(), torch.cuda.device_count())
    others = len(_placements(setting) + _other_accelerators(setting)) + len(counts) * knobs.ddp + 2  # 2: bf16, compile
    a.expect(len(plan.layouts(setting, train_rows)) + others
             + len(plan.sweep_sizes(setting, min(train_rows, knobs.max_batch or train_rows))))  # fmt: skip

    # 1. The same effective batch on one device: as one batch, and accumulated (what a micro-step costs).
    for option in plan.layouts(setting, train_rows):
        if not a.skip(option.name, trial_s):
            a.run(option)
    keeping = [m for m in a.measured if m.rates and m.option.keeps_result]
    best = max(keeping, key=lambda m: m.median if verdicts.apart(m, yours) else 0.0)
    best = best if verdicts.apart(best, yours) and best.median > yours.median else yours

    # 2. Precision and where the data is held, over the best layout's steps (their val_mse compare).
    bases = {}
    steps = best.metrics.get("global_step")
    bf16 = setting.accelerator == "cpu" or (torch.cuda.is_available() and torch.cuda.is_bf16_supported())
    for precision in plan.precisions(setting, bf16):
        option = plan.Option(precision, "precision", {**best.option.settings, "trainer.precision": precision},
                             best.option.micro, best.option.accumulate, best.option.devices)  # fmt: skip
        if not a.skip(option.name, 2 * trial_s):
            bases[option.name] = best
            a.run(option, max_steps=steps)
    for name, placement in _placements(setting) + _other_accelerators(setting):
        option = plan.Option(name, "placement", {**best.option.settings, **placement}, best.option.micro,
                             best.option.accumulate, best.option.devices)  # fmt: skip
        if not a.skip(option.name, trial_s):
            a.run(option)

    # 3. The batch sweep: one batch a step, one device (a batch other than E changes the result).
    largest = min(train_rows, knobs.max_batch or train_rows)
    sweep = {m.option.micro: m for m in a.measured if m.option.accumulate == 1 and m.option.devices == 1
             and m.option.knob in ("yours", "accumulation")}  # fmt: skip
    previous = rate
    reserve = (APART_S if knobs.ddp else 0) + (COMPILE_S if knobs.compile else 0) + trial_s
    for size in plan.sweep_sizes(setting, largest):
        if size in sweep:
            previous = max(previous, sweep[size].median or previous)
            continue
        step_s = size / previous
        log_every = max(1, min(int(a.base.trainer.log_every_n_steps), math.floor(a.seconds / step_s)))
        cost = 1.0 + (WARMUP_BATCHES + (knobs.repeats + 1) * log_every) * step_s
        if a.skip(f"B={size}", cost + reserve):
            break
        option = plan.layout(size, 1, 1, "batch", keeps=size == setting.effective)
        m = a.run(option, extra={"trainer.log_every_n_steps": log_every})
        sweep[size] = m
        if m.error:
            break  # memory refuses it: a larger batch would not fit either
        previous = max(previous, m.median)

    # 4. DDP over every device count the machine offers, at the effective batch as one micro-step.
    if why:
        a.notes.append(f"DDP: {why}")
    elif not knobs.ddp:
        a.notes.append("DDP: advise.ddp=false")
    reference = sweep.get(setting.effective, yours)
    for option in plan.ddp_options(setting, counts) if knobs.ddp else []:
        per_stretch = max(int(a.base.trainer.log_every_n_steps), math.ceil(a.seconds * reference.median / option.micro))
        max_steps = WARMUP_BATCHES + 2 * (knobs.repeats + 1) * per_stretch
        if not a.skip(option.name, APART_S + max_steps * option.micro / reference.median):
            a.run(option, max_steps=max_steps)

    # 5. torch.compile on the best so far (its compilation is warm-up, reported apart), over the same steps.
    candidates = [m for m in a.measured if m.option.knob not in ("batch",) or m.option.keeps_result]
    top = verdicts.recommend([m for m in candidates if m is not yours], yours, bases, knobs.tolerance)
    if knobs.compile and not setting.compile and not a.skip("compile=true", COMPILE_S + trial_s):
        option = plan.Option("compile=true", "compile", {**top.option.settings, "compile": True}, top.option.micro,
                             top.option.accumulate, top.option.devices)  # fmt: skip
        if not option.apart:
            bases[option.name] = top
            a.run(option, max_steps=top.metrics.get("global_step"))
    elif not knobs.compile:
        a.notes.append("compile: advise.compile=false")

    a.bar.total = a.bar.n
    return finish(a, setting, yours, bases, sweep)


def _placements(setting: plan.Setting) -> list[tuple[str, dict]]:
    """On a GPU, where the data is held: what a step's copy costs (the user's own `auto` holds it on the device when
    it takes at most half the GPU's memory)."""
    if setting.accelerator != "cuda":
        return []
    return [
        ("data on the GPU", {"data.on_device": True}),
        ("data in pinned host memory", {"data.on_device": False, "data.pin_memory": True}),
        ("data in pageable host memory", {"data.on_device": False, "data.pin_memory": False}),
    ]


def _other_accelerators(setting: plan.Setting) -> list[tuple[str, dict]]:
    """On a GPU, the host's CPU too (every accelerator present: the seed's first advice, a small model may not gain)."""
    return [("the CPU", {"trainer.accelerator": "cpu"})] if setting.accelerator == "cuda" else []


def finish(a: Advice, setting: plan.Setting, yours: Measurement, bases: dict, sweep: dict) -> dict:
    knobs = a.knobs
    measured = a.measured
    candidates = [m for m in a.measured if m.option.keeps_result and m is not yours]
    chosen = verdicts.recommend(candidates, yours, bases, knobs.tolerance)
    lines = _lines(a, setting, yours, bases, sweep)
    command = plan.command(a.overrides, chosen.option)
    speedup = verdicts.ratio(chosen, yours)
    exact = not {"trainer.precision", "compile"} & chosen.option.settings.keys()  # the same maths as yours
    tolerance = 1e-4 if exact else float(knobs.tolerance)
    said = f"within {100 * tolerance:g}% of your command's" + (" (the same maths)" if exact else "")
    print(record.table(measured, yours))
    print(record.advice_text(lines, a.notes, command, speedup, said))
    result = {
        "command": command,
        "speedup": speedup,
        "yours": plan.command(a.overrides, yours.option),
        "recommended": chosen.option.name,
        "samples_per_sec": {"yours": yours.median, "recommended": chosen.median},
        "val_mse_tolerance": tolerance,
        "verdicts": [[line.knob, line.text] for line in lines],
        "not_measured": a.notes,
        "setting": setting.__dict__,
        "stretch_s": a.seconds,
        "repeats": knobs.repeats,
        "budget_s": knobs.budget_s,
        "measuring_s": time.perf_counter() - a.started,
        "measurements": [m.record() for m in measured],
    }
    path = record.write_advice(a.run_dir, result)
    picture = record.plot(a.run_dir, measured, yours)
    print(f"\nadvice.json and the plot: {path}, {picture}")
    return result


def _lines(a: Advice, setting: plan.Setting, yours: Measurement, bases: dict, sweep: dict) -> list[verdicts.Line]:
    tol = a.knobs.tolerance
    lines = []
    if setting.accelerator == "cpu":
        gpu = "" if not torch.cuda.is_available() else " (a GPU is here: trainer.accelerator=gpu to advise on it)"
        lines.append(verdicts.Line("accelerators", f"CPU only: PyTorch sees no GPU used by this command{gpu}"))
        lines.append(verdicts.Line("transfer", f"none: on the CPU the data is where the model is (no copy a step; "
                                   f"forming a batch: {yours.metrics.get('data_ms') or 0:.3f} ms)"))  # fmt: skip
    layout_keep = f"data.batch_size={setting.micro} trainer.accumulate_grad_batches={setting.accumulate}"
    for m in a.measured:
        knob = m.option.knob
        if knob == "yours" or (knob == "batch" and not m.option.keeps_result):
            continue
        base = bases.get(m.option.name, sweep.get(m.option.micro) if knob == "devices" else yours)
        base = base if base is not None and base.rates else yours
        if knob == "precision":
            line = verdicts.knob_line(knob, m, base, f"trainer.precision={m.option.name}",
                                      f"trainer.precision={setting.precision}", tol)  # fmt: skip
        elif knob == "compile":
            line = verdicts.knob_line(knob, m, base, "compile=true", "compile=false", tol)
        elif knob == "devices":
            line = verdicts.knob_line(knob, m, base, f"trainer.devices={m.option.devices}", "trainer.devices=1", tol)
        elif knob == "placement" and m.option.name == "the CPU":
            line = verdicts.knob_line("accelerators", m, base, "trainer.accelerator=cpu", "the GPU", tol)
        elif knob == "placement":
            line = verdicts.knob_line(knob, m, base, " ".join(m.option.overrides()[-2:]), "data.on_device=auto", tol)
            line.text += f" (copy: {m.metrics.get('transfer_ms') or 0:.3f} ms a step)"
        else:
            line = verdicts.knob_line(knob, m, base, " ".join(m.option.overrides()[:2]), layout_keep, tol)
        lines.append(line)
    lines.append(verdicts.batch_line([sweep[s] for s in sorted(sweep)], yours))
    return lines
