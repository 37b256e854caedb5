"""The config the user gave as the search's starting point: its own values of the searched settings are a new
study's first trial, and the search ends by setting its best trial against that one, each as its val MSE over the
optimum (the exact least-squares solution's, from the trial's metrics.json)."""

import logging
from pathlib import Path

from omegaconf import DictConfig, OmegaConf
from optuna.distributions import BaseDistribution, CategoricalDistribution
from optuna.trial import FrozenTrial

from experiments.sweeps.record import read_job

log = logging.getLogger(__name__)


def baseline_values(space: dict[str, BaseDistribution], config: DictConfig) -> dict | None:
    """The searched settings' values in the composed config (a group's: its option), or None when one of them lies
    outside the space (a choice without it, an interval that does not hold it): then no trial can be the baseline."""
    choices = config.hydra.runtime.choices
    values = {key: choices[key] if key in choices else OmegaConf.select(config, key) for key in space}
    return values if all(_within(space[key], value) for key, value in values.items()) else None


def _within(dist: BaseDistribution, value) -> bool:
    if isinstance(dist, CategoricalDistribution):
        return value in dist.choices
    if not isinstance(value, int | float) or isinstance(value, bool):
        return False
    step = getattr(dist, "step", None)
    on_step = step is None or abs((value - dist.low) / step - round((value - dist.low) / step)) < 1e-9
    return dist.low <= value <= dist.high and on_step


def report(best: FrozenTrial, completed: list[FrozenTrial], baseline: dict | None) -> dict:
    """Log the search's last lines, the best trial against the baseline's; return them for optimization_results."""
    best_ratio = _over_optimum(best)
    log.info("best trial %d (%s): val MSE %.6g%s", best.number, _settings(best), best.value, _times(best_ratio))
    result = {"best_over_optimum": best_ratio}
    first = next((t for t in completed if baseline is not None and t.params == baseline), None)
    if first is None:
        why = "is not in the space" if baseline is None else "did not complete"
        log.info("the config as given (the searched settings' own values) %s: no baseline to compare with", why)
        return result
    ratio = _over_optimum(first)
    result |= {"baseline_trial": first.number, "baseline_value": first.value, "baseline_over_optimum": ratio}
    if first.number == best.number:
        log.info("the best trial is the config as given (trial %d): no other trial did better", first.number)
        return result
    log.info("the config as given, trial %d (%s): val MSE %.6g%s", first.number, _settings(first), first.value,
             _times(ratio))  # fmt: skip
    log.info("best against the config as given: %.4fx its val MSE (the config's is %.4fx the best's)",
             best.value / first.value, first.value / best.value)  # fmt: skip
    return result


def _over_optimum(trial: FrozenTrial) -> float | None:
    optimum = read_job(Path(trial.user_attrs.get("dir", ""))).metrics.get("optimal_val_mse")
    return trial.value / optimum if optimum else None


def _times(ratio: float | None) -> str:
    return "" if ratio is None else f" = {ratio:.4f}x the optimum"


def _settings(trial: FrozenTrial) -> str:
    return " ".join(f"{key}={value}" for key, value in trial.params.items())
