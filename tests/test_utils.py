import random

import numpy as np
import pytest
import torch
from attnbook import causal_mask, device, seed_everything, show_source


def test_device_is_a_torch_device_and_can_be_forced(monkeypatch):
    assert isinstance(device(), torch.device)
    monkeypatch.setenv("ATTNBOOK_DEVICE", "cpu")
    assert device() == torch.device("cpu")


def test_seed_everything_repeats_every_generator():
    seed_everything(3)
    first = (random.random(), np.random.rand(), torch.rand(1).item())
    seed_everything(3)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == first
    with pytest.raises(ValueError, match="non-negative int"):
        seed_everything(-1)


def test_show_source_renders_the_real_source():
    code = show_source(causal_mask)
    assert "def causal_mask" in code.data
    assert "causal_mask" in code._repr_html_() and "<span" in code._repr_html_()  # highlighted
    with pytest.raises(TypeError, match="Python source"):
        show_source(3)
