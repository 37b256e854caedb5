"""Every private touch of Lightning, Hydra and torch (experiments.internals) still exists in the installed versions.

An upgrade that removes or renames one fails here, with the touch's name, before any run breaks in its middle.
"""

import re
from pathlib import Path

import pytest

from experiments import internals


@pytest.mark.parametrize("name, still_there", internals.TOUCHES, ids=[name for name, _ in internals.TOUCHES])
def test_the_private_touch_is_still_there(name, still_there):
    assert still_there(), f"the installed Lightning or Hydra no longer has {name} (see experiments/internals.py)"


def test_no_module_but_internals_touches_a_private_name():
    """The touches stay behind one door: the private names of internals.py appear in no other module."""
    src = Path(internals.__file__).parent
    private = ["_logger_connector", "_should_accumulate", "_combined_loader", "_hydra_subprocess_cmd",
               "_PRECISION_INPUT", "_normalize_parse_gpu_string_input", "_start_method", "_return_value",
               "_batches_that_stepped", "_every_n_train_steps", "_val_check_time_interval", "_prefix",
               "_get_file_writer", "_add_prefix", "_verify_loop_configurations", "_python_dispatch",
               "_broadcast_sigterm_tensor", "_checkpoint_connector"]  # fmt: skip
    found = [
        f"{path.relative_to(src)}: {name}"
        for path in src.rglob("*.py")
        if path.name != "internals.py"
        for name in private
        if re.search(rf"(?<!\w){name}\b", path.read_text())
    ]
    assert found == []
