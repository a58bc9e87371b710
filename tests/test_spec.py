"""Loading training files: the contract's names, isolation, and bad input."""

import sys

import pytest
import torch

from conftest import MLP_FILE
from fp16doctor.config import build_config
from fp16doctor.errors import BatchError, TrainingFileError
from fp16doctor.probe import Workbench
from fp16doctor.spec import build_model, draw_batches, load_training_file


def test_loads_the_contract_names(training_file):
    spec = load_training_file(training_file(MLP_FILE))
    assert spec.loss is None and spec.train_step is None and spec.config == {}
    assert isinstance(build_model(spec), torch.nn.Module)


def test_import_leaves_sys_path_and_modules_as_they_were(training_file, tmp_path):
    (tmp_path / "helper_mod_for_test.py").write_text("WIDTH = 8\n")
    path = training_file("import json, colorsys\nimport helper_mod_for_test\n" + MLP_FILE)
    path_before, modules_before = list(sys.path), set(sys.modules)
    spec = load_training_file(path)
    assert sys.path == path_before
    assert set(sys.modules) == modules_before
    assert spec.module.helper_mod_for_test.WIDTH == 8  # the sibling import itself worked


def test_missing_file():
    with pytest.raises(TrainingFileError, match="does not exist"):
        load_training_file("no/such/file.py")


def test_syntax_error_points_at_the_line(training_file):
    path = training_file("import torch\n\ndef model(:\n    pass\n")
    with pytest.raises(TrainingFileError) as info:
        load_training_file(path)
    assert "syntax error" in info.value.message and info.value.location.endswith(":3")


def test_error_at_import_points_at_the_users_line(training_file):
    path = training_file("import torch\nX = 1 / 0\n")
    with pytest.raises(TrainingFileError) as info:
        load_training_file(path)
    assert "ZeroDivisionError" in info.value.message and info.value.location.endswith(":2")


@pytest.mark.parametrize("source,missing", [("def data():\n    return []\n", "model()"), ("def model():\n    pass\n", "data()")])
def test_missing_required_function(training_file, source, missing):
    with pytest.raises(TrainingFileError, match=missing.replace("(", r"\(").replace(")", r"\)")):
        load_training_file(training_file(source))


def test_model_must_return_a_module(training_file):
    spec = load_training_file(training_file("def model():\n    return 3\n\ndef data():\n    return []\n"))
    with pytest.raises(TrainingFileError, match="not a torch.nn.Module"):
        build_model(spec)


def test_empty_data(training_file):
    spec = load_training_file(training_file(MLP_FILE.replace("for _ in range(6)]", "for _ in range(0)]")))
    with pytest.raises(TrainingFileError, match="no batches"):
        draw_batches(spec, 3)


@pytest.mark.parametrize("batch", ["'text'", "3", "[1, 2]"])
def test_unsupported_batch_type(training_file, batch):
    spec = load_training_file(training_file(f"import torch\ndef model():\n    return torch.nn.Linear(2, 2)\ndef data():\n    return [{batch}]\n"))
    with pytest.raises(BatchError):
        draw_batches(spec, 1)


def test_short_data_is_cycled_and_copied(training_file):
    spec = load_training_file(training_file(MLP_FILE))
    batches = draw_batches(spec, 10)
    assert len(batches) == 10 and torch.equal(batches[6][0], batches[0][0])


def test_non_scalar_loss_is_bad_input(training_file):
    source = MLP_FILE + "\nimport torch.nn.functional as F\ndef loss(model, batch):\n    return F.cross_entropy(model(batch[0]), batch[1], reduction='none')\n"
    spec = load_training_file(training_file(source))
    bench = Workbench(spec, build_config({"steps": 2, "device": "cpu"}))
    with pytest.raises(TrainingFileError, match="scalar"):
        bench.probe("fp32").run()


def test_batch_without_default_loss_asks_for_loss(training_file):
    source = "import torch\ndef model():\n    return torch.nn.Linear(4, 2)\ndef data():\n    return [torch.randn(3, 4)]\n"
    bench = Workbench(load_training_file(training_file(source)), build_config({"steps": 1, "device": "cpu"}))
    with pytest.raises(BatchError, match="loss"):
        bench.probe("fp32").run()


def test_the_files_imports_are_back_in_place_while_its_code_runs(training_file, tmp_path):
    """A lazily importing library must find its own package while the user's code runs (no second copy)."""
    (tmp_path / "lazy_helper_for_test.py").write_text("import sys\nWIDTH = 8\ndef me():\n    return sys.modules.get(__name__)\n")
    path = training_file(
        "import torch\nimport lazy_helper_for_test as helper\n\n"
        "def model():\n    assert helper.me() is helper   # its module object is the one in sys.modules\n"
        "    import lazy_helper_for_test\n    assert lazy_helper_for_test is helper\n"
        "    return torch.nn.Linear(helper.WIDTH, 2)\n\n"
        "def data():\n    import lazy_helper_for_test\n    assert lazy_helper_for_test is helper\n"
        "    yield (torch.randn(3, 8), torch.tensor([0, 1, 0]))\n"
    )
    before = set(sys.modules)
    spec = load_training_file(path)
    assert isinstance(build_model(spec), torch.nn.Module)
    assert len(draw_batches(spec, 2)) == 2
    assert set(sys.modules) == before  # and gone again between calls
