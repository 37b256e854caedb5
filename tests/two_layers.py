"""A model that is not one Linear, for runs from the command line (`model._target_=two_layers.TwoLayers`, tests/ on
the PYTHONPATH): the study compares its final weights as it compares the seed's (test_study.py)."""

import torch


class TwoLayers(torch.nn.Sequential):
    def __init__(self, in_features: int, out_features: int, bias: bool = True, hidden: int = 4):
        layers = (
            torch.nn.Linear(in_features, hidden, bias),
            torch.nn.Tanh(),
            torch.nn.Linear(hidden, out_features, bias),
        )
        super().__init__(*layers)
