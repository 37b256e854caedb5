"""The search space: `hydra.sweeper.params` and the command line's overrides, parsed with Hydra's own parser, as
Optuna distributions; an override that sweeps nothing is a fixed setting of every trial."""

from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import ChoiceSweep, IntervalSweep, Override, RangeSweep, Transformer
from optuna.distributions import BaseDistribution, CategoricalDistribution, FloatDistribution, IntDistribution

from experiments.config.errors import ConfigError


def search_space(params: dict[str, str], arguments: list[str]) -> tuple[dict[str, BaseDistribution], list[str]]:
    """The distributions of the swept settings, and the fixed overrides every trial gets. A setting on the command
    line replaces its entry in `params` (`optimizer=sgd` fixes what `optimizer: choice(sgd, adam)` searches)."""
    overrides = [f"{key}={value}" for key, value in params.items()] + list(arguments)
    swept: dict[str, BaseDistribution] = {}
    fixed: dict[str, str] = {}
    for override in OverridesParser.create().parse_overrides(overrides):
        key = override.get_key_element()
        swept.pop(key, None), fixed.pop(key, None)
        if override.is_sweep_override():
            swept[key] = distribution(override)
        else:
            fixed[key] = f"{key}={override.get_value_element_as_str()}"
    return swept, list(fixed.values())


def distribution(override: Override) -> BaseDistribution:
    sweep = override.value()
    if isinstance(sweep, IntervalSweep):  # interval(a, b): floats (Hydra makes both ends floats); tag(log, ...)
        return FloatDistribution(sweep.start, sweep.end, log="log" in sweep.tags)
    values = list(override.sweep_iterator(transformer=Transformer.encode))
    if isinstance(sweep, RangeSweep):  # Hydra enumerates it, so its stop stays out, as in a grid sweep
        if not values:
            raise ConfigError(f"{override.input_line}: the range is empty; allowed: range(start, stop[, step]), "
                              "start < stop for a positive step")  # fmt: skip
        low, high, step = min(values), max(values), abs(sweep.step)
        if all(isinstance(v, int) for v in values):
            return IntDistribution(low, high, step=step)
        return FloatDistribution(low, high, step=step)
    assert isinstance(sweep, ChoiceSweep)  # choice(a, b) or a,b
    return CategoricalDistribution(values)


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
