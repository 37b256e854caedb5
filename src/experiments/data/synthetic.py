"""Synthetic regression data with a known answer."""

import torch

from experiments.data.datamodule import RegressionData


class SyntheticRegression(RegressionData):
    """`y = X w* + b* + noise` with X ~ N(0, 1) and known true weights, all drawn from the seed."""

    def __init__(
        self,
        num_samples: int = 40960,
        num_features: int = 100,
        num_targets: int = 1,
        noise_std: float = 0.1,
        val_fraction: float = 0.2,
        batch_size: int = 256,
        seed: int = 0,
        on_device: bool | str = "auto",
        pin_memory: bool | str = "auto",
    ):
        super().__init__(batch_size, val_fraction, seed, standardize=False, on_device=on_device, pin_memory=pin_memory)
        self.num_samples = num_samples
        self.features = num_features
        self.num_targets = num_targets
        self.noise_std = noise_std

    def load(self) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(self.seed)
        x = torch.randn(self.num_samples, self.features, generator=generator)
        # Unit-variance signal whatever the width: w* ~ N(0, 1/d).
        self.true_weight = torch.randn(self.features, self.num_targets, generator=generator) / self.features**0.5
        self.true_bias = torch.randn(self.num_targets, generator=generator)
        noise = self.noise_std * torch.randn(self.num_samples, self.num_targets, generator=generator)
        return x, x @ self.true_weight + self.true_bias + noise

