"""A multilayer perceptron: the model family that computes (conf/model/mlp.yaml), beside the seed's Linear.

A plain `nn.Module`, as the seed's Linear is: the LightningModule (experiments.training.module) composes it and owns
the loss, the optimizer and the metrics. Its constructor is the config's keys, one to one.
"""

from torch import nn

from experiments.models import ACTIVATIONS

# model.activation: the names a user types, and the layers they build.
LAYERS = dict(zip(ACTIVATIONS, (nn.ReLU, nn.GELU, nn.Tanh, nn.SiLU), strict=True))


class MLP(nn.Sequential):
    """Linear layers of widths `hidden`, each followed by `activation`, then a Linear to `out_features`.

    `MLP(100, 1, hidden=[1024, 1024])` is Linear(100, 1024), GELU, Linear(1024, 1024), GELU, Linear(1024, 1). Its
    weights start as torch's Linear layers start (seeded by the run's seed).
    """

    def __init__(
        self, in_features: int, out_features: int = 1, hidden=(1024, 1024), activation: str = "gelu", bias: bool = True
    ):
        widths = [in_features, *hidden]
        layers: list[nn.Module] = []
        for width_in, width_out in zip(widths, widths[1:], strict=False):
            layers += [nn.Linear(width_in, width_out, bias=bias), LAYERS[activation]()]
        layers.append(nn.Linear(widths[-1], out_features, bias=bias))
        super().__init__(*layers)


def linear_layers(net: nn.Module) -> list[nn.Linear]:
    """The model's Linear layers, in order: what its FLOPs, width and depth are counted from, whatever its class."""
    return [m for m in net.modules() if isinstance(m, nn.Linear)]


def shape(net: nn.Module) -> dict[str, int]:
    """`depth` (hidden layers: Linear layers less the output one; 0 for the seed's Linear), `width` (the widest
    hidden layer; 0 without one) and `params` (every parameter of the model)."""
    hidden = [layer.out_features for layer in linear_layers(net)[:-1]]
    return {"depth": len(hidden), "width": max(hidden, default=0), "params": sum(p.numel() for p in net.parameters())}


def train_flops_per_sample(net: nn.Module) -> int:
    """Floating-point operations of one training sample: 6 per weight and bias of each Linear layer (2 in the
    forward pass, 4 in the backward: the input's gradient and the weight's), the usual count for dense layers;
    activations, the loss and the update are left out (a few per parameter or unit, against 6 x the fan-in)."""
    return 6 * sum(p.numel() for layer in linear_layers(net) for p in layer.parameters())
