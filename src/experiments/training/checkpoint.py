"""What a checkpoint carries besides the weights, and the one reader that checks a checkpoint before any use.

train.py's resume (`ckpt_path=`), eval.py and predict.py all read checkpoints through `load_checkpoint`: a
file that is missing, empty, truncated, not a checkpoint, or a checkpoint of some other model is refused
with one line naming the setting, before any work. `check_fits` then refuses a model whose shape does not
fit the data.
"""

import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from experiments import internals
from experiments.config.errors import ConfigError
from experiments.run.layout import RunPaths, run_of_checkpoint
from experiments.training.module import Regressor

# The checkpoint's entry written by `run.last_checkpoint.LastCheckpoint`: a top-level key, beside Lightning's own.
RECORD_KEY = "run"
ALLOWED = "allowed: a checkpoint that train.py wrote (e.g. outputs/runs/<timestamp>/checkpoints/last.ckpt)"
ZIP_MAGIC = b"PK\x03\x04"  # torch.save writes a zip archive
PICKLE_MAGIC = b"\x80"  # a pickle of protocol 2 or later


@dataclass
class Checkpoint:
    path: Path
    module: Regressor  # the weights and the training statistics, loaded, in eval mode
    config: DictConfig  # the run's composed config
    feature_names: list[str] | None
    target_name: str | None
    global_step: int  # the optimizer step it resumes at: where a resumed run's curves restart
    setting: str = "ckpt_path"
    batch_fit: dict | None = None  # batch.effective's fit (experiments.training.batch_fit.Fit's fields); None when off
    provenance: dict | None = None  # what produced it (experiments.run.provenance); None in older checkpoints
    epochs: int = 0  # the epochs its run has trained (a resume goes on from there)

    @property
    def in_features(self) -> int:
        return self.module.feature_mean.shape[0]

    @property
    def out_features(self) -> int:
        return self.module.net(torch.zeros(1, self.in_features, device=self.module.device)).shape[-1]

    def error(self, problem: str) -> ConfigError:
        return ConfigError(f"{self.setting}={self.path}: {problem}")


def load_checkpoint(path: str | Path, setting: str = "ckpt_path") -> Checkpoint:
    """Read and check a checkpoint of `experiments.training.module.Regressor`; ConfigError names `setting=path`."""
    path = Path(path)

    def refuse(problem: str) -> ConfigError:
        return ConfigError(f"{setting}={path}: {problem}; {ALLOWED}")

    if not path.is_file():
        raise refuse("is a directory, not a checkpoint file" if path.is_dir() else "no such file")
    if path.stat().st_size == 0:
        raise refuse("empty file")
    with path.open("rb") as f:
        head = f.read(4)
    try:
        # weights_only: a checkpoint is a file from anywhere, and a full unpickling runs whatever code it names.
        # Ours hold only tensors and plain values. The unpickler warns about pickle protocols: not the user's.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            raw = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # torch raises RuntimeError, KeyError, UnpicklingError, ... for what it cannot read
        if head == ZIP_MAGIC:
            raise refuse(f"truncated or damaged ({type(err).__name__} while reading it)") from None
        if head[:1] == PICKLE_MAGIC and "Weights only load failed" in str(err):
            raise refuse("a pickle of objects other than tensors and plain values, not a checkpoint") from None
        raise refuse("not a checkpoint (not a file that torch.save wrote)") from None
    if not isinstance(raw, dict) or "state_dict" not in raw or "pytorch-lightning_version" not in raw:
        found = f"a dict of {', '.join(map(str, list(raw)[:4]))}" if isinstance(raw, dict) else type(raw).__name__
        raise refuse(f"not a Lightning checkpoint (it holds {found}, no state_dict)")
    state = raw["state_dict"]
    if not {"feature_mean", "feature_std"} <= state.keys() or not any(k.startswith("net.") for k in state):
        names = ", ".join(list(state)[:4]) + (", ..." if len(state) > 4 else "")
        raise refuse(f"a Lightning checkpoint of another model (its weights: {names or 'none'})")

    record = raw.get(RECORD_KEY) or {}
    config = record.get("config")
    if config is None:  # written before checkpoints carried their run's config: read it from the run dir
        run = run_of_checkpoint(path)
        hydra_config = run.hydra / "config.yaml" if run else None
        if hydra_config is None or not hydra_config.is_file():
            raise refuse(
                "holds no run config (an older checkpoint), and there is no .hydra/config.yaml beside its "
                "checkpoints/ folder to read it from"
            )
        config = OmegaConf.load(hydra_config)
    config = OmegaConf.create(config)
    # Build the model the run's config describes, and load the weights strictly: keys or shapes of any other
    # model do not load.
    in_features = state["feature_mean"].shape[0]
    try:
        net = instantiate(config.model, in_features=in_features)
        module = Regressor(net, None, state["feature_mean"], state["feature_std"])
        expected = {k: tuple(v.shape) for k, v in module.state_dict().items()}
    except Exception as err:
        raise refuse(f"its config's model cannot be built ({type(err).__name__}: {str(err).splitlines()[0]})") from None
    found = {k: tuple(v.shape) for k, v in state.items()}
    if found != expected:
        diff = sorted(set(found.items()) ^ set(expected.items()))
        raise refuse(f"its weights do not fit the model of its config (first difference: {diff[0][0]})")
    module.load_state_dict(state)
    module.eval()
    return Checkpoint(
        path,
        module,
        config,
        record.get("feature_names"),
        record.get("target_name"),
        int(raw.get("global_step", 0)),
        setting,
        record.get("batch_fit"),
        record.get("provenance"),
        internals.epochs_trained(raw),
    )


def check_fits(checkpoint: Checkpoint, num_features: int, out_features: int | None = None) -> None:
    """Refuse data with another feature count (or a model config with another output count) than the model's."""
    if num_features != checkpoint.in_features:
        raise checkpoint.error(
            f"the model takes {checkpoint.in_features} features and the data has {num_features}; allowed: "
            f"data of {checkpoint.in_features} features (the data the model was trained on, or data like it)"
        )
    if out_features is not None and out_features != checkpoint.out_features:
        raise checkpoint.error(
            f"the model gives {checkpoint.out_features} outputs and {out_features} are wanted here "
            f"(model.out_features, or the data's target columns); allowed: {checkpoint.out_features}"
        )


def check_trains_on(checkpoint: Checkpoint, max_epochs: int | None, max_steps: int) -> None:
    """A resume from `checkpoint` must have something left to train under the budget given: Lightning would
    restore a finished run, train nothing and end, leaving a run dir with no checkpoint."""
    steps, epochs = checkpoint.global_step, checkpoint.epochs
    if max_steps != -1 and steps >= max_steps:
        budget, more = f"trainer.max_steps={max_steps}", f"trainer.max_steps={2 * steps}"
    elif max_epochs is not None and max_epochs != -1 and epochs >= max_epochs:
        budget, more = f"trainer.max_epochs={max_epochs}", f"trainer.max_epochs={max(2 * epochs, epochs + 1)}"
    else:
        return
    raise checkpoint.error(
        f"its run has trained {epochs} epochs ({steps} steps): {budget} is done, nothing is left to train; "
        f"allowed: a larger budget, which trains on from it (e.g. {more} {checkpoint.setting}={checkpoint.path})"
    )


def check_same_model(checkpoint: Checkpoint, model_cfg: DictConfig, num_features: int) -> None:
    """Refuse to resume a checkpoint into a model of another shape (model=..., model.hidden=...): its weights would
    not load. Compared on the meta device: nothing is allocated."""
    with torch.device("meta"):
        net = instantiate(model_cfg, in_features=num_features)
    wanted = {k: tuple(v.shape) for k, v in net.state_dict().items()}
    found = {k: tuple(v.shape) for k, v in checkpoint.module.net.state_dict().items()}
    if wanted != found:
        raise checkpoint.error(
            f"its model is {describe_model(checkpoint.config.model)} and this run's is {describe_model(model_cfg)}; "
            f"allowed: this run's model as the checkpoint's ({describe_model(checkpoint.config.model, overrides=True)})"
            ", or no ckpt_path"
        )


def describe_model(model_cfg: DictConfig, overrides: bool = False) -> str:
    """`MLP(hidden=[64, 64], activation=gelu)`, or as overrides: `model=mlp model.hidden=[64,64] ...`."""
    shown = {k: v for k, v in OmegaConf.to_container(model_cfg).items() if k not in ("_target_", "in_features")}
    name = str(model_cfg._target_).rsplit(".", 1)[-1]
    if not overrides:
        return f"{name}({', '.join(f'{k}={v}' for k, v in shown.items())})"
    values = (str(v).replace(" ", "").lower() if not isinstance(v, str) else v for v in shown.values())
    return " ".join([f"model={name.lower()}", *(f"model.{k}={v}" for k, v in zip(shown, values, strict=True))])


def resolve_checkpoint(ckpt_path: str | None, run_dir: Path) -> str | None:
    """`last` is the newest `checkpoints/last.ckpt` among the other runs beside this one (outputs/runs/)."""
    if ckpt_path != "last":
        return ckpt_path
    runs = (RunPaths(d) for d in run_dir.parent.iterdir() if d.is_dir() and d != run_dir)
    found = [run.last_checkpoint for run in runs if run.last_checkpoint.is_file()]
    if not found:
        raise ConfigError(
            f"ckpt_path=last: no run in {run_dir.parent} has a checkpoints/last.ckpt yet; "
            "allowed: a checkpoint file, or last once a run has saved one"
        )
    return str(max(found, key=lambda p: p.stat().st_mtime))
