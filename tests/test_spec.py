"""Loading training files: the contract's names, plain-Python import semantics, and bad input."""

import pickle
import sys

import pytest
import torch
from conftest import MLP_FILE

from fp16doctor.config import build_config
from fp16doctor.engine.probe import Workbench
from fp16doctor.errors import BatchError, TrainingFileError
from fp16doctor.userfile.spec import build_model, draw_batches, load_training_file


def test_loads_the_contract_names(training_file):
    spec = load_training_file(training_file(MLP_FILE))
    assert spec.loss is None and spec.train_step is None and spec.config == {}
    assert isinstance(build_model(spec), torch.nn.Module)


def test_loading_keeps_the_files_imports_and_registers_it_by_name(training_file, tmp_path):
    """As `python -c "import train_me"` would: nothing the file imported is removed again (a lazily
    imported library imported twice breaks: torch._dynamo's operator library, transformers)."""
    (tmp_path / "helper_mod_for_spec_test.py").write_text("WIDTH = 8\n")
    path = training_file("import colorsys\nimport helper_mod_for_spec_test\n" + MLP_FILE)
    spec = load_training_file(path)
    assert sys.modules["train_me"] is spec.module and spec.module.__name__ == "train_me"
    assert sys.modules["helper_mod_for_spec_test"] is spec.module.helper_mod_for_spec_test  # still imported
    assert "colorsys" in sys.modules and str(tmp_path.resolve()) in sys.path
    assert spec.module.helper_mod_for_spec_test.WIDTH == 8


def test_classes_defined_in_the_file_pickle(training_file):
    """DataLoader workers and torch.save of whole objects pickle the file's classes by module name."""
    spec = load_training_file(
        training_file(MLP_FILE + "\nclass Pairs:\n    def __init__(self, n):\n        self.n = n\n")
    )
    copy = pickle.loads(pickle.dumps(spec.module.Pairs(3)))
    assert type(copy) is spec.module.Pairs and copy.n == 3


def test_a_file_named_like_another_module_does_not_shadow_it(training_file):
    path = training_file(MLP_FILE, name="json.py")
    spec = load_training_file(path)
    assert (
        spec.module.__name__ != "json"
        and sys.modules["json"].__name__ == "json"
        and hasattr(sys.modules["json"], "dumps")
    )


def test_a_broken_file_is_not_left_registered(training_file):
    with pytest.raises(TrainingFileError):
        load_training_file(training_file("import torch\nX = 1 / 0\n", name="broken_for_spec_test.py"))
    assert "broken_for_spec_test" not in sys.modules


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


@pytest.mark.parametrize(
    "source,missing", [("def data():\n    return []\n", "model()"), ("def model():\n    pass\n", "data()")]
)
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
    spec = load_training_file(
        training_file(
            f"import torch\ndef model():\n    return torch.nn.Linear(2, 2)\ndef data():\n    return [{batch}]\n"
        )
    )
    with pytest.raises(BatchError):
        draw_batches(spec, 1)


def test_short_data_is_cycled_and_copied(training_file):
    spec = load_training_file(training_file(MLP_FILE))
    batches = draw_batches(spec, 10)
    assert len(batches) == 10 and torch.equal(batches[6][0], batches[0][0])


def test_non_scalar_loss_is_bad_input(training_file):
    source = (
        MLP_FILE
        + "\nimport torch.nn.functional as F\ndef loss(model, batch):\n    return F.cross_entropy(model(batch[0]), batch[1], reduction='none')\n"
    )
    spec = load_training_file(training_file(source))
    bench = Workbench(spec, build_config({"steps": 2, "device": "cpu"}))
    with pytest.raises(TrainingFileError, match="scalar"):
        bench.probe("fp32").run()


def test_batch_without_default_loss_asks_for_loss(training_file):
    source = (
        "import torch\ndef model():\n    return torch.nn.Linear(4, 2)\ndef data():\n    return [torch.randn(3, 4)]\n"
    )
    bench = Workbench(load_training_file(training_file(source)), build_config({"steps": 1, "device": "cpu"}))
    with pytest.raises(BatchError, match="loss"):
        bench.probe("fp32").run()


def test_a_files_module_level_counters_are_put_back_in_place_and_only_its_own(tmp_path):
    """Counters the file's top level assigns are put back before each probe: a dict in place (another name for it
    and a default argument bound to it see the reset), an empty list too; a NaN nothing changed and a name the
    file imports are no change to note."""
    from fp16doctor.userfile.spec import load_training_file

    path = tmp_path / "counters.py"
    path.write_text(
        "from math import nan\n"
        "import torch\n"
        "_micro = {'i': 0}\n"
        "STATE = _micro\n"
        "seen = []\n"
        "best = float('nan')\n"
        "def bump(c=_micro):\n"
        "    c['i'] += 1\n"
        "    seen.append(c['i'])\n"
        "def model():\n"
        "    return torch.nn.Linear(2, 2)\n"
        "def data():\n"
        "    return [torch.ones(1, 2)]\n"
    )
    spec = load_training_file(path)
    spec.reset_file_state()  # the first probe: what it finds is kept
    spec.module.bump()
    spec.module.bump()
    spec.reset_file_state()
    module = spec.module
    assert module._micro == {"i": 0} and module.STATE is module._micro and module.seen == []
    module.bump()
    assert module._micro == {"i": 1}  # the default argument is the same dict, reset
    notes = [n for n in spec.notes if "module-level" in n]
    assert len(notes) == 1 and "_micro" in notes[0] and "seen" in notes[0]
    assert "best" not in notes[0] and "nan" not in notes[0].replace("changed", "")
