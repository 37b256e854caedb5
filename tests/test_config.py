import fnmatch
import inspect
import re
import shlex
from pathlib import Path

import pytest
from conftest import compose_config
from hydra import compose, initialize_config_dir
from hydra.utils import get_method, get_object
from omegaconf import OmegaConf

from experiments.commands.entry import CONFIG_DIR

# Arguments that enter where the object is built (train.py), not from the YAML.
RUNTIME_ARGS = {
    "torch.nn.Linear": {"in_features": 8},
    "experiments.models.mlp.MLP": {"in_features": 8},
    "lightning.Trainer": {"callbacks": [], "logger": False},
    "experiments.training.dashboard.TensorBoardLogger": {"save_dir": "."},
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
    "experiments.training.dashboard.TensorBoardLogger": ("torch.utils.tensorboard.SummaryWriter", {}),
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
    + [f"model={o}" for o in _options("model")]
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


# The config each entry script composes (experiments.commands.entry.command(config_name, ...) in the script).
SCRIPT_CONFIG = {"train.py": "config", "eval.py": "eval", "predict.py": "predict", "advise.py": "advise"}
# Options that a user runs: each starts with the command that runs it (style.md).
RUNNABLE = [
    "experiment", "callbacks", "scheduler", "optimizer", "debug", "hparams_search", "batch", "eval.yaml",
    "predict.yaml", "advise.yaml",
]  # fmt: skip
OPTIONS = sorted(p.relative_to(CONFIG_DIR).as_posix() for p in Path(CONFIG_DIR).glob("**/*.yaml"))


def header_command(path: Path) -> tuple[str, list[str]] | None:
    """The command on a YAML's first line (after a package header), `# python SCRIPT [-m] OVERRIDES  (a remark)`:
    the config its script composes and the overrides, the optional [ones] included and a <placeholder> filled in;
    None when it has none."""
    first = next(line for line in path.read_text().splitlines() if not line.startswith("# @package"))
    if not first.startswith("# python "):
        return None
    command = re.sub(r"<\w+>", "x", first[2:].split("  (")[0]).replace("[", "").replace("]", "")
    script, *args = shlex.split(command)[1:]
    return SCRIPT_CONFIG[script], [a for a in args if a != "-m"]


def jobs_of(overrides: list[str]) -> list[list[str]]:
    """One override list per job: `group=glob(PATTERN)` expands, as Hydra's sweeper does, to every matching option."""
    jobs = [[]]
    for override in overrides:
        key, _, value = override.partition("=")
        if value.startswith("glob("):
            matches = [o for o in _options(key) if fnmatch.fnmatch(o, value[5:-1])]
            assert matches, override
            jobs = [job + [f"{key}={m}"] for job in jobs for m in matches]
        else:
            jobs = [job + [override] for job in jobs]
    return jobs


def leaves(tree, prefix: str = "") -> dict:
    if not isinstance(tree, dict):
        return {prefix: tree}
    return {k: v for key, sub in tree.items() for k, v in leaves(sub, f"{prefix}.{key}".lstrip(".")).items()}


@pytest.mark.parametrize("option", [o for o in OPTIONS if o != "config.yaml"])
def test_the_command_on_an_options_first_line_runs_that_option(option):
    """The command a YAML file starts with composes, and the config it composes holds every value of that file
    (but those its own overrides set): the command selects this option, under a key or name it still has."""
    path = Path(CONFIG_DIR) / option
    command = header_command(path)
    if command is None:
        assert not any(option == r or option.startswith(f"{r}/") for r in RUNNABLE), f"{option}: no command"
        return
    config_name, overrides = command
    package = re.search(r"^# @package (\S+)", path.read_text(), flags=re.MULTILINE)
    package = package[1] if package else str(Path(option).parent).replace("/", ".").strip(".")
    own = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    own.pop("defaults", None)
    expected = leaves(own, "" if package == "_global_" else package)
    # The keys the command sets itself; `group=option` (and hydra/launcher=...) chooses an option, it sets no key.
    keys = [o.lstrip("+~").split("=")[0] for o in overrides]
    set_by_command = [k for k in keys if "/" not in k and not (Path(CONFIG_DIR) / k).is_dir()]
    for job in jobs_of(overrides):
        with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
            cfg = compose(config_name, overrides=job, return_hydra_config=True)
        composed = leaves(OmegaConf.to_container(cfg, resolve=False))
        for key, value in expected.items():
            if not any(key == k or key.startswith(f"{k}.") for k in set_by_command):
                assert composed.get(key, "<absent>") == value, f"{option}: {' '.join(job)} gives {key}"
