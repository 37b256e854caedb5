"""The plugin class Hydra instantiates from `hydra.sweeper` (conf/hydra/sweeper/lab_optuna.yaml); see `__init__.py`."""

from hydra.core.plugins import Plugins
from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig


class OptunaSweeper(Sweeper):
    """Keys mirror conf/hydra/sweeper/lab_optuna.yaml: `sampler` is the config of an Optuna sampler (built once the
    study is open: its seed follows the trials done, the grid's search_space `params`), `params` the search space
    in Hydra's override syntax, `storage` a database URL (None: `<sweep dir>/optuna.db`)."""

    def __init__(
        self,
        sampler: DictConfig,
        direction: str,
        n_trials: int,
        n_jobs: int,
        storage: str | None,
        study_name: str,
        params: DictConfig | None,
    ) -> None:
        self.settings = dict(
            sampler=sampler, direction=direction, n_trials=n_trials, n_jobs=n_jobs, storage=storage,
            study_name=study_name, params=dict(params or {}),
        )  # fmt: skip

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.config = config
        self.launcher = Plugins.instance().instantiate_launcher(
            hydra_context=hydra_context, task_function=task_function, config=config
        )

    def sweep(self, arguments: list[str]) -> None:
        from ._search import Search  # Optuna and SQLAlchemy: loaded by a search only

        Search(self.config, self.launcher, **self.settings).run(arguments)
