"""Every private touch of Lightning, Hydra and torch (experiments.internals) still exists in the installed versions.

An upgrade that removes or renames one fails here, with the touch's name, before any run breaks in its middle.
"""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from experiments import internals
from experiments.internals.probes import TOUCHES


@pytest.mark.parametrize("name, still_there", TOUCHES, ids=[name for name, _ in TOUCHES])
def test_the_private_touch_is_still_there(name, still_there):
    assert still_there(), f"the installed Lightning or Hydra no longer has {name} (see experiments/internals.py)"


def test_no_module_but_internals_touches_a_private_name():
    """The touches stay behind one door: the private names of internals.py appear in no other module."""
    src = Path(internals.__file__).parents[1]
    private = ["_logger_connector", "_should_accumulate", "_combined_loader", "_hydra_subprocess_cmd",
               "_PRECISION_INPUT", "_normalize_parse_gpu_string_input", "_start_method", "_return_value",
               "_batches_that_stepped", "_every_n_train_steps", "_val_check_time_interval", "_prefix",
               "_get_file_writer", "_add_prefix", "_verify_loop_configurations", "_python_dispatch",
               "_broadcast_sigterm_tensor", "_checkpoint_connector",
               "_MATPLOTLIB_AVAILABLE", "_check_requirement", "batch_progress", "full_key: ", "_trial_id"]  # fmt: skip
    found = [
        f"{path.relative_to(src.parents[1])}: {name}"
        for path in [*src.rglob("*.py"), *(src.parent / "hydra_plugins").rglob("*.py"),
                     *(src.parents[1] / "scripts").glob("*.py")]
        if "internals" not in path.parts
        for name in private
        if re.search(rf"(?<!\w){re.escape(name)}(?!\w)", path.read_text())
    ]
    assert found == []


# Each command: its config and its task, as train.py, eval.py and predict.py name them.
COMMANDS = {
    "train": ("config", "experiments.commands.train:main"),
    "eval": ("eval", "experiments.commands.evaluate:main"),
    "predict": ("predict", "experiments.commands.predict:main"),
}


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.slow
def test_a_command_starts_without_matplotlib(command):
    """A command imports what it runs in Hydra's order (the config's callbacks, then the task) in a fresh process,
    and torchmetrics comes without matplotlib (internals.import_torchmetrics_without_matplotlib: 0.3 s of each
    start-up). It fails when a module imports Lightning or torchmetrics before experiments.internals does."""
    config_name, task = COMMANDS[command]
    code = f"""
import sys
from hydra import compose, initialize_config_dir
from hydra.utils import get_class
from experiments.commands.entry import CONFIG_DIR, load_task
with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
    cfg = compose({config_name!r}, return_hydra_config=True)
for callback in cfg.hydra.callbacks.values():
    get_class(callback._target_)
load_task({task!r})
print("torchmetrics" in sys.modules, sorted(m for m in sys.modules if m.split(".")[0] == "matplotlib"))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[-2] == "True []", f"python {command}.py imports matplotlib: {out.stdout[:300]}"
