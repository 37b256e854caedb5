"""Synthetic data with a known answer for a model that is not linear: a random teacher network plus noise."""

from functools import cached_property

import torch

from experiments.data.datamodule import RegressionData
from experiments.models.mlp import MLP, linear_layers

CHUNK_ROWS = 4096  # the teacher labels the samples this many at a time: its widest layer's activations stay small


class TeacherRegression(RegressionData):
    """`y = f(X) + noise` with X ~ N(0, 1), f an MLP of widths `teacher_hidden` whose weights are drawn from the seed
    (He-scaled, so that each layer keeps its inputs' scale, the last one scaled so that f(X) has unit variance).

    The reference is the teacher itself: `optimal_val_mse` is its MSE on the validation split (the noise's, about
    noise_std**2), the best any model can do. There is no least-squares optimum to measure weights against
    (`optimum` None: metrics.json's optimum_distance is null).
    """

    optimum = None

    def __init__(
        self,
        num_samples: int = 40960,
        num_features: int = 100,
        num_targets: int = 1,
        teacher_hidden=(256, 256),
        teacher_activation: str = "gelu",
        noise_std: float = 0.1,
        val_fraction: float = 0.2,
        batch_size: int = 256,
        seed: int = 0,
        on_device: bool | str = "auto",
        pin_memory: bool | str = "auto",
    ):
        super().__init__(batch_size, val_fraction, seed, standardize=False, on_device=on_device, pin_memory=pin_memory)
        self.num_samples, self.features, self.num_targets = num_samples, num_features, num_targets
        self.teacher_hidden, self.teacher_activation = list(teacher_hidden), teacher_activation
        self.noise_std = noise_std

    def load(self) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(self.seed)
        x = torch.randn(self.num_samples, self.features, generator=generator)
        self.teacher = teacher = MLP(self.features, self.num_targets, self.teacher_hidden, self.teacher_activation)
        layers = linear_layers(teacher)
        with torch.no_grad():
            for i, layer in enumerate(layers):
                gain = 2.0 if i < len(layers) - 1 else 1.0
                weight = torch.randn(layer.weight.shape, generator=generator)
                layer.weight.copy_(weight * (gain / layer.in_features) ** 0.5)
                layer.bias.copy_(0.1 * torch.randn(layer.bias.shape, generator=generator))
            signal = self._label(x)
            scale = signal.std(0).clamp_min(1e-12)
            layers[-1].weight /= scale[:, None]
            layers[-1].bias /= scale
        noise = self.noise_std * torch.randn(self.num_samples, self.num_targets, generator=generator)
        return x, self._label(x) + noise

    @torch.no_grad()
    def _label(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.teacher(rows) for rows in x.split(CHUNK_ROWS)])

    @cached_property
    def optimal_val_mse(self) -> float:
        x_val, y_val = self.x_val.cpu(), self.y_val.cpu()
        return torch.mean((self._label(x_val).double() - y_val.double()) ** 2).item()
