"""Data parallelism: two torchrun ranks (Gloo, CPU) train the GPT with DDP and with FSDP to the parameters
of one process trained on the whole global batch; the sampler deals disjoint shares; clear errors."""

import json

import pytest
import torch
from attnbook import distributed
from attnbook.distributed import (
    Config,
    launch,
    rank_batches,
    train_averaging,
    train_single,
    windows_dataset,
)

STEPS = 5  # enough for the optimizer's momentum to matter; the launch itself is most of the ~10 s

# How far the ranks' parameters (and mean losses) may lie from the single-process reference, by backend.
# Gloo: the ranks and the reference run the same CPU kernels; only the order of the gradient sums differs
# (per-rank halves averaged vs one global batch), a few float32 ulps. NCCL: the ranks run on CUDA, and
# NCCL's reductions and cuBLAS's kernels for a half batch round differently from one global batch on the
# same GPU; over STEPS steps of SGD with momentum these differences grow, so the tolerance is looser.
TOLERANCE = {"gloo": 1e-6, "nccl": 1e-4}
LOSS_TOLERANCE = {"gloo": 1e-5, "nccl": 1e-4}


@pytest.fixture
def one_thread():
    """The ranks run one thread each (OMP_NUM_THREADS=1); the in-process references use the same kernels."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_ddp_and_fsdp_match_one_process_on_the_global_batch(tmp_path, one_thread):
    config = Config(steps=STEPS)
    launch(tmp_path, nproc=2, config=config, timeout=240)
    ranks = [torch.load(tmp_path / f"ddp_rank{rank}.pt") for rank in range(2)]
    fsdp = torch.load(tmp_path / "fsdp.pt")
    reports = [json.loads((tmp_path / f"report_rank{rank}.json").read_text()) for rank in range(2)]

    backend = reports[0]["backend"]
    assert backend in TOLERANCE and all(report["backend"] == backend for report in reports)
    device = "cuda" if backend == "nccl" else "cpu"  # the reference runs where the ranks ran
    tolerance = TOLERANCE[backend]

    for name in ranks[0]:  # DDP keeps the replicas identical, bit for bit
        assert torch.equal(ranks[0][name], ranks[1][name]), name
    reference, reference_losses = train_single(config, device=device)
    for name, p in reference.named_parameters():
        expected = p.detach().cpu()
        torch.testing.assert_close(ranks[0][name], expected, atol=tolerance, rtol=0, msg=name)
        torch.testing.assert_close(fsdp[name], expected, atol=tolerance, rtol=0, msg=name)
    if backend == "gloo":  # same CPU kernels: DDP = the averaged per-rank gradients, exactly
        averaged, _ = train_averaging(config)
        for name, p in averaged.named_parameters():
            assert torch.equal(ranks[0][name], p.detach()), name
    # the mean of the ranks' losses is the loss of the global batch
    mean_losses = [(a + b) / 2 for a, b in zip(reports[0]["ddp"]["losses"], reports[1]["ddp"]["losses"], strict=True)]
    assert mean_losses == pytest.approx(reference_losses, abs=LOSS_TOLERANCE[backend])
    assert reference_losses[-1] < reference_losses[0]

    # FSDP: each rank stores about half of every parameter, gradient and momentum buffer; DDP all of them
    total = sum(p.numel() for p in reference.parameters())
    for report in reports:
        assert report["ddp"]["stored"] == {"parameters": total, "gradients": total, "optimizer": total}
    for kind in ("parameters", "gradients", "optimizer"):
        shares = [report["fsdp"]["stored"][kind] for report in reports]
        assert sum(shares) == total
        assert max(shares) - min(shares) <= 2 * 64 * 4  # dim-0 chunks: a row per tensor at most
    # DDP all-reduced every gradient exactly once per step, in buckets (how many, which parameters go together
    # and in what order is DDP's own business: it regroups them after the first step, for one)
    names = sorted(name for name, _ in reference.named_parameters())
    for step in ("buckets_first_step", "buckets_last_step"):
        buckets = reports[0]["ddp"][step]
        assert sorted(name for bucket in buckets for name in bucket["parameters"]) == names, step
        assert sum(bucket["elements"] for bucket in buckets) == total, step


def test_gradient_accumulation_matches_one_process_and_communicates_once_a_step(tmp_path, one_thread):
    """Two micro-steps per optimizer step on each rank (no_sync for DDP, set_requires_gradient_sync(False)
    for FSDP, each loss divided by the micro-steps): the same parameters as one process on the whole global
    batch, and DDP all-reduces every gradient once per optimizer step, not once per micro-step."""
    config = Config(steps=STEPS, micro_steps=2)
    launch(tmp_path, nproc=2, config=config, timeout=240)
    ddp = torch.load(tmp_path / "ddp_rank0.pt")
    fsdp = torch.load(tmp_path / "fsdp.pt")
    report = json.loads((tmp_path / "report_rank0.json").read_text())
    tolerance = TOLERANCE[report["backend"]]
    reference, _ = train_single(config, device="cuda" if report["backend"] == "nccl" else "cpu")
    for name, p in reference.named_parameters():
        torch.testing.assert_close(ddp[name], p.detach().cpu(), atol=tolerance, rtol=0, msg=name)
        torch.testing.assert_close(fsdp[name], p.detach().cpu(), atol=tolerance, rtol=0, msg=name)
    if report["backend"] == "gloo":  # DDP's own arithmetic, accumulation included, exactly
        averaged, _ = train_averaging(config)
        for name, p in averaged.named_parameters():
            assert torch.equal(ddp[name], p.detach()), name
    total = sum(p.numel() for p in reference.parameters())
    for step in ("buckets_first_step", "buckets_last_step"):  # one all-reduce of each gradient
        assert sum(bucket["elements"] for bucket in report["ddp"][step]) == total, step
    # without dividing each micro-step's loss, the accumulated gradient is micro_steps times too large
    dataset, vocab_size = windows_dataset(config)
    model = distributed.build_model(vocab_size, config)
    stream = rank_batches(dataset, config, 0, 1)
    micro = [next(stream) for _ in range(config.micro_steps)]
    summed = [sum(g) for g in zip(*(torch.autograd.grad(distributed.next_token_loss(model, b),
                                                        model.parameters()) for b in micro), strict=True)]
    whole = (torch.cat([b[0] for b in micro]), torch.cat([b[1] for b in micro]))
    mean = torch.autograd.grad(distributed.next_token_loss(model, whole), model.parameters())
    for s_, m in zip(summed, mean, strict=True):
        torch.testing.assert_close(s_, config.micro_steps * m, atol=1e-6, rtol=1e-4)


def test_sampler_deals_disjoint_shares_that_cover_the_global_batch():
    config = Config(num_windows=64, global_batch=8)
    dataset, _ = windows_dataset(config)
    x0, _ = next(rank_batches(dataset, config, 0, 2))
    x1, _ = next(rank_batches(dataset, config, 1, 2))
    assert x0.shape == x1.shape == (4, config.seq_len)  # per-rank batch = global batch / world size
    assert not any(torch.equal(a, b) for a in x0 for b in x1)


def test_clear_errors():
    with pytest.raises(ValueError, match="optimizer"):
        Config(optimizer="adam")
    with pytest.raises(ValueError, match="steps"):
        Config(steps=0)
    dataset, _ = windows_dataset(Config(num_windows=8))
    with pytest.raises(ValueError, match=r"multiple of world_size \* micro_steps = 3 \* 1"):
        next(rank_batches(dataset, Config(global_batch=16), 0, 3))
    with pytest.raises(ValueError, match=r"multiple of world_size \* micro_steps = 2 \* 3"):
        next(rank_batches(dataset, Config(global_batch=16, micro_steps=3), 0, 2))
    with pytest.raises(ValueError, match="micro_steps"):
        Config(micro_steps=0)
    with pytest.raises(ValueError, match="d_model"):
        launch("unused", config=Config(d_model=32))
    with pytest.raises(SystemExit):  # not started by torchrun
        distributed.main(["--out", "unused"])
