"""The data sources of `conf/data/`: their `_target_`s (and those stored in checkpoints) name them here."""

from experiments.data.files import FileRegression
from experiments.data.synthetic import SyntheticRegression
from experiments.data.teacher import TeacherRegression

__all__ = ["FileRegression", "SyntheticRegression", "TeacherRegression"]
