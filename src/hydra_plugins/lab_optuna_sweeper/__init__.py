"""`hydra/sweeper=lab_optuna` (conf/hydra/sweeper/lab_optuna.yaml, chosen by hparams_search=optuna): a Hydra sweeper
on Optuna's ask-and-tell API.

Hand-written because no released plugin supports Optuna >= 5 on Hydra 1.3: Hydra's hydra-optuna-sweeper 1.3 caps
Optuna below 3 (and so SQLAlchemy below 2), and its Optuna 5 version (1.4) needs Hydra 1.4. Hydra finds the
sweeper class here, in the `hydra_plugins` namespace package (`optuna_sweeper.py`); the search itself is in
`_search.py` and `_space.py`, which Hydra's plugin scan skips (a leading `_`), so that a command that searches
nothing never imports Optuna. Its configs are YAML files of the project's `conf/hydra/sweeper/`, under names of
their own (`lab_optuna`, `optuna_sampler/`): an environment that still has hydra-optuna-sweeper keeps its
ConfigStore entries `hydra/sweeper/optuna` and `hydra/sweeper/sampler/*`, and Hydra refuses a file of the same
group and name as a ConfigStore entry ("validated against ConfigStore schema with the same name").
"""
