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
    with pytest.raises(ValueError, match="multiple of world_size=3"):
        next(rank_batches(dataset, Config(global_batch=16), 0, 3))
    with pytest.raises(ValueError, match="d_model"):
        launch("unused", config=Config(d_model=32))
    with pytest.raises(SystemExit):  # not started by torchrun
        distributed.main(["--out", "unused"])
