import fnmatch
import inspect
import re
from pathlib import Path

import pytest
from conftest import compose_config
from hydra.utils import get_method, get_object
from omegaconf import OmegaConf

from experiments.commands.entry import CONFIG_DIR

# Arguments that enter where the object is built (train.py), not from the YAML.
RUNTIME_ARGS = {
    "torch.nn.Linear": {"in_features": 8},
    "lightning.Trainer": {"callbacks": [], "logger": False},
    "lightning.pytorch.loggers.TensorBoardLogger": {"save_dir": "."},
    "lightning.pytorch.loggers.CSVLogger": {"save_dir": "."},
}
PARTIAL_ARGS = {
    "torch.optim.SGD": {"params": []},
    "torch.optim.Adam": {"params": []},
    # The module passes the optimizer, and the run's length where a schedule needs it.
    "torch.optim.lr_scheduler.CosineAnnealingLR": {"optimizer": None, "T_max": 1},
    "torch.optim.lr_scheduler.StepLR": {"optimizer": None},
    "torch.optim.lr_scheduler.OneCycleLR": {"optimizer": None, "total_steps": 1},
}
# Constructors taking **kwargs, and where their documentation says those go: a typo there must fail too.
KWARGS_GO_TO = {
    "lightning.pytorch.strategies.DDPStrategy": ("torch.nn.parallel.DistributedDataParallel", {"module": None}),
    "lightning.pytorch.loggers.TensorBoardLogger": ("torch.utils.tensorboard.SummaryWriter", {}),
}


def bind(target: str, kwargs: dict) -> None:
    """Raise TypeError when `kwargs` do not bind to `target`, or to where its **kwargs are passed on."""
    signature = inspect.signature(get_object(target) if "." in target else get_method(target))
    params = signature.parameters
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        signature.bind(**kwargs)
        return
    named = {k: v for k, v in kwargs.items() if k in params}
    signature.bind(**named)
    rest = {k: v for k, v in kwargs.items() if k not in params}
    if target not in KWARGS_GO_TO:
        raise TypeError(f"{target} takes **kwargs: say in KWARGS_GO_TO where they go")
    destination, required = KWARGS_GO_TO[target]
    inspect.signature(get_object(destination)).bind(**required, **rest)


def _target_nodes(node, path=""):
    if OmegaConf.is_dict(node):
        if "_target_" in node:
            yield path, node
        for key, value in node.items_ex(resolve=False):
            yield from _target_nodes(value, f"{path}.{key}".lstrip("."))


def _options(group: str) -> list[str]:
    return sorted(p.stem for p in (Path(CONFIG_DIR) / group).glob("*.yaml"))


COMBINATIONS = (
    [f"data={o}" for o in _options("data")]
    + [f"logger={o}" for o in _options("logger")]
    + [f"experiment={o}" for o in _options("experiment")]
    + [f"strategy={o}" for o in _options("strategy")]
    + [f"{group}={o}" for group in ("optimizer", "scheduler", "callbacks") for o in _options(group)]
    + [f"debug={o}" for o in _options("debug") if o != "profiler"]  # its dirpath is Hydra's run dir: test_menu
)


@pytest.mark.parametrize("override", COMBINATIONS)
def test_every_target_binds_to_its_constructor(override):
    cfg = compose_config(override, "data.path=x.csv" if override == "data=file" else "seed=0", tiny=False)
    nodes = list(_target_nodes(cfg))
    assert nodes, "the config instantiates nothing"
    for path, node in nodes:
        kwargs = {k: v for k, v in OmegaConf.to_container(node, resolve=True).items() if not k.startswith("_")}
        target = node._target_
        kwargs |= RUNTIME_ARGS.get(target, {}) | PARTIAL_ARGS.get(target, {})
        try:
            bind(target, kwargs)
        except TypeError as err:
            pytest.fail(f"{path} ({target}) does not bind: {err}")


@pytest.mark.parametrize(
    ("override", "node"),
    [
        ("+optimizer.momentun=0.9", "optimizer"),
        ("+trainer.strategy.find_unused_parameter=true", "trainer.strategy"),  # DDPStrategy(**kwargs): DDP's
        ("+logger.flush_sec=10", "logger"),  # TensorBoardLogger(**kwargs): SummaryWriter's flush_secs
    ],
)
def test_binding_check_catches_a_typo(override, node):
    extra = ["strategy=ddp"] if node == "trainer.strategy" else []
    cfg = OmegaConf.select(compose_config(*extra, override), node)
    kwargs = {k: v for k, v in OmegaConf.to_container(cfg).items() if not k.startswith("_")}
    kwargs |= RUNTIME_ARGS.get(cfg._target_, {}) | PARTIAL_ARGS.get(cfg._target_, {})
    with pytest.raises(TypeError):
        bind(cfg._target_, kwargs)
    bind(cfg._target_, {k: v for k, v in kwargs.items() if k != override.split("=")[0].rsplit(".", 1)[-1]})


def test_default_config_composes_with_the_documented_groups():
    cfg = compose_config(tiny=False)
    assert set(cfg) >= {"trainer", "data", "model", "optimizer", "logger", "seed", "ckpt_path"}
    assert cfg.trainer.strategy == "auto"
    assert cfg.model.in_features is None  # follows the data
    assert cfg.data.num_targets == cfg.model.out_features


def test_seed_experiments_match_the_seed():
    small = compose_config("experiment=seed_small", tiny=False)
    large = compose_config("experiment=seed_large", tiny=False)
    for cfg, n in ((small, 10), (large, 1000)):
        assert (cfg.data.num_samples, cfg.data.num_features, cfg.data.batch_size) == (n, n, n)
        assert cfg.optimizer.lr == 0.01 and cfg.trainer.max_epochs == 100


def test_every_runnable_config_starts_with_its_command():
    for path in (Path(CONFIG_DIR) / "experiment").glob("*.yaml"):
        # Hydra reads a package header only on the very first lines; the command comes right after it.
        lines = [line for line in path.read_text().splitlines() if not line.startswith("# @package")]
        assert lines[0].startswith("# python train.py "), path
        # `experiment=NAME`, or a sweep `experiment=glob(PATTERN)` over this file or the variants built on it.
        selected = re.search(r"experiment=(?:glob\()?([\w*?]+)", lines[0])
        assert selected and (fnmatch.fnmatch(path.stem, selected[1]) or selected[1].startswith(path.stem)), path
