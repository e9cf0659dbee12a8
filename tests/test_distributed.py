"""Data parallelism: two torchrun ranks (Gloo, CPU) train the GPT with DDP and with FSDP to the parameters
of one process trained on the whole global batch; the sampler deals disjoint shares; clear errors."""

import json

import pytest
import torch
from attnbook import distributed
from attnbook.distributed import Config, launch, rank_batches, train_averaging, train_single, windows_dataset

STEPS = 5  # enough for the optimizer's momentum to matter; the launch itself is most of the ~10 s


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

    for name in ranks[0]:  # DDP keeps the replicas identical, bit for bit
        assert torch.equal(ranks[0][name], ranks[1][name]), name
    reference, reference_losses = train_single(config)
    averaged, _ = train_averaging(config)
    for name, p in reference.named_parameters():
        torch.testing.assert_close(ranks[0][name], p.detach(), atol=1e-6, rtol=0)  # only the sums' order differs
        torch.testing.assert_close(fsdp[name], p.detach(), atol=1e-6, rtol=0)
    if reports[0]["backend"] == "gloo":  # same CPU kernels: DDP = the averaged per-rank gradients, exactly
        for name, p in averaged.named_parameters():
            assert torch.equal(ranks[0][name], p.detach()), name
    # the mean of the ranks' losses is the loss of the global batch
    mean_losses = [(a + b) / 2 for a, b in zip(reports[0]["ddp"]["losses"], reports[1]["ddp"]["losses"], strict=True)]
    assert mean_losses == pytest.approx(reference_losses, abs=1e-5)
    assert reference_losses[-1] < reference_losses[0]

    # FSDP: each rank stores about half of every parameter, gradient and momentum buffer; DDP all of them
    total = sum(p.numel() for p in reference.parameters())
    for report in reports:
        assert report["ddp"]["stored"] == {"parameters": total, "gradients": total, "optimizer": total}
    for kind in ("parameters", "gradients", "optimizer"):
        shares = [report["fsdp"]["stored"][kind] for report in reports]
        assert sum(shares) == total
        assert max(shares) - min(shares) <= 2 * 64 * 4  # dim-0 chunks: a row per tensor at most
    # DDP all-reduced its gradients in several buckets, the last parameters' first (their gradients are ready first)
    buckets = reports[0]["ddp"]["buckets_last_step"]
    assert len(buckets) > 1
    assert buckets[0]["parameters"][0] == "lm_head.weight"
    assert sum(b["elements"] for b in buckets) == total


def test_sampler_deals_disjoint_shares_that_cover_the_global_batch():
    config = Config(num_windows=64, global_batch=8)
    dataset, _ = windows_dataset(config)
    x0, _ = next(rank_batches(dataset, config, 0, 2))
    x1, _ = next(rank_batches(dataset, config, 1, 2))
    assert x0.shape == x1.shape == (4, config.block_size)  # per-rank batch = global batch / world size
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
