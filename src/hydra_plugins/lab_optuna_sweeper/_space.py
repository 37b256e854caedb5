"""The search space: `hydra.sweeper.params` and the command line's overrides, parsed with Hydra's own parser, as
Optuna distributions; an override that sweeps nothing is a fixed setting of every trial. `check_space` holds every
value the space can give against the config's own rules, before the search writes anything."""

from pathlib import Path
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import ChoiceSweep, IntervalSweep, Override, RangeSweep, Transformer
from omegaconf import DictConfig
from optuna.distributions import BaseDistribution, CategoricalDistribution, FloatDistribution, IntDistribution

from experiments.config.errors import ConfigError

PARAMS = "hydra.sweeper.params"


def parse(params: dict[str, str], arguments: list[str]) -> dict[str, tuple[str, Override]]:
    """Each setting's override as the user wrote it (`hydra.sweeper.params.<key>=...` for an entry of params), and
    Hydra's parse of it. A setting on the command line replaces its entry in `params` (`optimizer=sgd` fixes what
    `optimizer: choice(sgd, adam)` searches)."""
    lines = [(f"{PARAMS}.{key}={value}", f"{key}={value}") for key, value in params.items()]
    lines += [(argument, argument) for argument in arguments]
    parsed = OverridesParser.create().parse_overrides([line for _, line in lines])
    settings: dict[str, tuple[str, Override]] = {}
    for (name, _), override in zip(lines, parsed, strict=True):
        key = override.get_key_element()
        settings.pop(key, None)  # the last one wins, in the order Hydra applies them
        settings[key] = (name, override)
    return settings


def search_space(params: dict[str, str], arguments: list[str]) -> tuple[dict[str, BaseDistribution], list[str]]:
    """The distributions of the swept settings, and the fixed overrides every trial gets."""
    swept: dict[str, BaseDistribution] = {}
    fixed: list[str] = []
    for key, (_, override) in parse(params, arguments).items():
        if override.is_sweep_override():
            swept[key] = distribution(override)
        else:
            fixed.append(f"{key}={override.get_value_element_as_str()}")
    return swept, fixed


def distribution(override: Override) -> BaseDistribution:
    sweep = override.value()
    if isinstance(sweep, IntervalSweep):  # interval(a, b): floats (Hydra makes both ends floats); tag(log, ...)
        return FloatDistribution(sweep.start, sweep.end, log="log" in sweep.tags)
    values = list(override.sweep_iterator(transformer=Transformer.encode))
    if isinstance(sweep, RangeSweep):  # Hydra enumerates it, so its stop stays out, as in a grid sweep
        low, high, step = min(values), max(values), abs(sweep.step)
        if all(isinstance(v, int) for v in values):
            return IntDistribution(low, high, step=step)
        return FloatDistribution(low, high, step=step)
    assert isinstance(sweep, ChoiceSweep)  # choice(a, b) or a,b
    return CategoricalDistribution(values)


def check_space(params: dict[str, str], arguments: list[str], config: DictConfig) -> None:
    """Raise ConfigError, in the one-line form of the config's own checks, for the first swept setting that could
    give a trial a value the config refuses: an empty range, an interval whose low is above its high (or not above
    0 on a log scale), an option its group does not have, a value that config/checks.py's RULES refuse (an integer
    setting's interval: its floats are not integers)."""
    from experiments.config.checks import RULES  # with torch: a search's driver only

    rules = {key: (test, allowed) for key, test, allowed in RULES}
    groups = _groups(config)
    for key, (written, override) in parse(params, arguments).items():
        if not override.is_sweep_override():
            continue
        sweep = override.value()
        if isinstance(sweep, IntervalSweep):
            low, high = sweep.start, sweep.end
            if low > high:
                raise ConfigError(f"{written}: low {low} is above high {high}; allowed: interval(low, high), low <= "
                                  "high")  # fmt: skip
            if "log" in sweep.tags and low <= 0:
                raise ConfigError(f"{written}: a log scale needs low > 0; allowed: tag(log, interval(low, high)), "
                                  "low > 0")  # fmt: skip
            values = [low, high]
        else:
            values = list(override.sweep_iterator(transformer=Transformer.encode))
            if not values:
                raise ConfigError(f"{written}: the range is empty; allowed: range(start, stop[, step]), start < stop "
                                  "for a positive step")  # fmt: skip
        if key in groups:
            options = groups[key]
            for value in values:
                if value not in options:
                    raise ConfigError(f"{written}: {value} is not an option of {key}; allowed: {', '.join(options)}")
        elif key in rules:
            test, allowed = rules[key]
            for value in values:
                if not test(value):
                    if isinstance(sweep, IntervalSweep) and test(int(value)):
                        allowed += ", which an interval (floats) never gives: range(start, stop) or choice(...)"
                    raise ConfigError(f"{written}: {value} is not allowed; allowed: {allowed}")


def _groups(config: DictConfig) -> dict[str, list[str]]:
    """The config groups of the primary config dir and their options: `{"optimizer": ["adam", "sgd"], ...}`."""
    sources = [s for s in config.hydra.runtime.config_sources if s.provider == "main" and s.schema == "file"]
    if not sources:
        return {}
    root = Path(sources[0].path)
    return {
        key: sorted(p.stem for p in (root / key).glob("*.yaml"))
        for key in config.hydra.runtime.choices
        if not key.startswith("hydra/") and (root / key).is_dir()
    }


def grid(space: dict[str, BaseDistribution], settings: str) -> dict[str, list[Any]]:
    """The values the grid sampler runs through: every setting must have a finite set."""
    values = {}
    for key, dist in space.items():
        if isinstance(dist, CategoricalDistribution):
            values[key] = list(dist.choices)
        elif isinstance(dist, IntDistribution) and not dist.log:
            values[key] = list(range(dist.low, dist.high + 1, dist.step))
        elif isinstance(dist, FloatDistribution) and dist.step is not None:
            count = round((dist.high - dist.low) / dist.step) + 1
            values[key] = [dist.low + i * dist.step for i in range(count)]
        else:
            raise ConfigError(
                f"{settings}.{key}: an interval has no grid; allowed with hydra/sweeper/optuna_sampler=grid: "
                "choice(...) or range(start, stop[, step])"
            )
    return values
