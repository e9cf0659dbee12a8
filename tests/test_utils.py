import random
from pathlib import Path

import attnbook
import numpy as np
import pytest
import torch
from attnbook import causal_mask, device, seed_everything, show_source
from attnbook import utils as attnbook_utils


def test_device_is_a_torch_device_and_can_be_forced(monkeypatch):
    assert isinstance(device(), torch.device)
    monkeypatch.setenv("ATTNBOOK_DEVICE", "cpu")
    assert device() == torch.device("cpu")


def test_device_is_cuda_else_the_cpu_and_mps_only_when_asked(monkeypatch):
    """MPS is never picked by itself, even where it is available: only ATTNBOOK_DEVICE=mps."""
    monkeypatch.delenv("ATTNBOOK_DEVICE", raising=False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    for cuda in (False, True):
        monkeypatch.setattr(torch.cuda, "is_available", lambda cuda=cuda: cuda)
        assert device() == torch.device("cuda" if cuda else "cpu")
    monkeypatch.setenv("ATTNBOOK_DEVICE", "mps")
    assert device() == torch.device("mps")


def test_gpu_settings_startup_turns_on_gpu_on_and_keeps_the_device(monkeypatch):
    # `make gpu-settings` runs this file in every kernel before the first cell
    monkeypatch.setenv("ATTNBOOK_DEVICE", "cpu")
    assert not attnbook.on_gpu()
    startup = Path(__file__).resolve().parents[1] / "scripts" / "gpu_settings_startup.py"
    monkeypatch.setattr(attnbook, "on_gpu", attnbook.on_gpu)  # restored after the test
    monkeypatch.setattr(attnbook.utils, "on_gpu", attnbook.utils.on_gpu)
    exec(compile(startup.read_text(), str(startup), "exec"), {})
    assert attnbook.on_gpu() and attnbook.utils.on_gpu()
    assert attnbook.device() == torch.device("cpu")


def test_seed_everything_repeats_every_generator():
    seed_everything(3)
    first = (random.random(), np.random.rand(), torch.rand(1).item())
    seed_everything(3)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == first
    with pytest.raises(ValueError, match="int >= 0"):
        seed_everything(-1)


def test_show_source_shows_the_real_source_and_nothing_else():
    import inspect

    code = show_source(causal_mask)
    assert code.data == inspect.getsource(causal_mask) and repr(code) == code.data  # text/plain
    # Markdown: one fenced Python block that Jupyter and the book highlight
    assert code._repr_markdown_() == "```python\n" + inspect.getsource(causal_mask) + "```"
    assert not hasattr(code, "_repr_html_")  # nothing that depends on a highlighter's version
    fenced = attnbook_utils.Listing("x = '```'\n")._repr_markdown_()  # backticks inside
    assert fenced.startswith("````python\n") and fenced.endswith("\n````")
    with pytest.raises(TypeError, match="Python source"):
        show_source(3)


def test_seed_offset_shifts_every_seed(monkeypatch):
    from attnbook import generator, seed_offset

    monkeypatch.delenv("ATTNBOOK_SEED_OFFSET", raising=False)
    assert seed_offset() == 0
    seed_everything(5)
    plain = torch.rand(3)
    monkeypatch.setenv("ATTNBOOK_SEED_OFFSET", "2")
    assert seed_offset() == 2
    seed_everything(5)  # seed 5 at offset 2: 2,000,005, not the numbers of offset 0
    assert not torch.equal(torch.rand(3), plain)
    seed_everything(5)
    torch.testing.assert_close(torch.rand(3), torch.rand(3, generator=torch.Generator().manual_seed(2_000_005)))
    expected = torch.rand(4, generator=torch.Generator().manual_seed(2_000_007))
    torch.testing.assert_close(torch.rand(4, generator=generator(7)), expected)
    for bad in ("-1", "two"):
        monkeypatch.setenv("ATTNBOOK_SEED_OFFSET", bad)
        with pytest.raises(ValueError, match="ATTNBOOK_SEED_OFFSET"):
            seed_everything(0)
    with pytest.raises(ValueError, match="int >= 0"):
        generator(-3)


def test_seed_offsets_never_share_a_seed(monkeypatch):
    from attnbook import shifted_seed
    from attnbook.utils import SEED_STRIDE

    seeds = {}
    for offset in range(12):
        monkeypatch.setenv("ATTNBOOK_SEED_OFFSET", str(offset))
        # a page's seeds: its three training seeds and the larger ones it derives
        seeds[offset] = {shifted_seed(s) for s in (0, 1, 2, 998, 1000, 1002, SEED_STRIDE - 1)}
    for a in seeds:
        for b in seeds:
            assert a == b or not seeds[a] & seeds[b], (a, b)  # seed + offset shared 1 and 2
    monkeypatch.setenv("ATTNBOOK_SEED_OFFSET", "3")
    assert shifted_seed(4) == 3 * SEED_STRIDE + 4
    with pytest.raises(ValueError, match="seed must be below 1,000,000.*got 1000000"):
        shifted_seed(SEED_STRIDE)
    with pytest.raises(ValueError, match="int >= 0"):
        shifted_seed(-1)


def test_check_positive_int():
    import numpy as np
    from attnbook.utils import check_positive_int

    assert check_positive_int("n", 3) == 3 and check_positive_int("n", np.int64(4)) == 4
    for bad in (0, -1, 2.0, True, "3", None):
        with pytest.raises(ValueError, match="n must be a positive int"):
            check_positive_int("n", bad)


def test_check_token_ids():
    from attnbook.utils import check_token_ids

    check_token_ids(torch.tensor([[0, 4]]), 5, 2)
    with pytest.raises(ValueError, match="LongTensor"):
        check_token_ids(torch.tensor([[0.0]]), 5)
    with pytest.raises(ValueError, match="exceeds max_len=2"):
        check_token_ids(torch.tensor([[0]]), 5, 2, start=2)
    with pytest.raises(ValueError, match=r"must lie in \[0, 5\), got range \[0, 5\]"):
        check_token_ids(torch.tensor([[0, 5]]), 5)
    check_token_ids(torch.tensor([[0, 5]]), 5, check_range=False)


def test_check_non_negative_int():
    from attnbook.utils import check_non_negative_int

    assert check_non_negative_int("n", 0) == 0 and check_non_negative_int("n", np.int64(3)) == 3
    for bad in (-1, 1.0, True, "2", None):
        with pytest.raises(ValueError, match=f"n must be an int >= 0, got {bad!r}"):
            check_non_negative_int("n", bad)


def test_eval_mode_restores_the_callers_mode_even_after_an_error():
    from attnbook.utils import eval_mode

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.5)).train()
    with eval_mode(model):
        assert not model.training and not model[1].training and not torch.is_grad_enabled()
    assert model.training and model[1].training and torch.is_grad_enabled()
    with pytest.raises(RuntimeError, match="inside"), eval_mode(model):
        raise RuntimeError("inside")
    assert model.training
    model.eval()
    with eval_mode(model):
        pass
    assert not model.training


def test_package_file_finds_files_in_installed_wheels_and_says_what_to_install():
    from attnbook.utils import package_file

    assert package_file("torch", "__init__.py").is_file()
    with pytest.raises(ModuleNotFoundError, match="pip install no-such-wheel"):
        package_file("no_such_package_xyz", "data.csv", pip_name="no-such-wheel")
    with pytest.raises(FileNotFoundError, match="no_such_file.csv not found.*pip install --force-reinstall torch"):
        package_file("torch", "no_such_file.csv")


def test_every_module_lists_its_public_names_sorted():
    """Each module's __all__ holds every public function and class it defines, sorted; the package's
    own __all__ is sorted and every name in it imports."""
    import importlib
    import inspect
    import pkgutil

    for info in pkgutil.walk_packages(attnbook.__path__, "attnbook."):  # whisper's modules too
        module = importlib.import_module(info.name)
        defined = {name for name, obj in vars(module).items()
                   if not name.startswith("_") and (inspect.isfunction(obj) or inspect.isclass(obj))
                   and obj.__module__ == module.__name__}
        assert list(module.__all__) == sorted(module.__all__), info.name
        assert defined <= set(module.__all__), (info.name, sorted(defined - set(module.__all__)))
        assert all(hasattr(module, name) for name in module.__all__), info.name
    assert list(attnbook.__all__) == sorted(attnbook.__all__)
    assert all(hasattr(attnbook, name) for name in attnbook.__all__)


def test_every_public_helper_a_chapter_uses_is_exported():
    from attnbook import ctc, interpretability, metrics

    for module, name in ((interpretability, "ablate_heads"), (ctc, "ctc_greedy_decode"),
                         (metrics, "error_rate")):
        assert name in attnbook.__all__ and getattr(attnbook, name) is getattr(module, name)
