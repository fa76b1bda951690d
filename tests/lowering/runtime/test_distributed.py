"""The emitted module under torch.nn.parallel.DistributedDataParallel (gloo, CPU, 2 processes on
the loopback interface): the implicit-gradient backward feeds DDP's all-reduce like any layer."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import lowering
from convex_eq import models

T64 = torch.float64


def _layer():
    return lowering.lower(models.opteq(n=6, m=6, d=3, seed=0))


def _data():
    g = torch.Generator().manual_seed(0)
    return torch.randn(8, 3, generator=g, dtype=T64), torch.randn(8, 6, generator=g, dtype=T64)


def _worker(rank: int, world: int, port: int, out: str) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    m = _layer().torch_module(dtype=T64, tol=1e-12, max_iter=300)
    ddp = torch.nn.parallel.DistributedDataParallel(m)
    x, c = _data()
    part = slice(rank * 4, rank * 4 + 4)
    loss = (ddp(x[part]) * c[part]).sum() / 8 * world  # mean over the full batch, averaged
    loss.backward()
    if rank == 0:
        torch.save({k: p.grad.clone() for k, p in m.weights.items()}, out)
    # both ranks leave together: a rank tearing gloo down while the other still writes its
    # result aborted once ("terminate called without an active exception") under load
    dist.barrier()
    dist.destroy_process_group()


def test_ddp_gradients_equal_the_single_process_gradient(tmp_path):
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.fail("torch.distributed with gloo is part of every CPU wheel this project pins")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = str(tmp_path / "grads.pt")
    mp.spawn(_worker, args=(2, port, out), nprocs=2, join=True)
    got = torch.load(out)
    m = _layer().torch_module(dtype=T64, tol=1e-12, max_iter=300)
    x, c = _data()
    ((m(x) * c).sum() / 8).backward()
    for k, p in m.weights.items():
        # both sides solve to 1e-12 in float64; the all-reduce sums two halves: ≤ 1e-9 relative
        assert torch.allclose(got[k], p.grad, rtol=1e-9, atol=1e-12), k
