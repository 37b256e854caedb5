"""The config's rules for one setting at a time: `RULES` is data, each rule a setting, a test and what is allowed,
and every refusal has one form (`error: <setting>=<value> is not allowed; allowed: ...`). They need nothing but the
config: the commands check them as soon as Hydra has composed it, before torch and Lightning are imported
(experiments.commands.entry), so that a bad value is refused in well under a second, not after 5 s of imports;
the checks of several settings together follow in experiments.config.checks.
"""

import math

from omegaconf import DictConfig, ListConfig, OmegaConf

from experiments.config.errors import ConfigError
from experiments.models import ACTIVATIONS


def _integer(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _real(v) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def parse_devices(value) -> str | int | list:
    """`trainer.devices` as Lightning reads it: "auto", an int (-1: every device) or a list of device indices.

    Strings such as "2", "-1" and "0,1" go through Lightning's own parser; anything else raises ValueError.
    """
    if isinstance(value, ListConfig):
        return list(value)
    if isinstance(value, str) and value != "auto":
        from experiments import internals  # Lightning: imported when a string needs its parser

        return internals.parse_device_string(value)
    return value


def _devices(v) -> bool:
    try:
        v = parse_devices(v)
    except ValueError:
        return False
    if isinstance(v, list):
        return len(v) > 0 and all(_integer(i) and i >= 0 for i in v)
    return v == "auto" or (_integer(v) and (v >= 1 or v == -1))


def _widths(v) -> bool:
    return isinstance(v, ListConfig | list) and len(v) > 0 and all(_integer(w) and w >= 1 for w in v)


def _batches(v) -> bool:
    # Lightning's limit_*_batches and val_check_interval: a float is a fraction, an int a count.
    return v is None or (_integer(v) and v >= 0) or (isinstance(v, float) and 0 <= v <= 1)


def _precision(v) -> bool:
    from experiments import internals  # Lightning's list: its rule comes last, so the others answer before it loads

    return v in internals.precisions()


class _Precisions:
    """What `trainer.precision` allows, as text: Lightning's list, read when a message shows it."""

    def __str__(self) -> str:
        from experiments import internals

        return ", ".join(sorted(map(str, internals.precisions())))

# (setting, test, what is allowed). A setting that the chosen config does not have is skipped (data=file
# has no num_samples).
RULES = [
    ("seed", lambda v: _integer(v) and 0 <= v < 2**32, "an integer from 0 to 2**32 - 1"),
    ("data.batch_size", lambda v: _integer(v) and v >= 1, "an integer >= 1"),
    ("data.num_samples", lambda v: _integer(v) and v >= 1, "an integer >= 1"),
    ("data.num_features", lambda v: _integer(v) and v >= 1, "an integer >= 1"),
    ("data.val_fraction", lambda v: _real(v) and 0 <= v < 1, "a number from 0 up to, not including, 1"),
    ("data.noise_std", lambda v: _real(v) and v >= 0, "a finite number >= 0"),
    ("model.out_features", lambda v: _integer(v) and v >= 1, "an integer >= 1"),
    ("model.hidden", _widths, "a list of one or more integers >= 1, e.g. [1024,1024] (no hidden layer: model=linear)"),
    ("model.activation", lambda v: v in ACTIVATIONS, ", ".join(ACTIVATIONS)),
    ("compile", lambda v: isinstance(v, bool), "true, false"),
    ("window_s", lambda v: _real(v) and 0 <= v <= 60, "a number of seconds from 0 to 60 (0: a window a log step)"),
    ("data.teacher_hidden", _widths, "a list of one or more integers >= 1, e.g. [256,256]"),
    ("data.teacher_activation", lambda v: v in ACTIVATIONS, ", ".join(ACTIVATIONS)),
    ("trainer.accumulate_grad_batches", lambda v: _integer(v) and v >= 1, "an integer >= 1"),
    ("trainer.devices", _devices, "an integer >= 1, -1 (every device), auto, or a list of device indices"),
    ("trainer.num_nodes", lambda v: _integer(v) and v >= 1, "an integer >= 1"),
    ("trainer.max_epochs", lambda v: v is None or (_integer(v) and v >= -1), "an integer >= 0, or -1 for no limit"),
    ("trainer.max_steps", lambda v: _integer(v) and (v >= 1 or v == -1), "an integer >= 1, or -1 for no limit"),
    ("trainer.limit_train_batches", _batches, "null, a fraction from 0.0 to 1.0, or a number of batches >= 0"),
    ("trainer.limit_val_batches", _batches, "null, a fraction from 0.0 to 1.0, or a number of batches >= 0"),
    ("trainer.val_check_interval", _batches, "null, a fraction of the epoch from 0.0 to 1.0, or a number of batches"),
    ("data.on_device", lambda v: v in ("auto", True, False), "auto, true, false"),
    ("data.pin_memory", lambda v: v in ("auto", True, False), "auto, true, false"),
    ("target.mse_ratio", lambda v: _real(v) and v >= 1, "a number >= 1 (1.01: within 1% of the optimum)"),
    ("target.stop", lambda v: isinstance(v, bool), "true, false"),
    ("trainer.log_every_n_steps", lambda v: _integer(v) and v >= 1, "an integer >= 1"),
    ("optimizer.lr", lambda v: _real(v) and v > 0, "a finite number > 0"),
    ("optimizer.momentum", lambda v: _real(v) and 0 <= v < 1, "a number from 0 up to, not including, 1"),
    ("optimizer.weight_decay", lambda v: _real(v) and v >= 0, "a finite number >= 0"),
    ("batch.effective", lambda v: v is None or (_integer(v) and v >= 1), "null (off), or an integer >= 1"),
    ("batch.memory_mb", lambda v: v is None or (_real(v) and v > 0), "null (measured), or a number of MiB > 0"),
    ("batch.gpu_margin", lambda v: _real(v) and 0 <= v < 1, "a share from 0 up to, not including, 1"),
    ("batch.cpu_share", lambda v: _real(v) and 0 < v <= 1, "a share above 0, up to 1"),
    ("checkpoint.every_n_epochs", lambda v: _integer(v) and v >= 0, "an integer >= 0 (0: not at epoch ends)"),
    ("checkpoint.every_n_train_steps", lambda v: v is None or (_integer(v) and v >= 1), "null, or an integer >= 1"),
    ("checkpoint.every_n_minutes", lambda v: v is None or (_real(v) and v > 0), "null, or a number of minutes > 0"),
    ("advise.budget_s", lambda v: _real(v) and v > 0, "a number of seconds > 0"),
    ("advise.repeats", lambda v: _integer(v) and v >= 3, "an integer >= 3 (a median and a range need three)"),
    ("advise.tolerance", lambda v: _real(v) and 0 <= v < 1, "a share from 0 up to, not including, 1"),
    ("advise.ddp", lambda v: isinstance(v, bool), "true, false"),
    ("advise.compile", lambda v: isinstance(v, bool), "true, false"),
    ("advise.max_batch", lambda v: v is None or (_integer(v) and v >= 1), "null (the training split), an integer >= 1"),
    ("trainer.precision", _precision, _Precisions()),  # last: the one that needs Lightning (what is allowed, too)
]

_ABSENT = object()


def check_rules(cfg: DictConfig) -> None:
    """Raise ConfigError for a required key without a value, then for the first setting that breaks its rule."""
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        raise ConfigError(f"{missing[0]} is required and has no value; set it on the command line: {missing[0]}=...")
    for key, test, allowed in RULES:
        value = OmegaConf.select(cfg, key, default=_ABSENT)
        if value is not _ABSENT and not test(value):
            raise ConfigError(f"{key}={value} is not allowed; allowed: {allowed}")
