"""The study (scripts/study.py, experiments.study): its claims as records whose sweeps exist, every claim's analysis on
a small real sweep, model-agnostic final weights, docs/study.md's sections replaced one claim at a time."""

import re
import subprocess

import pytest
import torch
from conftest import ROOT, cli, compose_config, python, with_tests_on_path

from experiments.study import document, memory, speed
from experiments.study.claims import CLAIMS, NAMES
from experiments.sweeps.figures import fmt, markdown_table
from experiments.sweeps.record import Job, find_jobs

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
EXPERIMENTS = ROOT / "conf" / "experiment"
LINEAR, TWO_LAYERS = "torch.nn.Linear", "two_layers.TwoLayers"  # tests/two_layers.py


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """Two batch sizes x two accumulation settings x the seed's Linear and a model of two layers: eight jobs on one
    CPU."""
    sweep_dir = tmp_path_factory.mktemp("study") / "sweep"
    overrides = [
        "data.batch_size=32,64",
        "trainer.accumulate_grad_batches=1,2",
        f"model._target_={LINEAR},{TWO_LAYERS}",
    ]
    done = cli(*overrides, f"hydra.sweep.dir={sweep_dir}", "-m", env=with_tests_on_path())
    assert done.returncode == 0, done.stderr[-3000:]
    return find_jobs(sweep_dir)


@pytest.fixture(scope="module")
def fit_sweep(tmp_path_factory):
    """batch.effective=128 with the default budget and 1 MiB: the jobs of claim g's sweeps."""
    sweep_dir = tmp_path_factory.mktemp("study") / "fit"
    done = cli("batch.effective=128", "batch.memory_mb=null,1", f"hydra.sweep.dir={sweep_dir}", "-m")
    assert done.returncode == 0, done.stderr[-3000:]
    return find_jobs(sweep_dir)


def of_model(jobs, target: str):
    return [j for j in jobs if j.settings["model._target_"] == target]


def test_every_claim_names_experiments_that_compose_and_an_analysis():
    assert len(set(NAMES)) == len(NAMES) and all(re.fullmatch(r"\w+", name) for name in NAMES)  # the markers' names
    sweeps = [sweep for claim in CLAIMS for sweep in claim.sweeps]
    assert len({sweep.name for sweep in sweeps}) == len(sweeps)  # each its own dir under outputs/study/<time>/
    for claim in CLAIMS:
        assert claim.sweeps and claim.analysis.__module__.startswith("experiments.study.")
        assert bool(claim.min_gpus) == bool(claim.short_of_gpus)
        for sweep in claim.sweeps:
            pattern = re.fullmatch(r"glob\((.*)\)", sweep.experiment)
            files = sorted(EXPERIMENTS.glob(f"{pattern.group(1) if pattern else sweep.experiment}.yaml"))
            assert files and all(f.stem.startswith("study_") for f in files), (claim.name, sweep.experiment)
            for f in files:  # every key of the experiment exists in the config it overrides
                assert compose_config(f"experiment={f.stem}", tiny=False).data.num_samples > 0


def test_every_claim_analyses_a_small_sweep_into_its_section(sweep, fit_sweep, tmp_path):
    """Each record's analysis on real jobs (its sweeps' jobs, one list a sweep); the sections it writes are the
    file's, in the records' order, and read back by their markers."""
    linear = of_model(sweep, LINEAR)
    new = {}
    for claim in CLAIMS:
        jobs = fit_sweep if claim.name == "batch_fit" else linear
        out = tmp_path / "study" / claim.name
        found = claim.analysis([jobs] * len(claim.sweeps), out)
        assert found.sections and found.lines and "GPU" in found.verified, claim.name
        for plot in (s.plot for s in found.sections if s.plot):
            assert plot.parent == out and plot.read_bytes()[:8] == PNG_SIGNATURE
        results = [(jobs, f"python train.py -m {' '.join(s.overrides)}") for s in claim.sweeps]
        new[claim.name] = document.render_claim(claim, results, found, tmp_path, "From the run of now.")
        assert new[claim.name].startswith(f"## {claim.title}\n\nThe seed: *{claim.seed}*\n")
    text = document.splice("", dict(reversed(new.items())))
    assert list(document.sections_of(text)) == NAMES
    assert document.sections_of(text) == {name: section.strip() for name, section in new.items()}


def test_study_conclusions_come_from_the_numbers(sweep, tmp_path):
    jobs = of_model(sweep, LINEAR)
    # 2 x 32 and 1 x 64: one effective batch of 64, accumulated or not
    pair = [j for j in jobs if j.metrics["effective_batch_size"] == 64]
    sections, lines, verified = memory.accumulation([pair, pair], tmp_path)
    assert sections[0].plot.is_file() and "**GPU: unverified**" in verified
    relative = float(re.search(r"final weights differ by (\S+) \(relative\)", lines[0]).group(1))
    assert relative < 1e-5  # the same maths: only float summation order differs
    table = markdown_table(sections[0].columns, sections[0].rows)
    assert all(fmt(j.metrics["samples_per_sec"]) in table for j in pair)

    _, lines, _ = speed.throughput([jobs], tmp_path)
    best = max(j.metrics["samples_per_sec"] for j in jobs if j.metrics["accumulate_grad_batches"] == 1)
    assert f"the most, {best:.3g} samples/s" in " ".join(lines)


def test_larger_models_are_compared_by_their_step_and_their_share_of_the_matmul_rate(sweep, tmp_path):
    """Claim h on the Linear and the model of two layers (accumulation 1 only): one row a model and batch, the
    smaller model first; mfu is 6 x parameters x samples/s over the measured rate; one line a batch."""
    jobs = [j for j in sweep if j.metrics["accumulate_grad_batches"] == 1]
    (section,), lines, verified = speed.model_size([jobs], tmp_path)
    assert [(r["model"], r["global_batch_size"]) for r in section.rows] == [
        ("Linear", 32), ("TwoLayers", 32), ("Linear", 64), ("TwoLayers", 64)
    ]  # fmt: skip
    for row in section.rows:
        m = next(j.metrics for j in jobs if j.settings["model._target_"].endswith(row["model"])
                 and j.metrics["global_batch_size"] == row["global_batch_size"])  # fmt: skip
        assert row["mfu"] == pytest.approx(6 * m["model_params"] * m["samples_per_sec"] / 1e12 / m["peak_tflops"])
    assert len(lines) == 2 and section.plot.read_bytes()[:8] == PNG_SIGNATURE
    for line, (small, large) in zip(lines, (section.rows[:2], section.rows[2:]), strict=True):
        ratio = large["step_time_ms"] / small["step_time_ms"]
        assert f"({ratio:.3g}x), compute {small['compute_pct']:.3g}%" in line
        assert f"{small['step_time_ms']:.3g} ms a step" in line
        assert ("from TwoLayers on" in line) == (ratio >= 2)
    assert "**GPU: unverified**" in verified


def test_final_weights_are_every_tensor_of_the_model_whatever_its_layers(sweep, tmp_path):
    """A model of two layers has four tensors, not a Linear's weight and bias: accumulation compares them all the same;
    two jobs of different models are refused, not compared."""
    layers = [j for j in of_model(sweep, TWO_LAYERS) if j.metrics["effective_batch_size"] == 64]
    weights = memory.final_weights(layers[0])
    assert list(weights) == ["net.0.weight", "net.0.bias", "net.2.weight", "net.2.bias"]
    assert all(w.dtype == torch.float64 for w in weights.values())
    _, lines, _ = memory.accumulation([layers, layers], tmp_path)
    assert float(re.search(r"final weights differ by (\S+) \(relative\)", lines[0]).group(1)) < 1e-5
    linear = next(j for j in of_model(sweep, LINEAR) if j.metrics["effective_batch_size"] == 64)
    assert memory.weights_apart(linear, linear) == 0
    with pytest.raises(ValueError, match="trained different models"):
        memory.weights_apart(layers[0], linear)


def test_only_one_claim_replaces_its_section_and_keeps_the_others():
    """`study.py --only batch`: the file's other sections stay byte for byte, in their order, under a header that
    says the sections may come from different runs."""
    old = (ROOT / "docs" / "study.md").read_text()
    before = document.sections_of(old)
    assert list(before) == NAMES  # every claim, in order, between its markers
    batch = f"## {CLAIMS[NAMES.index('batch')].title}\n\nFrom the run of today.\n\nnew figures"
    new = document.splice(old, {"batch": batch})
    assert document.sections_of(new) == before | {"batch": batch}
    assert all(before[claim] in new for claim in NAMES if claim != "batch")
    assert new.startswith(document.HEADER) and new.count("# The seed's advice, measured") == 1
    assert document.splice(new, {"batch": before["batch"]}) == document.splice(old, {}) == old  # the same file back
    # A file with one claim only (another --out) gains the next one, in the order of the claims.
    one = document.splice("", {"target": "## (f)"})
    assert list(document.sections_of(document.splice(one, {"batch": batch}))) == ["batch", "target"]


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="with two GPUs the claim runs its own sweeps")
def test_without_two_gpus_the_scaling_claim_runs_no_sweep_and_points_to_the_one_ddp_measurement(tmp_path):
    """DDP on a CPU is measured once (benchmarks.md, `benchmark.py --ddp`): the study's section d neither runs nor
    shows a second, shorter measurement that could contradict it."""
    studies = sorted((ROOT / "outputs").glob("study/*"))
    command = [python(), "scripts/study.py", "--only", "scaling", "--out", str(tmp_path / "study.md")]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout == f"{tmp_path / 'study.md'}\n"  # no sweep's line
    assert sorted((ROOT / "outputs").glob("study/*")) == studies  # no sweep dir
    sections = document.sections_of((tmp_path / "study.md").read_text())
    assert list(sections) == ["scaling"]
    assert (
        "(benchmarks.md#ddp-on-cpu)" in sections["scaling"]
        and "python scripts/benchmark.py --ddp" in sections["scaling"]
    )
    assert not re.search(r"\d ?(ms|x)\b|samples/s", sections["scaling"])  # no figure of its own


def test_a_section_whose_markers_do_not_pair_is_refused():
    broken = document.splice("", {"batch": "## (b)"}).replace("<!-- study:batch end -->", "")
    with pytest.raises(ValueError, match="markers"):
        document.splice(broken, {"target": "## (f)"})
    with pytest.raises(ValueError, match="known claims"):
        document.sections_of("<!-- study:nothing begin -->\n## (z)\n<!-- study:nothing end -->\n")


def test_each_section_says_how_many_repeats_stand_behind_it(tmp_path):
    def job(num, seed, batch):
        settings = {"seed": str(seed), "data.seed": str(seed), "data.batch_size": str(batch)}
        metrics = {"status": "completed", "samples_per_sec": 1.0, "step_time_ms": 1.0}
        return Job(tmp_path / str(num), num, [], "completed", metrics=metrics, settings=settings)

    repeated = [job(n, seed, batch) for n, (seed, batch) in enumerate((s, b) for s in range(3) for b in (64, 128))]
    once = [job(0, 0, 64), job(1, 0, 128)]
    three = "3 repeats per configuration (seeds), each speed their median"
    assert document.repeats_line([(repeated, "")]) == f"Repeats: {three}."
    assert document.repeats_line([(once, ""), (repeated, "")]) == (
        f"Repeats: sweep 1, one job per configuration, no repeats; sweep 2, {three}."
    )
