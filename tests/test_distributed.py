"""Data parallelism: two torchrun ranks (Gloo, CPU) train the GPT with DDP and with FSDP to the parameters
of one process trained on the whole global batch; DDP's buckets (one at the first step, then rebuilt in the
order the gradients arrived); FSDP's collectives counted per step, with and without gradient accumulation;
the pitfalls' demonstrations; the sampler deals disjoint shares; clear errors."""

import json
from itertools import accumulate

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
    launch(tmp_path, nproc=2, config=config, timeout=240, demonstrations=True)
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
    # the mean of the ranks' losses is the loss of the global batch, and what the ranks log
    mean_losses = [(a + b) / 2 for a, b in zip(reports[0]["ddp"]["losses"], reports[1]["ddp"]["losses"], strict=True)]
    assert mean_losses == pytest.approx(reference_losses, abs=LOSS_TOLERANCE[backend])
    for report in reports:
        assert report["ddp"]["logged_losses"] == pytest.approx(mean_losses, abs=1e-12)
    assert reference_losses[-1] < reference_losses[0]

    # FSDP: each rank stores about half of every parameter, gradient and momentum buffer; DDP all of them
    total = sum(p.numel() for p in reference.parameters())
    for report in reports:
        assert report["ddp"]["stored"] == {"parameters": total, "gradients": total, "optimizer": total}
    for kind in ("parameters", "gradients", "optimizer"):
        shares = [report["fsdp"]["stored"][kind] for report in reports]
        assert sum(shares) == total
        assert max(shares) - min(shares) <= 2 * 64 * 4  # dim-0 chunks: a row per tensor at most
    # DDP all-reduced every gradient exactly once per step, in buckets
    names = [name for name, _ in reference.named_parameters()]
    for step in ("first_step", "last_step"):
        buckets = reports[0]["ddp"][step]["buckets"]
        assert sorted(name for bucket in buckets for name in bucket["parameters"]) == sorted(names), step
        assert sum(bucket["elements"] for bucket in buckets) == total, step
        # each bucket leaves as soon as backward has computed its last gradient
        assert [b["ready"] for b in buckets] == list(accumulate(len(b["parameters"]) for b in buckets)), step
        assert all(b["launched"] <= b["finished"] for b in buckets), step
    # the first step: one bucket of every gradient, sent when backward is over; then DDP rebuilds the
    # buckets in the order the first backward computed the gradients, and the first leaves early
    first, last = reports[0]["ddp"]["first_step"], reports[0]["ddp"]["last_step"]
    assert len(first["buckets"]) == 1 and first["buckets"][0]["ready"] == len(names)
    assert len(last["buckets"]) > 1 and last["buckets"][0]["ready"] < len(names)
    assert [n for b in last["buckets"] for n in b["parameters"]] == first["order"] == last["order"]
    assert sorted(first["order"]) == sorted(names) and first["order"] != names

    # FSDP's collectives per step: each block's weights gathered in forward and again in backward, the
    # root's once (kept from forward to backward); every unit's gradients reduce-scattered once
    layers = config.num_layers
    for report in reports:
        for step in ("collectives_first_step", "collectives_last_step"):
            calls = report["fsdp"][step]
            assert calls["all_gather"]["calls"] == 2 * layers + 1
            assert calls["reduce_scatter"]["calls"] == layers + 1
            padded = calls["reduce_scatter"]["numbers"]  # every unit once, padded to split evenly
            assert total <= padded < total + 2 * 64 * layers + 4 * 64
            assert padded < calls["all_gather"]["numbers"] < 2 * padded
        held = report["fsdp"]["gradients_held"]  # a local micro-step holds full gradients
        assert held == {"local": total, "synced": report["fsdp"]["stored"]["gradients"]}

    # the demonstrations: rank-offset seeds repaired by DDP, mixed by FSDP; dropout masks; a
    # collective on rank 0 only times out; the timing of 37 all-reduces against one bucket
    demos = [report["demonstrations"] for report in reports]
    assert [d["seeding"]["differs_before_wrapping"] for d in demos] == [False, True]
    for d in demos:
        seeding = d["seeding"]
        assert seeding["equal_after_wrapping"]
        assert seeding["rows_from_seed"] == [32, 31] and seeding["table_rows"] == 63
        assert seeding["identical_masks"] == {"shared": True, "per_rank": False}
        timing = d["allreduce_timing"]
        assert len(timing["separate_s"]) == len(timing["bucket_s"]) > 0
        assert min(timing["separate_s"] + timing["bucket_s"]) > 0
    hang = demos[0]["mismatched_collective"]
    assert hang["called"] and hang["error"] == "RuntimeError" and "Timed out" in hang["message"]
    assert hang["waited_s"] >= 1.9
    assert demos[1]["mismatched_collective"] == {"called": False}


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
    if report["backend"] == "gloo":  # FSDP reduce-scattering every micro-step: the same training
        synced = torch.load(tmp_path / "fsdp_synced.pt")
        for name, p in reference.named_parameters():
            torch.testing.assert_close(synced[name], p.detach().cpu(), atol=tolerance, rtol=0, msg=name)
    total = sum(p.numel() for p in reference.parameters())
    for step in ("first_step", "last_step"):  # one all-reduce of each gradient
        assert sum(bucket["elements"] for bucket in report["ddp"][step]["buckets"]) == total, step
    # FSDP still all-gathers at every micro-step; it reduce-scatters once a step inside no_sync, at every
    # micro-step without; and a local micro-step leaves full gradients on the rank
    layers, micro = config.num_layers, config.micro_steps
    for scheme, scatters in (("fsdp", layers + 1), ("fsdp_synced", micro * (layers + 1))):
        calls = report[scheme]["collectives_last_step"]
        assert calls["all_gather"]["calls"] == micro * (2 * layers + 1), scheme
        assert calls["reduce_scatter"]["calls"] == scatters, scheme
    assert report["fsdp"]["gradients_held"]["local"] == total
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
