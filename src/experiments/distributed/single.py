"""`strategy=single`: exactly one device, whichever accelerator the Trainer picks."""

from lightning.pytorch.strategies import SingleDeviceStrategy


class SingleDevice(SingleDeviceStrategy):
    """Exactly one device: the first of the accelerator the Trainer picks (CPU, CUDA or MPS).

    Lightning's registered `strategy="single_device"` is built with its default `device="cpu"`, which fails
    on a GPU; `strategy="auto"` finds the right device but turns into DDP when `devices` > 1.
    """

    def __init__(self):
        super().__init__(device="cpu")  # replaced as soon as the Trainer sets the accelerator

    @property
    def accelerator(self):
        return self._accelerator

    @accelerator.setter
    def accelerator(self, accelerator) -> None:
        self._accelerator = accelerator
        if accelerator is not None:
            self._root_device = accelerator.get_parallel_devices(accelerator.parse_devices(1))[0]
