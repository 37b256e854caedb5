"""`hydra/sweeper=optuna` (conf/hydra/sweeper/optuna.yaml): a Hydra sweeper on Optuna's ask-and-tell API.

Hand-written because no released plugin supports Optuna >= 5 on Hydra 1.3: Hydra's hydra-optuna-sweeper 1.3 caps
Optuna below 3 (and so SQLAlchemy below 2), and its Optuna 5 version (1.4) needs Hydra 1.4. Hydra finds the
sweeper class here, in the `hydra_plugins` namespace package (`optuna_sweeper.py`); the search itself is in
`_search.py` and `_space.py`, which Hydra's plugin scan skips (a leading `_`), so that a command that searches
nothing never imports Optuna. Its configs are YAML files of the project's `conf/hydra/sweeper/`: the primary
config dir comes before any plugin's ConfigStore in Hydra's search path, so where hydra-optuna-sweeper is still
installed, `hydra/sweeper=optuna` and `hydra/sweeper/sampler=tpe` are this sweeper's all the same.
"""
