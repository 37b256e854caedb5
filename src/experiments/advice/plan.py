"""What the advice measures: each option is train.py's own command line, the user's overrides and a few more, so that
what is measured is what a user would run, and the recommended option is a command to type.

The user's run fixes the effective batch E (samples an optimizer step: micro-batch x accumulation, devices included);
an option that keeps E, the optimizer and the lr keeps the result (the maths is the same up to float rounding, or,
for a precision, within the advice's tolerance); one of another effective batch (the batch sweep) changes it and is
shown apart.
"""

import shlex
from dataclasses import dataclass, field

# The settings an option sets; a user's override of one of them gives way to the option's.
LAYOUT_KEYS = ("data.batch_size", "trainer.accumulate_grad_batches", "trainer.devices", "batch.effective")


@dataclass(frozen=True)
class Option:
    name: str  # what the table calls it: "your command", "B=1024 x1", "DDP x2", "bf16-mixed", ...
    knob: str  # yours, batch, accumulation, devices, precision, compile, placement
    settings: dict = field(default_factory=dict)  # train.py settings over the user's: {"data.batch_size": 1024}
    micro: int = 0  # the global batch of a micro-step
    accumulate: int = 1
    devices: int = 1
    keeps_result: bool = True  # the user's effective batch, optimizer and lr

    @property
    def effective(self) -> int:
        return self.micro * self.accumulate

    @property
    def apart(self) -> bool:
        """Run as a command of its own (several ranks: Lightning starts them from the command line)."""
        return self.devices > 1

    def overrides(self) -> list[str]:
        return [f"{key}={_text(value)}" for key, value in self.settings.items()]


@dataclass(frozen=True)
class Setting:
    """The user's run as it trains: from its own trial's metrics.json (batch.effective chooses its micro-batch)."""

    micro: int  # global batch of a micro-step
    accumulate: int
    devices: int
    precision: str
    compile: bool
    accelerator: str  # cpu, cuda, ...

    @property
    def effective(self) -> int:
        return self.micro * self.accumulate


def _text(value) -> str:
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def user_overrides(task_overrides, own: str = "advise.") -> list[str]:
    """The user's train.py overrides: advise.py's command line less its own `advise.*` settings."""
    return [o for o in task_overrides if not o.lstrip("+~").startswith(own)]


def command(overrides: list[str], option: Option) -> str:
    """`python train.py ...`: the user's overrides, those of the option's keys replaced, then the option's."""
    keys = set(option.settings)
    if {"data.batch_size", "trainer.accumulate_grad_batches"} & keys:
        keys.add("batch.effective")  # an explicit micro-batch and accumulation: batch.effective would choose again
    kept = [o for o in overrides if o.split("=", 1)[0].lstrip("+~") not in keys]
    settings = {**option.settings}
    if (
        "batch.effective" in keys
        and "batch.effective" not in settings
        and any(o.split("=", 1)[0].lstrip("+~") == "batch.effective" for o in overrides)
    ):
        settings["batch.effective"] = None
    added = [f"{key}={_text(value)}" for key, value in settings.items()]
    return shlex.join(["python", "train.py", *kept, *added])


def yours(setting: Setting) -> Option:
    return Option("your command", "yours", {}, setting.micro, setting.accumulate, setting.devices)


def layout(micro: int, accumulate: int, devices: int, knob: str, keeps: bool = True, name: str | None = None) -> Option:
    settings = {"data.batch_size": micro, "trainer.accumulate_grad_batches": accumulate, "trainer.devices": devices}
    name = name or (f"DDP x{devices}, B={micro}" if devices > 1 else f"B={micro} x{accumulate}")
    return Option(name, knob, settings, micro, accumulate, devices, keeps)


def layouts(setting: Setting, train_size: int) -> list[Option]:
    """One device, the same effective batch E: as one batch, and accumulated from halves and quarters (what
    accumulation costs a micro-step against one large batch of the same size)."""
    e, options = setting.effective, []
    for split in (1, 2, 4):
        if e % split == 0 and e // split <= train_size and (e // split, split, 1) != _own(setting):
            options.append(layout(e // split, split, 1, "accumulation"))
    return options


def device_counts(setting: Setting, cores: int, gpus: int) -> tuple[list[int], str | None]:
    """The device counts above one that the machine offers for DDP, and why there are none when there are none."""
    if setting.accelerator == "cuda":
        counts = list(range(2, gpus + 1))
        return counts, None if counts else "one GPU: no DDP to measure"
    if cores < 2:
        return [], (
            "this process may run on 1 core (os.sched_getaffinity): DDP's CPU processes would take turns on it, "
            "every step waiting for the other; not measured"
        )
    return list(range(2, cores + 1)), None


def ddp_options(setting: Setting, counts: list[int]) -> list[Option]:
    """DDP at the user's effective batch as one micro-step (where DDP's all-reduce weighs least)."""
    e = setting.effective
    return [layout(e, 1, d, "devices") for d in counts if e % d == 0 and (e, 1, d) != _own(setting)]


def precisions(setting: Setting, bf16: bool) -> list[str]:
    """The precisions the device has, other than the user's."""
    found = ["32-true"] + (["bf16-mixed"] if bf16 else []) + (["16-mixed"] if setting.accelerator == "cuda" else [])
    return [p for p in found if p != setting.precision]


def sweep_sizes(setting: Setting, largest: int) -> list[int]:
    """The batch sweep (one micro-step an optimizer step, one device): powers of two around E, up to `largest`."""
    e = setting.effective
    sizes = {max(1, e // 4), max(1, e // 2), e}
    size = e
    while size * 2 <= largest:
        size *= 2
        sizes.add(size)
    return sorted(s for s in sizes if s <= largest)


def _own(setting: Setting) -> tuple[int, int, int]:
    return setting.micro, setting.accumulate, setting.devices
