import numpy as np
import pytest
import torch

from experiments.config.errors import ConfigError
from experiments.data import FileRegression, SyntheticRegression
from experiments.data.loader import BatchLoader, EpochShuffle
from experiments.training.module import Regressor


def test_synthetic_optimum_equals_numpy_least_squares():
    data = SyntheticRegression(num_samples=300, num_features=5, noise_std=0.3, batch_size=32, seed=3)
    data.setup()
    design = np.hstack([data.x_train.double().numpy(), np.ones((len(data.x_train), 1))])
    solution, *_ = np.linalg.lstsq(design, data.y_train.double().numpy(), rcond=None)
    w, b = data.optimum
    np.testing.assert_allclose(w.numpy(), solution[:-1], rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(b.numpy(), solution[-1], rtol=1e-10, atol=1e-12)
    val_pred = data.x_val.double().numpy() @ solution[:-1] + solution[-1]
    assert data.optimal_val_mse == pytest.approx(np.mean((val_pred - data.y_val.numpy()) ** 2), rel=1e-6)
    # The exact fit recovers the true weights up to the noise.
    assert torch.allclose(w.float(), data.true_weight, atol=0.1)


def test_synthetic_data_is_a_function_of_the_seed():
    a, b, c = (SyntheticRegression(num_samples=100, num_features=4, batch_size=10, seed=s) for s in (0, 0, 1))
    for data in (a, b, c):
        data.setup()
    assert torch.equal(a.x_train, b.x_train) and torch.equal(a.y_val, b.y_val)
    assert not torch.equal(a.x_train, c.x_train)


def _samples(loader: BatchLoader) -> torch.Tensor:
    return torch.cat([x[:, 0] for x, _ in loader])


@pytest.mark.parametrize("batch_size", [8, 16, 48])
def test_epoch_order_does_not_depend_on_world_size_or_batch_size(batch_size):
    x = torch.arange(96.0)[:, None]
    y = x.clone()
    reference = _samples(BatchLoader(x, y, 96, EpochShuffle(96, seed=5)))
    assert not torch.equal(reference, x[:, 0])  # shuffled
    one = _samples(BatchLoader(x, y, batch_size, EpochShuffle(96, seed=5)))
    assert torch.equal(one, reference)
    # Two ranks: rank r holds the r-th half of every global batch; interleaved back they give the order.
    ranks = [list(BatchLoader(x, y, batch_size, EpochShuffle(96, seed=5), rank=r, world_size=2)) for r in (0, 1)]
    assert all(len(xb) == batch_size // 2 for rank in ranks for xb, _ in rank)
    merged = torch.cat([torch.cat([a[0][:, 0], b[0][:, 0]]) for a, b in zip(*ranks, strict=True)])
    assert torch.equal(merged, reference)


def test_each_epoch_has_its_own_order_and_it_is_repeatable():
    shuffle = EpochShuffle(50, seed=0)
    first = shuffle.order()
    shuffle.set_epoch(1)
    second = shuffle.order()
    assert not torch.equal(first, second)
    shuffle.set_epoch(0)
    assert torch.equal(shuffle.order(), first)


def test_training_drops_the_incomplete_batch_and_validation_keeps_it():
    x = torch.zeros(10, 1)
    assert [len(b[0]) for b in BatchLoader(x, x, 4, EpochShuffle(10, 0))] == [4, 4]
    assert [len(b[0]) for b in BatchLoader(x, x, 4, EpochShuffle(10, 0, False), drop_last=False)] == [4, 4, 2]


@pytest.fixture
def csv_file(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.normal(loc=[10, -5, 100], scale=[1, 2, 30], size=(200, 3))
    price = x @ np.array([1.0, -2.0, 0.05]) + 3
    path = tmp_path / "houses.csv"
    rows = [f"{a},{p},{b},{c}" for (a, b, c), p in zip(x, price, strict=True)]
    path.write_text("rooms,price,age,area\n" + "\n".join(rows) + "\n")
    return path, x, price


def test_csv_trains_and_its_checkpoint_predicts_raw_inputs(run_in_process, csv_file):
    path, x, price = csv_file
    metrics, run_dir = run_in_process(
        "data=file", f"data.path={path}", "data.target=price", "data.batch_size=32", "trainer.max_epochs=30"
    )
    assert metrics["status"] == "completed" and metrics["val_r2"] > 0.99
    state = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=False)["state_dict"]
    data = FileRegression(path=str(path), target="price", batch_size=32)
    data.setup()
    torch.testing.assert_close(state["feature_mean"], data.feature_mean)
    torch.testing.assert_close(state["feature_std"], data.feature_std)
    module = Regressor(torch.nn.Linear(3, 1), torch.optim.SGD, state["feature_mean"], state["feature_std"])
    module.load_state_dict(state)
    pred = module.predict_raw(torch.tensor(x[:5], dtype=torch.float32))[:, 0]
    torch.testing.assert_close(pred, torch.tensor(price[:5], dtype=torch.float32), rtol=0.02, atol=0.05)


def test_npz_trains(run_in_process, tmp_path):
    rng = np.random.default_rng(1)
    x = rng.normal(size=(160, 4))
    path = tmp_path / "data.npz"
    np.savez(path, x=x, y=x.sum(axis=1))
    metrics, _ = run_in_process("data=file", f"data.path={path}", "data.batch_size=32", "trainer.max_epochs=20")
    assert metrics["status"] == "completed" and metrics["val_r2"] > 0.99


@pytest.mark.parametrize(
    ("content", "target", "problem"),
    [
        (None, None, "no such file"),
        ("a,b\n1,2\n3,oops\n", None, "line 3, column 'b': 'oops' is not a number"),
        ("a,b\n1,2\n3,\n", None, "line 3, column 'b': missing value"),
        ("a,b,c\n1,2,3\n4,5\n", None, "line 3 has 2 fields"),
        ("a,b\n", None, "no data rows"),
        ("a,b\n1,2\n", "price", "data.target=price"),
    ],
    ids=["missing", "text", "missing-value", "malformed-row", "no-rows", "no-target"],
)
def test_bad_files_name_the_file_and_the_problem(tmp_path, content, target, problem):
    path = tmp_path / "bad.csv"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError, match=problem) as err:
        FileRegression(path=str(path), target=target, batch_size=1).setup()
    assert str(path) in str(err.value) and "\n" not in str(err.value)
