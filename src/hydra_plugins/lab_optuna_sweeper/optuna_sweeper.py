"""The plugin class Hydra instantiates from `hydra.sweeper` (conf/hydra/sweeper/lab_optuna.yaml), and the callback
that checks a search's space before anything is written; see `__init__.py`."""

from hydra.core.plugins import Plugins
from hydra.experimental.callback import Callback
from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf


class OptunaSweeper(Sweeper):
    """Keys mirror conf/hydra/sweeper/lab_optuna.yaml: `sampler` is the config of an Optuna sampler (built once the
    study is open: its seed follows the trials done, the grid's search_space `params`), `params` the search space
    in Hydra's override syntax, `storage` a database URL or a journal file (None: in the sweep dir)."""

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


class SpaceCheck(Callback):
    """conf/config.yaml's first callback: a search's space that the config would refuse ends the command with one
    line (exit 2) before the callbacks after it make the sweep dir, and so before any study or job. Hydra makes the
    sweeper only after every callback's `on_multirun_start`: the sweeper itself comes too late for that."""

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        if not str(config.hydra.sweeper.get("_target_", "")).startswith(__name__):
            return
        from experiments.config.errors import ConfigError
        from experiments.run.exits import EXIT_BAD_INPUT, Abort

        from ._space import check_space

        params = OmegaConf.to_container(config.hydra.sweeper.params or {})
        try:
            check_space({k: str(v) for k, v in params.items()}, list(config.hydra.overrides.task), config)
        except ConfigError as err:
            raise Abort(err, EXIT_BAD_INPUT) from None
