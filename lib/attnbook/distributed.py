"""Training one model on several processes: data parallelism with DDP, and FSDP's
sharding.

torchrun (``python -m torch.distributed.run``) starts one process per *rank* and gives
each its ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT``;
:func:`launch` runs::

    python -m torch.distributed.run --standalone --nproc_per_node=2 -m
    attnbook.distributed --out DIR

Each rank (:func:`main`) builds the same small GPT (same seed), reads its own share of
every global batch through a ``DistributedSampler`` (:func:`rank_batches`) and trains
the model twice:

- wrapped in ``DistributedDataParallel`` (DDP): every rank holds a full replica; during
  backward the gradients are averaged over the ranks (all-reduced) in buckets, so every
  rank takes the same step;
- sharded with ``fully_shard`` (FSDP): every rank keeps only ``1 / world_size`` of each
  parameter, gradient and optimizer state, and gathers a layer's full weights just
  before using them.

The backend is NCCL when every rank has its own CUDA GPU, Gloo (on the CPU) otherwise.
The ranks write to ``DIR``:

- ``ddp_rank{r}.pt``: rank ``r``'s parameters after DDP training (a ``{name: tensor}``
  dict);
- ``fsdp.pt``: the FSDP parameters after training, gathered into full tensors (written
  by rank 0);
- ``report_rank{r}.json``: rank ``r``'s losses (and the mean over the ranks), the
  buckets DDP all-reduced with a clock on the backward pass (:class:`BucketLog`), the
  all-gathers and reduce-scatters FSDP ran (:class:`CollectiveLog`), and how many
  numbers the rank stored for parameters, gradients and optimizer state under each
  scheme; with ``--demonstrations``, the pitfalls' demonstrations too.

With gradient accumulation (``--micro-steps`` above 1) the ranks train FSDP a second
time, reduce-scattering at every micro-step (``fsdp_synced.pt``).

:func:`train_single` trains the same model in one process on the whole global batch: the
reference both must match, since the mean loss over the global batch is the mean of the
ranks' mean losses.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from datetime import timedelta
from functools import lru_cache, partial
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.optim import Optimizer
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from .data import CharTokenizer, load_shakespeare, random_batch, train_val_split
from .models import GPT
from .train import make_optimizer, to_device
from .utils import check_positive_int, seed_everything, shifted_seed


@dataclass(frozen=True)
class Config:
    """What the ranks and the single-process reference share: model, data and optimizer
    settings."""

    seed: int = 0
    steps: int = 20  # optimizer steps
    # windows per optimizer step over all ranks and micro-steps: each rank reads
    # global_batch / (world_size * micro_steps) windows per micro-step
    global_batch: int = 16
    # gradient accumulation: forward and backward passes per optimizer step on each rank
    micro_steps: int = 1
    seq_len: int = 32  # characters per window
    d_model: int = 64
    num_heads: int = 4
    num_layers: int = 2
    # "sgd" (with momentum) or "adamw" (the book's make_optimizer); constant rate
    optimizer: str = "sgd"
    lr: float = 0.1
    momentum: float = 0.9  # SGD only
    weight_decay: float = 0.01  # AdamW only
    num_windows: int = 2048  # the dataset: this many fixed windows of the training text
    # DDP's gradient bucket size (default 25 MB; small here to get several)
    bucket_cap_mb: float = 0.1

    def __post_init__(self):
        for name in (
            "steps",
            "global_batch",
            "micro_steps",
            "seq_len",
            "d_model",
            "num_heads",
            "num_layers",
            "num_windows",
        ):
            check_positive_int(name, getattr(self, name))
        if (
            not isinstance(self.seed, int)
            or isinstance(self.seed, bool)
            or self.seed < 0
        ):
            raise ValueError(f"seed must be a non-negative int, got {self.seed!r}")
        if self.optimizer not in ("sgd", "adamw"):
            raise ValueError(
                f"optimizer must be 'sgd' or 'adamw', got {self.optimizer!r}"
            )
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr!r}")


def backend_and_device(local_rank: int, world_size: int) -> tuple[str, torch.device]:
    """``("nccl", cuda:local_rank)`` when there is a CUDA GPU for every rank, else
    ``("gloo", cpu)``.

    NCCL is the collective library for NVIDIA GPUs; it needs one GPU per rank. Gloo runs
    the same collectives (all-reduce, all-gather, reduce-scatter) between CPU processes.
    """
    if torch.cuda.is_available() and torch.cuda.device_count() >= world_size:
        return "nccl", torch.device("cuda", local_rank)
    return "gloo", torch.device("cpu")


def windows_dataset(config: Config) -> tuple[TensorDataset, int]:
    """``(dataset, vocab_size)``: ``config.num_windows`` fixed windows ``(x, y)`` of the
    Shakespeare training text (``y`` is ``x`` shifted by one character), drawn with
    ``generator(config.seed)``."""
    return _windows(shifted_seed(config.seed), config.num_windows, config.seq_len)


@lru_cache(maxsize=4)  # the references and the demonstrations reuse the same windows
def _windows(seed: int, num_windows: int, seq_len: int) -> tuple[TensorDataset, int]:
    text = load_shakespeare()
    tokenizer = CharTokenizer.from_text(text)
    train_ids, _ = train_val_split(tokenizer.encode(text))
    # = generator(config.seed): the offset is already in `seed`
    g = torch.Generator().manual_seed(seed)
    x, y = random_batch(train_ids, num_windows, seq_len, generator=g)
    return TensorDataset(x, y), len(tokenizer)


def rank_batches(
    dataset: TensorDataset, config: Config, rank: int, world_size: int
) -> Iterator:
    """Rank ``rank``'s endless stream of ``(x, y)`` batches of ``global_batch /
    (world_size * micro_steps)`` windows (one per micro-step).

    A ``DistributedSampler`` shuffles the indices with the same seed on every rank (a
    new order each epoch, via ``set_epoch``) and deals them out like cards: rank ``r``
    takes positions ``r, r + W, r + 2W, ...``, so the ranks' shares of an epoch are
    disjoint. With ``drop_last=True`` (here, in the sampler and the loader) the windows
    that do not fill a share or a batch are left out of that epoch, never read twice;
    the shares cover the dataset exactly when it divides by ``global_batch``.
    """
    if config.global_batch % (world_size * config.micro_steps):
        raise ValueError(
            f"global_batch={config.global_batch} must be a multiple of "
            f"world_size * micro_steps = {world_size} * {config.micro_steps}"
        )
    sampler = DistributedSampler(
        dataset,
        num_replicas=world_size,
        rank=rank,
        shuffle=True,
        seed=shifted_seed(config.seed),
        drop_last=True,
    )
    loader = DataLoader(
        dataset,
        batch_size=config.global_batch // (world_size * config.micro_steps),
        sampler=sampler,
        drop_last=True,
    )
    epoch = 0
    while True:
        sampler.set_epoch(epoch)
        yield from loader
        epoch += 1


def global_batches(dataset: TensorDataset, config: Config, world_size: int) -> Iterator:
    """The global batch of every optimizer step: all the ranks' micro-batches of that
    step (:func:`rank_batches`), concatenated."""
    streams = [
        rank_batches(dataset, config, rank, world_size) for rank in range(world_size)
    ]
    while True:
        parts = [next(stream) for stream in streams for _ in range(config.micro_steps)]
        yield torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts])


def build_model(vocab_size: int, config: Config) -> GPT:
    """The chapter-6 GPT at ``config``'s size, initialised from
    ``seed_everything(config.seed)``."""
    seed_everything(config.seed)
    return GPT(
        vocab_size,
        config.d_model,
        config.num_heads,
        config.num_layers,
        max_len=config.seq_len,
    )


def next_token_loss(model: nn.Module, batch) -> torch.Tensor:
    """Mean cross-entropy of the next character over every position of every window of
    ``batch``."""
    x, y = batch  # (B, T) each
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten())


def build_optimizer(model: nn.Module, config: Config) -> Optimizer:
    """SGD with momentum, or the book's AdamW (:func:`~attnbook.train.make_optimizer`),
    at ``config.lr``."""
    if config.optimizer == "sgd":
        return torch.optim.SGD(
            model.parameters(), lr=config.lr, momentum=config.momentum
        )
    return make_optimizer(model, config.lr, config.weight_decay)


def train_steps(
    model: nn.Module,
    batches: Iterator,
    config: Config,
    device,
    *,
    micro_steps: int | None = None,
    no_sync=None,
) -> tuple[list[float], Optimizer]:
    """``config.steps`` optimizer steps, each on ``micro_steps`` (default
    ``config.micro_steps``) batches from ``batches``; returns ``(mean loss of each step,
    optimizer)``.

    The same loop serves the single process, a DDP-wrapped model and an FSDP-sharded
    one: the wrappers do their communication inside ``forward`` and ``backward``. With
    gradient accumulation each micro-batch's loss is divided by ``micro_steps`` before
    its backward, so the summed gradients are those of the mean over the step's
    windows; ``no_sync`` (a context manager factory: DDP's ``no_sync``,
    :func:`fsdp_no_sync` for FSDP) keeps every micro-step's gradients local but the
    last one's, so the gradients are averaged once per optimizer step (FSDP still
    gathers the weights at every micro-step).
    """
    micro_steps = config.micro_steps if micro_steps is None else micro_steps
    optimizer = build_optimizer(model, config)
    batches, losses = iter(batches), []
    for _ in range(config.steps):
        optimizer.zero_grad(set_to_none=True)
        step_loss = 0.0
        for micro in range(micro_steps):
            local = no_sync is not None and micro < micro_steps - 1
            with no_sync() if local else contextlib.nullcontext():
                loss = next_token_loss(model, to_device(next(batches), device))
                (loss / micro_steps).backward()
            step_loss += loss.detach() / micro_steps
        optimizer.step()
        losses.append(step_loss)
    return [float(loss) for loss in losses], optimizer


@contextlib.contextmanager
def fsdp_no_sync(model: nn.Module):
    """FSDP's counterpart of DDP's ``no_sync()``: inside, backward skips the
    reduce-scatter (``set_requires_gradient_sync(False)``) and leaves each rank the
    full, unsharded gradients, which the next backward outside reduce-scatters.
    Forward and backward still all-gather the weights."""
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def train_single(
    config: Config, world_size: int = 2, device=None
) -> tuple[GPT, list[float]]:
    """The reference: one process trains on the whole global batch of every step (the
    ``world_size`` ranks' micro-batches concatenated) in one forward and backward pass.
    Returns ``(model, losses)``."""
    device = torch.device("cpu") if device is None else torch.device(device)
    dataset, vocab_size = windows_dataset(config)
    model = build_model(vocab_size, config).to(device)
    losses, _ = train_steps(
        model,
        global_batches(dataset, config, world_size),
        config,
        device,
        micro_steps=1,
    )
    return model, losses


def train_averaging(
    config: Config, world_size: int = 2, device=None
) -> tuple[GPT, list[float]]:
    """DDP's arithmetic in one process: at every step, the gradient of each rank's share
    of the batch (accumulated over its micro-batches, each loss divided by
    ``micro_steps``), divided by ``world_size`` and summed in rank order, is the
    gradient the optimizer uses.

    DDP divides each bucket by the world size and then all-reduces it (a sum); with two
    ranks the sum of two numbers does not depend on its order, so this gives DDP's
    parameters bit for bit (on the same kernels). Returns ``(model, mean loss of each
    step)``.
    """
    device = torch.device("cpu") if device is None else torch.device(device)
    dataset, vocab_size = windows_dataset(config)
    model = build_model(vocab_size, config).to(device)
    params = list(model.parameters())
    optimizer = build_optimizer(model, config)
    streams = [
        rank_batches(dataset, config, rank, world_size) for rank in range(world_size)
    ]
    losses = []
    for _ in range(config.steps):
        grads, step_loss = None, 0.0
        for stream in streams:  # each rank: forward and backward on its own share
            local = None  # the rank's gradients, accumulated as autograd does
            for _ in range(config.micro_steps):
                loss = next_token_loss(model, to_device(next(stream), device))
                micro = torch.autograd.grad(loss / config.micro_steps, params)
                local = (
                    micro
                    if local is None
                    else [a + b for a, b in zip(local, micro, strict=True)]
                )
                step_loss += float(loss.detach()) / (world_size * config.micro_steps)
            rank_grads = [g / world_size for g in local]
            grads = (
                rank_grads
                if grads is None
                else [a + b for a, b in zip(grads, rank_grads, strict=True)]
            )
        for p, g in zip(params, grads, strict=True):
            p.grad = g
        optimizer.step()
        losses.append(step_loss)
    return model, losses


def stored_numbers(model: nn.Module, optimizer: Optimizer) -> dict[str, int]:
    """How many numbers this rank holds for parameters, gradients and optimizer state
    (SGD's momentum, AdamW's two moment estimates; not the step counters, which are
    scalars).

    Under FSDP each of them is a ``DTensor`` whose ``to_local()`` is this rank's shard.
    """

    def local(t):
        return t.to_local() if hasattr(t, "to_local") else t

    params = [p for p in model.parameters() if p.requires_grad]
    states = [
        local(v)
        for state in optimizer.state.values()
        for v in state.values()
        if isinstance(v, torch.Tensor) and v.dim() > 0
    ]
    return {
        "parameters": sum(local(p).numel() for p in params),
        "gradients": sum(local(p.grad).numel() for p in params if p.grad is not None),
        "optimizer": sum(s.numel() for s in states),
    }


def count_steps(log, batches: Iterator, micro_steps: int) -> Iterator:
    """Yield ``batches`` unchanged, telling ``log`` (its ``step``) which optimizer step
    each belongs to: ``micro_steps`` batches a step."""
    for index, batch in enumerate(batches):
        log.step = index // micro_steps
        yield batch


class BucketLog:
    """A DDP communication hook that records each gradient bucket, then all-reduces it
    as DDP would, with a clock on the backward pass around it.

    ``log.steps[step]`` describes the last backward pass of that optimizer step:

    - ``"order"``: the parameters in the order backward computed their gradients, and
      ``"gradients"``: when (seconds after the gradient of the model's output was
      ready, the start of the model's backward pass);
    - ``"buckets"``, in the order DDP sent them: ``{"index", "elements",
      "parameters", "ready", "launched", "finished"}``: the parameters' names, how many
      gradients backward had computed when the bucket was sent, and when its
      all-reduce began and ended.
    """

    def __init__(self, model: nn.Module):
        self.names = {id(p): name for name, p in model.named_parameters()}
        self.step = 0
        self.steps: dict[int, dict] = {}
        self._start = 0.0
        for name, p in model.named_parameters():
            p.register_hook(partial(self._gradient_ready, name))
        model.register_forward_hook(self._forward_done)

    def _clock(self) -> float:
        return time.perf_counter() - self._start

    def _forward_done(self, module, inputs, output):
        if output.requires_grad:  # its gradient is the first of the backward pass
            output.register_hook(self._backward_begins)

    def _backward_begins(self, grad):
        self._start = time.perf_counter()
        self.steps[self.step] = {"order": [], "gradients": [], "buckets": []}

    def _gradient_ready(self, name, grad):
        record = self.steps[self.step]
        record["order"].append(name)
        record["gradients"].append(self._clock())

    # (no annotations: DDP checks them against the real classes)
    def hook(self, state, bucket):
        """Record ``bucket`` (a ``dist.GradBucket``), then return the future of its
        all-reduce."""
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import (
            allreduce_hook,
        )

        record = self.steps[self.step]
        entry = {
            "index": bucket.index(),
            "elements": bucket.buffer().numel(),
            "parameters": [self.names[id(p)] for p in bucket.parameters()],
            "ready": len(record["order"]),
            "launched": self._clock(),
        }
        record["buckets"].append(entry)
        future = allreduce_hook(None, bucket)  # divide by world_size, sum over ranks

        def finished(future):
            entry["finished"] = self._clock()
            return future.value()

        return future.then(finished)


class CollectiveLog:
    """Counts the all-gathers and reduce-scatters of an FSDP model, per optimizer step.

    :meth:`attach` makes a ``fully_shard``-ed module run its collectives through this
    log (``set_custom_all_gather``, ``set_custom_reduce_scatter``); ``log.steps[step]``
    is then ``{"all_gather": [...], "reduce_scatter": [...]}``, the size of each call
    in numbers: the whole flat buffer, every rank's chunk of it (the gathered output,
    the input to scatter), padding included. Nothing is recorded while ``step`` is
    None.
    """

    def __init__(self):
        self.step: int | None = 0
        self.steps: dict[int, dict[str, list[int]]] = {}

    def attach(self, module: nn.Module) -> None:
        module.set_custom_all_gather(_CountedAllGather(self))
        module.set_custom_reduce_scatter(_CountedReduceScatter(self))

    def record(self, kind: str, numbers: int) -> None:
        if self.step is not None:
            calls = self.steps.setdefault(
                self.step, {"all_gather": [], "reduce_scatter": []}
            )
            calls[kind].append(int(numbers))

    def per_step(self, step: int) -> dict[str, dict[str, int]]:
        """``{kind: {"calls": how many, "numbers": their sizes summed}}`` for
        ``step``."""
        return {
            kind: {"calls": len(sizes), "numbers": sum(sizes)}
            for kind, sizes in self.steps[step].items()
        }


class _CountedAllGather:
    """FSDP's all-gather (``dist.all_gather_into_tensor``), recorded in a
    :class:`CollectiveLog`."""

    def __init__(self, log: CollectiveLog):
        self.log = log

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        self.log.record("all_gather", output_tensor.numel())
        return dist.all_gather_into_tensor(
            output_tensor, input_tensor, group=group, async_op=async_op
        )


class _CountedReduceScatter(_CountedAllGather):
    """FSDP's reduce-scatter (``dist.reduce_scatter_tensor``), recorded in a
    :class:`CollectiveLog`."""

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        self.log.record("reduce_scatter", input_tensor.numel())
        return dist.reduce_scatter_tensor(
            output_tensor, input_tensor, op=op, group=group, async_op=async_op
        )


def gradient_numbers_held() -> int:
    """How many gradient numbers this process holds: the gradients of every parameter
    alive in it (this rank's chunk of a sharded one), found by the garbage collector.

    FSDP's gradients between two backward passes that skip the reduce-scatter are not
    on the model's (sharded) parameters but on the full-size copies it gathered, so
    counting ``model.parameters()`` would miss them; counting every parameter does not.
    """
    gc.collect()  # let go of models nothing refers to any more
    held = 0
    for obj in gc.get_objects():
        if isinstance(obj, nn.Parameter) and obj.grad is not None:
            grad = obj.grad
            held += (grad.to_local() if hasattr(grad, "to_local") else grad).numel()
    return held


def train_ddp(
    dataset, vocab_size: int, config: Config, rank: int, world_size: int, device
):
    """One rank's DDP training (inside an initialised process group): returns
    ``(parameters, report)``.

    ``DistributedDataParallel`` broadcasts rank 0's parameters to every rank when it
    wraps the model and hooks into autograd: as backward produces gradients (last layer
    first), it copies them into buckets of about ``bucket_cap_mb``; a full bucket is
    all-reduced at once, while backward goes on computing the gradients of earlier
    layers. ``optimizer.step()`` then sees the averaged gradients.
    """
    from torch.nn.parallel import DistributedDataParallel

    # the same initial weights on every rank
    model = build_model(vocab_size, config).to(device)
    ddp = DistributedDataParallel(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        bucket_cap_mb=config.bucket_cap_mb,
    )
    log = BucketLog(model)
    # records the buckets, then all-reduces them as DDP would
    ddp.register_comm_hook(None, log.hook)
    # this rank's share of each batch (the log learns which step each batch is for)
    batches = count_steps(
        log, rank_batches(dataset, config, rank, world_size), config.micro_steps
    )
    # the single-process loop, unchanged; with accumulation, no all-reduce but the last
    losses, optimizer = train_steps(ddp, batches, config, device, no_sync=ddp.no_sync)
    # each rank's losses are its own share's: the training loss is their mean
    logged = torch.tensor(losses, dtype=torch.float64, device=device)
    dist.all_reduce(logged)
    params = {name: p.detach().cpu() for name, p in model.named_parameters()}
    return params, {
        "losses": losses,
        "logged_losses": (logged / world_size).tolist(),
        "first_step": log.steps[0],
        "last_step": log.steps[config.steps - 1],
        "stored": stored_numbers(model, optimizer),
    }


def train_fsdp(
    dataset,
    vocab_size: int,
    config: Config,
    rank: int,
    world_size: int,
    device,
    *,
    sync_every_micro_step: bool = False,
):
    """One rank's FSDP training (inside an initialised process group): returns ``(full
    parameters, report)``.

    ``fully_shard`` replaces each parameter by a ``DTensor`` of which this rank keeps
    one chunk of rows (dim 0). Before a sharded module runs, forward or backward, its
    parameters are all-gathered; after it, the full copies are freed; its gradients are
    reduce-scattered, so each rank receives the average of its own chunk only, and the
    optimizer updates (and keeps state for) that chunk alone. With gradient
    accumulation the micro-steps but the last skip the reduce-scatter
    (:func:`fsdp_no_sync`), unless ``sync_every_micro_step``.
    """
    from torch.distributed.fsdp import fully_shard

    model = build_model(vocab_size, config).to(device)
    # one unit per block: only a block or two hold full weights at a time (the one that
    # runs, and the next, gathered in advance)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)  # the root unit: embeddings, final norm, head
    log = CollectiveLog()  # counts each unit's all-gathers and reduce-scatters
    for unit in (*model.blocks, model):
        log.attach(unit)
    batches = count_steps(
        log, rank_batches(dataset, config, rank, world_size), config.micro_steps
    )
    no_sync = None if sync_every_micro_step else (lambda: fsdp_no_sync(model))
    losses, optimizer = train_steps(model, batches, config, device, no_sync=no_sync)
    stored = stored_numbers(model, optimizer)  # this rank's shards only
    log.step = None  # (not a training step)
    held = gradients_held_by_micro_steps(model, next(batches), device)
    # an all-gather
    full = {
        name: p.full_tensor().detach().cpu() for name, p in model.named_parameters()
    }
    return full, {
        "losses": losses,
        "stored": stored,
        "collectives_first_step": log.per_step(0),
        "collectives_last_step": log.per_step(config.steps - 1),
        "gradients_held": held,
    }


def gradients_held_by_micro_steps(model: nn.Module, batch, device) -> dict[str, int]:
    """The gradient numbers this rank holds (:func:`gradient_numbers_held`) after one
    micro-step of an FSDP ``model`` that keeps its gradients local
    (:func:`fsdp_no_sync`: ``"local"``), then after one more that reduce-scatters them
    (``"synced"``); the gradients are set to None before and after."""
    model.zero_grad(set_to_none=True)
    held = {}
    for name in ("local", "synced"):
        with fsdp_no_sync(model) if name == "local" else contextlib.nullcontext():
            next_token_loss(model, to_device(batch, device)).backward()
        held[name] = gradient_numbers_held()
    model.zero_grad(set_to_none=True)
    return held


def seeding_demonstration(
    vocab_size: int, config: Config, rank: int, world_size: int, device
) -> dict:
    """What happens when every rank seeds its weights with ``config.seed + rank``
    (inside an initialised process group): DDP's broadcast at wrapping repairs the
    replicas; ``fully_shard`` keeps each rank's own chunk, so the gathered weights mix
    the ranks' initialisations. And the dropout masks the ranks draw after building
    the model from one seed, then after reseeding with ``config.seed + rank``.
    """
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    def seeded(seed):  # the model each seed builds, in this process
        return build_model(vocab_size, replace(config, seed=seed)).to(device)

    def same(a, b):
        return all(
            torch.equal(p, q)
            for p, q in zip(a.parameters(), b.parameters(), strict=True)
        )

    reference = seeded(config.seed)  # rank 0's model, and every rank's with one seed
    own = seeded(config.seed + rank)
    result = {"differs_before_wrapping": not same(own, reference)}
    DistributedDataParallel(own)  # broadcasts rank 0's parameters
    result["equal_after_wrapping"] = same(own, reference)

    own = seeded(config.seed + rank)
    fully_shard(own)  # this rank keeps its chunk of the rows of its own build
    table = own.token_embedding.weight.full_tensor().detach().cpu()  # all-gathered
    builds = [seeded(config.seed + r).token_embedding.weight for r in range(world_size)]
    result["table_rows"] = len(table)
    result["rows_from_seed"] = [  # rows of the gathered table equal to seed + r's
        sum(torch.equal(table[i], build[i].detach().cpu()) for i in range(len(table)))
        for build in builds
    ]

    masks = {}
    for name in ("shared", "per_rank"):
        build_model(vocab_size, config)  # every rank: the weights from the shared seed
        if name == "per_rank":
            seed_everything(config.seed + rank)  # then the noise from a seed of its own
        dropped = F.dropout(torch.ones(8, config.seq_len, device=device), 0.5) == 0
        dropped = dropped.to(torch.uint8)  # (gloo gathers no bools)
        gathered = [torch.empty_like(dropped) for _ in range(world_size)]
        dist.all_gather(gathered, dropped)
        masks[name] = all(torch.equal(gathered[0], m) for m in gathered)
    result["identical_masks"] = masks
    return result


def mismatched_collective(rank: int, timeout_s: float = 2.0) -> dict:
    """Rank 0 alone calls an all-reduce (as logging code under ``if rank == 0`` might);
    the other ranks go on to the next collective, a barrier. Rank 0 waits for partners
    that never come: on a group with a ``timeout_s`` timeout it fails after that long,
    where the default timeout would have made it wait for many minutes. Returns, on
    rank 0, the error and how long it waited.

    The group is Gloo's, on the CPU, whatever the ranks train on: NCCL's watchdog would
    end the process at the timeout rather than raise.
    """
    # every rank joins the group
    group = dist.new_group(timeout=timedelta(seconds=timeout_s), backend="gloo")
    result = {"called": rank == 0}
    if rank == 0:
        start = time.perf_counter()
        try:
            dist.all_reduce(torch.ones(1), group=group)
            result["error"] = None
        except RuntimeError as error:  # gloo: "Timed out waiting ..."
            result["error"] = type(error).__name__
            result["message"] = str(error).splitlines()[0]
        result["waited_s"] = time.perf_counter() - start
    dist.barrier()  # the other ranks wait here for rank 0 to give up
    dist.destroy_process_group(group)
    return result


def allreduce_timing(shapes, repeats: int = 15, device="cpu") -> dict:
    """Seconds to all-reduce tensors of ``shapes`` one collective per tensor, and all
    of them as one flat bucket (copied in and out, as DDP does), ``repeats`` times
    each, interleaved; both lists are returned."""
    device = torch.device(device)
    # GPU collectives run asynchronously: wait for them before reading the clock
    wait = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    tensors = [torch.zeros(shape, device=device) for shape in shapes]
    bucket = torch.zeros(sum(t.numel() for t in tensors), device=device)
    separate, bucketed = [], []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        for t in tensors:
            dist.all_reduce(t)
        wait()
        separate.append(time.perf_counter() - start)
        dist.barrier()
        start = time.perf_counter()
        torch.cat([t.flatten() for t in tensors], out=bucket)
        dist.all_reduce(bucket)
        sizes = [t.numel() for t in tensors]
        for t, part in zip(tensors, bucket.split(sizes), strict=True):
            t.copy_(part.view_as(t))
        wait()
        bucketed.append(time.perf_counter() - start)
    return {"separate_s": separate, "bucket_s": bucketed}


def main(argv: list[str] | None = None) -> int:
    """One rank's work (started by torchrun): DDP training, then FSDP training; results
    into ``--out``."""
    parser = argparse.ArgumentParser(
        prog="python -m torch.distributed.run --nproc_per_node=2 "
        "-m attnbook.distributed",
        description=__doc__.split("\n\n")[0],
    )
    parser.add_argument(
        "--out", required=True, help="folder for the results (created if missing)"
    )
    parser.add_argument("--seed", type=int, default=Config.seed)
    parser.add_argument("--steps", type=int, default=Config.steps)
    parser.add_argument("--global-batch", type=int, default=Config.global_batch)
    parser.add_argument("--micro-steps", type=int, default=Config.micro_steps)
    parser.add_argument(
        "--optimizer", choices=("sgd", "adamw"), default=Config.optimizer
    )
    parser.add_argument("--lr", type=float, default=Config.lr)
    parser.add_argument(
        "--demonstrations",
        action="store_true",
        help="also run the pitfalls' demonstrations (seeding, a collective on one "
        "rank only, 37 all-reduces against one bucket)",
    )
    args = parser.parse_args(argv)
    if "RANK" not in os.environ:
        parser.error(
            "RANK is not set: start this module with torchrun (python -m "
            "torch.distributed.run)"
        )
    config = Config(
        seed=args.seed,
        steps=args.steps,
        global_batch=args.global_batch,
        micro_steps=args.micro_steps,
        optimizer=args.optimizer,
        lr=args.lr,
    )
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    backend, device = backend_and_device(
        int(os.environ.get("LOCAL_RANK", rank)), world_size
    )
    if device.type == "cuda":
        torch.cuda.set_device(device)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # reads MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE set by torchrun
    dist.init_process_group(backend)
    try:
        dataset, vocab_size = windows_dataset(config)
        ddp_params, ddp_report = train_ddp(
            dataset, vocab_size, config, rank, world_size, device
        )
        torch.save(ddp_params, out / f"ddp_rank{rank}.pt")
        fsdp_params, fsdp_report = train_fsdp(
            dataset, vocab_size, config, rank, world_size, device
        )
        if rank == 0:
            torch.save(fsdp_params, out / "fsdp.pt")
        report = {
            "rank": rank,
            "world_size": world_size,
            "backend": backend,
            "config": asdict(config),
            "ddp": ddp_report,
            "fsdp": fsdp_report,
        }
        if config.micro_steps > 1:  # FSDP again, reduce-scattering every micro-step
            synced_params, report["fsdp_synced"] = train_fsdp(
                dataset,
                vocab_size,
                config,
                rank,
                world_size,
                device,
                sync_every_micro_step=True,
            )
            if rank == 0:
                torch.save(synced_params, out / "fsdp_synced.pt")
        if args.demonstrations:
            shapes = [list(p.shape) for p in ddp_params.values()]
            report["demonstrations"] = {
                "seeding": seeding_demonstration(
                    vocab_size, config, rank, world_size, device
                ),
                "mismatched_collective": mismatched_collective(rank),
                "allreduce_timing": allreduce_timing(shapes, device=device),
            }
        (out / f"report_rank{rank}.json").write_text(json.dumps(report, indent=1))
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


def launch(
    out_dir,
    nproc: int = 2,
    *,
    config: Config | None = None,
    timeout: float = 300,
    extra_env: dict[str, str] | None = None,
    demonstrations: bool = False,
) -> subprocess.CompletedProcess:
    """Start ``nproc`` ranks of :func:`main` with torchrun and wait for them; return the
    finished process.

    ``config`` (default ``Config()``) passes its seed, steps, global batch,
    micro-steps, optimizer and learning rate to the ranks; its other fields must keep
    their defaults. ``demonstrations`` runs the pitfalls' demonstrations too.

    ``--standalone`` makes torchrun host its own rendezvous on this machine at a free
    port (no port to choose, none to collide). Each worker gets ``OMP_NUM_THREADS=1``
    (``nproc`` processes share the cores) and a ``PYTHONPATH`` that finds this copy of
    ``attnbook``. Raises ``RuntimeError`` with the end of the workers' output if they
    fail.
    """
    nproc = check_positive_int("nproc", nproc)
    config = Config() if config is None else config
    passed = {"seed", "steps", "global_batch", "micro_steps", "optimizer", "lr"}
    changed = [
        k
        for k, v in asdict(config).items()
        if k not in passed and v != getattr(Config, k)
    ]
    if changed:
        raise ValueError(
            f"launch passes only {sorted(passed)} to the ranks; {changed} must keep "
            "their defaults"
        )
    # the folder that holds attnbook/
    library = str(Path(__file__).resolve().parents[1])
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join(
            p for p in (library, os.environ.get("PYTHONPATH")) if p
        ),
        **(extra_env or {}),
    }
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        "-m",
        "attnbook.distributed",
        "--out",
        str(out_dir),
        "--seed",
        str(config.seed),
        "--steps",
        str(config.steps),
        "--global-batch",
        str(config.global_batch),
        "--micro-steps",
        str(config.micro_steps),
        "--optimizer",
        config.optimizer,
        "--lr",
        repr(config.lr),
        *(["--demonstrations"] if demonstrations else []),
    ]
    result = subprocess.run(
        command, env=env, capture_output=True, text=True, timeout=timeout
    )
    if result.returncode != 0:
        raise RuntimeError(
            f"torchrun failed with exit code {result.returncode}:\n"
            f"{(result.stdout + result.stderr)[-4000:]}"
        )
    return result


if __name__ == "__main__":
    sys.exit(main())


__all__ = [
    "BucketLog",
    "CollectiveLog",
    "Config",
    "allreduce_timing",
    "backend_and_device",
    "build_model",
    "build_optimizer",
    "count_steps",
    "fsdp_no_sync",
    "global_batches",
    "gradient_numbers_held",
    "gradients_held_by_micro_steps",
    "launch",
    "main",
    "mismatched_collective",
    "next_token_loss",
    "rank_batches",
    "seeding_demonstration",
    "stored_numbers",
    "train_averaging",
    "train_ddp",
    "train_fsdp",
    "train_single",
    "train_steps",
    "windows_dataset",
]
