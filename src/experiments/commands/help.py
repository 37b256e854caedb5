"""`python train.py --help` (and eval.py's, predict.py's): a page a person reads, in a fraction of a second.

What the command does, examples, the menu (each group, its options, the one chosen), the settings the command line
composes in short, how to see the whole config, and where the docs are. Hydra's own `--help` lists the groups by
loading its config repository again for every group, Hydra's and its plugins' included (about 1.5 s), and prints
the whole config without its comments; here the groups are the folders of `conf/`, and the notes are the comments
of the config files themselves.
"""

import re
import sys
import textwrap
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

DOCS = "README.md; docs/configuration.md (every group and key), docs/failures.md (errors, exit codes, resuming)"

# Each command's config: its script, what it does, its examples (command, what it does), its docs.
PAGES = {
    "config": (
        "train.py",
        "Train the seed's linear model (synthetic data with a known optimum, or your file) with Lightning on any "
        "device, and record its fit and its speed. Each run writes outputs/runs/<timestamp>/: metrics.json, "
        "checkpoints/last.ckpt, TensorBoard files and train.log.",
        [
            ("python train.py", "the default problem, on a GPU if there is one"),
            ("python train.py trainer.devices=2 data.batch_size=1024", "two devices (DDP), one global batch"),
            ("python train.py experiment=seed_large", "the seed's 1000x1000 example, made runnable"),
            ("python train.py data=file data.path=my.csv data.target=price", "your own data"),
            ("python train.py -m data.batch_size=64,256,1024", "a sweep; then python scripts/report.py <its dir>"),
            ("python train.py -m hparams_search=optuna hydra.sweeper.n_trials=6", "a hyperparameter search"),
            ("python train.py ckpt_path=last", "resume the newest run, in a new run dir"),
        ],
        "docs/sweeps.md (sweeps, reports, the search), docs/strategies.md (devices, DDP)",
    ),
    "eval": (
        "eval.py",
        "Score a checkpoint that train.py wrote: its run's validation split again, or every row of other data. "
        "The run's config comes with the checkpoint; writes outputs/eval/<timestamp>/eval.json.",
        [
            ("python eval.py ckpt_path=outputs/runs/<timestamp>/checkpoints/last.ckpt", "the run's validation split"),
            ("python eval.py ckpt_path=<...>/last.ckpt data.path=other.csv", "every row of another file"),
            ("python eval.py ckpt_path=<...>/last.ckpt trainer.accelerator=gpu", "on a GPU"),
        ],
        "docs/using-a-model.md",
    ),
    "predict": (
        "predict.py",
        "Apply a checkpoint that train.py wrote to raw inputs (a CSV with a header, or a 2-D .npy): writes "
        "outputs/predict/<timestamp>/predictions.csv (or .npy), the input's columns followed by the predictions.",
        [
            ("python predict.py ckpt_path=<...>/last.ckpt data.path=new.csv", "predictions for new rows"),
            ("python predict.py ckpt_path=<...>/last.ckpt data.path=new.npy trainer.accelerator=gpu", "on a GPU"),
        ],
        "docs/using-a-model.md",
    ),
    "advise": (
        "advise.py",
        "Measure, on this machine, for this model and data (any train.py override), which of the seed's knobs pays: "
        "the batch, accumulation, DDP, precision, torch.compile, where the data is held; print a table, each knob's "
        "verdict and the train.py command of the fastest configuration that keeps your result. About 2 minutes; "
        "writes outputs/advise/<timestamp>/: advice.json, throughput.png, the trials' run dirs.",
        [
            ("python advise.py", "the seed's Linear on this machine"),
            ("python advise.py model=mlp model.hidden=[1024,1024]", "an MLP"),
            ("python advise.py data=file data.path=my.csv data.target=price", "your own data"),
            ("python advise.py data.batch_size=64 trainer.accumulate_grad_batches=4", "your command, as you train it"),
        ],
        "docs/advice.md",
    ),
}

# Options that are the study's own (scripts/study.py runs them), listed apart from the user's.
STUDY = "study_"
WIDTH = 116


def print_help(config_name: str, config_dir: str, name: str) -> None:
    from hydra import compose, initialize_config_dir

    overrides = [a for a in sys.argv[1:] if not a.startswith("-")]
    with initialize_config_dir(config_dir=config_dir, version_base="1.3", job_name=name):
        cfg = compose(config_name, overrides=overrides, return_hydra_config=True)
    print(page(name, Path(config_dir), config_name, cfg))


def page(name: str, root: Path, config_name: str, cfg: DictConfig) -> str:
    script, what, examples, docs = PAGES[config_name]
    script = f"python {script}"
    chosen = dict(cfg.hydra.runtime.choices)
    notes = _comments(root / f"{config_name}.yaml")
    lines = [*_wrap(f"{script}: {what}"), "", f"Usage: {script} [group=option ...] [key=value ...]"]
    if config_name == "config":
        lines.append(f"       {script} -m key=a,b [key=c,d ...]    a sweep: one job per combination")
    lines += ["", "Examples:"]
    column = max(len(c) for c, _ in examples) + 2
    lines += [f"  {c:<{column}}# {why}" for c, why in examples]
    groups = _groups(root, cfg)
    if groups:
        lines += ["", "Groups (group=option; * marks the one this command line chooses):"]
        for group in groups:
            options = sorted(p.stem for p in (root / group).glob("*.yaml"))
            mine = [o for o in options if not o.startswith(STUDY)]
            listed = ", ".join(f"{o}*" if chosen.get(group) == o else o for o in mine)
            note = f"  ({notes[group]})" if group in notes else ""
            lines += _wrap(f"{group}: {listed}{note}", indent="  ", hang="      ")
            if study := [o for o in options if o.startswith(STUDY)]:
                lines += _wrap(f"(the study's own, run by scripts/study.py: {', '.join(study)})", "      ", "      ")
    lines += ["", "Settings (key=value, as this command line composes them; a key not shown: +key=value to add it):"]
    settings = OmegaConf.to_container(cfg, resolve=False)
    settings.pop("hydra")
    for key, value in settings.items():
        note = f"  ({notes[key]})" if key in notes and key not in groups else ""  # a group's: said above
        lines += _wrap(f"{key}: {_flat(value)}{note}" if isinstance(value, dict) else f"{key}={_value(value)}{note}",
                       indent="  ", hang="      ")  # fmt: skip
    lines += [
        "",
        f"The whole config, with its overrides: {script} --cfg job [overrides]   (Hydra's own flags: --hydra-help)",
        *_wrap(f"Docs: {DOCS}; {docs}"),
    ]
    return "\n".join(lines)


def _groups(root: Path, cfg: DictConfig) -> list[str]:
    """The folders of conf/ that the user chooses among: the command's own groups, and the samplers of a search."""
    folders = sorted({p.parent.relative_to(root).as_posix() for p in root.rglob("*.yaml") if p.parent != root})
    chosen = cfg.hydra.runtime.choices
    return [g for g in folders if g in chosen and g != "hydra/sweeper"]  # the search chooses its sweeper


def _comments(config: Path) -> dict[str, str]:
    """The comment beside each group of the defaults list and each top-level key of a config file."""
    found = {}
    for line in config.read_text().splitlines():
        match = re.match(r"^(?:  - (?:override )?)?([\w/]+):[^#]*#\s*(.+)$", line)
        if match:
            found.setdefault(match[1], match[2].strip())
    return found


def _flat(node: dict, prefix: str = "") -> str:
    parts = []
    for key, value in node.items():
        if str(key).startswith("_"):  # _target_, _partial_: how the node is built, not a setting
            continue
        if isinstance(value, dict):
            parts.append(_flat(value, f"{prefix}{key}."))
        else:
            parts.append(f"{prefix}{key}={_value(value)}")
    return " ".join(p for p in parts if p)


def _value(value) -> str:
    if value is None or value == "":
        return "null" if value is None else "''"
    return str(value).lower() if isinstance(value, bool) else str(value)


def _wrap(text: str, indent: str = "", hang: str = "  ") -> list[str]:
    return textwrap.wrap(text, WIDTH, initial_indent=indent, subsequent_indent=hang, break_on_hyphens=False)
