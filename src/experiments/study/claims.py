"""The study's claims as data: one record a claim, in the order of docs/study.md's sections.

A claim is the seed's sentence (shared/seed/, in Chinese; here in English), the sweeps that measure it (each a
Hydra multirun of conf/experiment/study_*.yaml) and the analysis that turns their jobs into tables, plots and
conclusions (experiments.study.speed, experiments.study.memory). scripts/study.py runs a record's sweeps, hands
their jobs to its analysis and writes its section (experiments.study.document). To add a claim, add one record
here: its analysis is a function `(jobs of each sweep, plot dir) -> Findings` of its own.
"""

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from experiments.study import memory, speed
from experiments.study.findings import Findings
from experiments.sweeps.record import Job


@dataclass(frozen=True)
class Sweep:
    """`python train.py -m OVERRIDES`, in outputs/study/<time>/<name>/."""

    name: str
    overrides: tuple[str, ...]  # as typed: Hydra's basic sweeper varies the first swept setting slowest
    gpu_overrides: tuple[str, ...] = ()  # added where CUDA is

    @property
    def experiment(self) -> str:
        """The value of its `experiment=` override: conf/experiment/<it>.yaml, or a glob() of them."""
        return next(o.split("=", 1)[1] for o in self.overrides if o.startswith("experiment="))


@dataclass(frozen=True)
class Claim:
    name: str  # its markers in docs/study.md (<!-- study:NAME begin -->) and `--only NAME`
    title: str
    seed: str  # what the seed says
    sweeps: tuple[Sweep, ...]
    analysis: Callable[[list[list[Job]], Path], Findings]  # the jobs of each sweep, in order; the plot dir
    min_gpus: int = 0  # with fewer GPUs no sweep runs and `short_of_gpus` is the section
    short_of_gpus: str = ""  # a section's markdown; {title}, {seed} and {gpus} are filled in


# With fewer than two GPUs the study runs no sweep of its own for claim d: DDP on a CPU has one account, the
# benchmark's (whole processes, an expert's raw DDP loop beside it, the all-reduce timed alone), which a 60-step
# sweep here would only contradict.
CPU_SCALING = """## {title}

The seed: *{seed}*

GPUs on the machine that wrote this: {gpus}, so no DataParallel here, nor DDP across GPUs. DDP on a CPU (two processes
over gloo) is measured once, in [benchmarks.md](benchmarks.md#ddp-on-cpu) (`python scripts/benchmark.py --ddp`): one
process, `trainer.devices=2` and an expert's raw DDP loop side by side at a small and a large batch, per step from
whole processes, with a gloo all_reduce of the seed's gradients timed alone, which says when two CPU processes pay
and when they cannot.

CPU: DDP measured in benchmarks.md. **GPU: unverified**: DataParallel needs CUDA, and DDP across GPUs needs two
(`scripts/gpu_check.sh` times DDP x2 against raw DDP x2 over NCCL where two are present; `python scripts/study.py
--only scaling` runs this claim's sweeps there).
"""

GPU = ("trainer.accelerator=gpu",)

CLAIMS = (
    Claim(
        name="transfer",
        title="(a) Host-to-device transfer overhead",
        seed="Moving data from the CPU to the GPU has a cost: small models or small batches may see no clear "
        "speed-up; larger models and data gain more.",
        sweeps=(
            Sweep(
                "transfer", ("experiment=study_transfer",), ("trainer.accelerator=cpu,gpu", "data.on_device=false,true")
            ),
        ),
        analysis=speed.transfer,
    ),
    Claim(
        name="batch",
        title="(b) Batch size and throughput",
        seed="Use batches as far as possible, to make the most of the GPU's parallel computation.",
        sweeps=(Sweep("batch", ("experiment=study_batch",), (*GPU, "data.num_features=1000")),),
        analysis=speed.throughput,
    ),
    Claim(
        name="memory",
        title="(c) Memory and batch size",
        seed="GPU memory is limited: manage it so that it does not overflow.",
        sweeps=(Sweep("memory", ("experiment=study_memory",), GPU),),
        analysis=memory.memory_by_batch,
    ),
    Claim(
        name="scaling",
        title="(d) One device, DataParallel and DDP",
        seed="PyTorch can compute in parallel on several GPUs, with torch.nn.DataParallel or "
        "torch.nn.parallel.DistributedDataParallel.",
        sweeps=(
            Sweep("scaling", ("experiment=study_scaling",), GPU),
            Sweep("scaling-dp", ("experiment=study_scaling", "strategy=dp"), GPU),
        ),
        analysis=speed.scaling,
        min_gpus=2,
        short_of_gpus=CPU_SCALING,
    ),
    Claim(
        name="accumulation",
        title="(e) Gradient accumulation",
        seed="Accumulating the gradients of several small batches before one parameter update relieves the pressure "
        "on GPU memory.",
        sweeps=(
            # in a process of its own per job (the experiment's launcher): each job's own peak memory
            Sweep(
                "accumulation-memory", ("experiment=glob(study_accumulation_b*)", "hydra/launcher=submitit_local"), GPU
            ),
            # one after another in one process: throughput without neighbours
            Sweep("accumulation-speed", ("seed=0,1,2", "experiment=glob(study_accumulation_b*)"), GPU),
        ),
        analysis=memory.accumulation,
    ),
    Claim(
        name="target",
        title="(f) Time to target against batch size and accumulation",
        seed="(not the seed's: what a user wants from faster training) Time to reach a given quality, against batch "
        "size and accumulation.",
        sweeps=(Sweep("target", ("experiment=study_target",), GPU),),
        analysis=speed.time_to_target,
    ),
    Claim(
        name="batch_fit",
        title="(g) The largest micro-batch that fits, accumulated to the effective batch",
        seed="(its advice on memory and on accumulation, as one option) At a fixed effective batch, the micro-batch "
        "trades memory against speed: batch.effective=E picks the largest whose step fits the budget.",
        # On a GPU the 160 MiB of data stays on the host: the budgets are for the step alone.
        sweeps=(
            Sweep(
                "batch_fit-memory",
                ("experiment=study_batch_fit", "hydra/launcher=submitit_local"),
                (*GPU, "data.on_device=false"),
            ),
            Sweep("batch_fit-speed", ("seed=0,1,2", "experiment=study_batch_fit"), (*GPU, "data.on_device=false")),
        ),
        analysis=memory.largest_micro_batch,
    ),
    Claim(
        name="models",
        title="(h) Larger models gain more",
        seed="Small models or small batches may see no clear speed-up; larger models and data gain more.",
        sweeps=(
            Sweep("models-linear", ("experiment=study_models",), GPU),
            Sweep(
                "models-mlp",
                ("experiment=study_models", "model=mlp", "model.hidden=[256,256],[1024,1024],[4096,4096]"),
                GPU,
            ),
        ),
        analysis=speed.model_size,
    ),
)
NAMES = [claim.name for claim in CLAIMS]
