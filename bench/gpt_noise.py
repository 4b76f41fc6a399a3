"""GPT nano, one process: does Gaussian gradient noise in AdamW's preconditioned space train the shipped
recipe faster, as bq2's rounding did (docs/benchmarks.md, "Where GPT's time to target comes from")?

    python -m bench.gpt_noise exact 6 14 60      # noise std = block max / k, per 64-element block

The W=2 mean gradient of `gpt-nano-stdlib` (two batches of 16 windows, the shipped AdamW, warm-up and
cosine over 120 steps), with, from step 2, N(0, (s_b / k)^2) q^2 added per element: q = sqrt(v) + eps
from AdamW's state and s_b the max |g / q| over the element's 64-element block, as block-scaled qsum
rounds g / q (bq2's rounding noise at W=2 is about s_b / 6 in that space). Prints the evaluation loss
after 120 steps. A research aid for a documented observation, not part of the suite.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

from nfab.config.optim import build_optimizer, lr_factor
from nfab.config.shipped import resolve_config
from nfab.data import build_dataset, make_eval_loader
from nfab.models import build_model
from nfab.train.config import load_config
from nfab.train.loop import evaluate
from nfab.train.setup import BatchStream, loss_fn

BLOCK, STEPS = 64, 120


def block_noise(p: torch.Tensor, state: dict, k: float, gen: torch.Generator) -> torch.Tensor:
    """N(0, (s_b / k)^2) q^2 per element of `p.grad` (the module docstring's q and s_b)."""
    v = state.get("exp_avg_sq")
    q = v.sqrt() + 1e-8 if v is not None else torch.ones_like(p)
    x = (p.grad / q).reshape(-1)
    n = x.numel()
    blocks = torch.nn.functional.pad(x, (0, -n % BLOCK)).view(-1, BLOCK)
    s = blocks.abs().amax(1, keepdim=True).expand(-1, BLOCK).reshape(-1)[:n]
    return (torch.randn(n, generator=gen) * (s / k)).view_as(p) * q


def run(k: float | None, steps: int = STEPS) -> float:
    """Evaluation loss after `steps`, with noise of block max / `k` (None: the exact gradient)."""
    tc = load_config(resolve_config("gpt-nano-stdlib"), [f"steps={steps}"])
    spec = build_model(tc.model.name, seed=tc.seed, **tc.model.options)
    model = spec.module
    opt = build_optimizer(model, tc.optim, spec.optimizer)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, steps, tc.schedule))
    train = build_dataset(tc.data.name, split="train", seed=tc.seed, **tc.data.options)
    test = build_dataset(tc.data.name, split="test", seed=tc.seed, **tc.data.options)
    ranks = [BatchStream(train, batch_size=tc.data.batch_size, rank=r, world_size=2, seed=tc.seed) for r in range(2)]
    gen = torch.Generator().manual_seed(1)
    for step in range(steps):
        opt.zero_grad()
        for stream in ranks:  # the mean of two ranks' gradients, as DDP's
            x, y = stream.next()
            (loss_fn(spec.task, model(x), y) / len(ranks)).backward()
        if k is not None and step > 0:
            for p in model.parameters():
                p.grad.add_(block_noise(p, opt.state.get(p, {}), k, gen))
        opt.step()
        sched.step()
    loader = make_eval_loader(test, batch_size=tc.data.eval_batch_size, rank=0, world_size=1)
    return evaluate(model, loader, spec.task, tc.data.eval_batches, torch.device("cpu")).loss


def main(args: list[str]) -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("gloo", rank=0, world_size=1)  # `evaluate` all-reduces its sums
    for arg in args or ["exact", "6", "14", "60"]:
        k = None if arg == "exact" else float(arg)
        print(f"{arg}: evaluation loss {run(k):.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
