"""torchrun worker for tests/test_logprobs.py: fsdp_train's chunked log-probs under FSDP2.

    torchrun --nproc_per_node N tests/helpers/logprob_worker.py MODEL_PATH OUT_DIR --chunk-sizes 0,16,40

For each chunk size, on the same FSDP2 model: compute_logprobs (no grad) and one train_step whose
optimizer only records the gradients it is handed (grad_clip = inf leaves them as they are). The batch
(test_logprobs.batch) is split unequally over the ranks and into several micro-batches. Each rank saves
its rows' log-probs and entropy, rank 0 the full gradients; every rank reports what FSDP2 left behind.
"""

import argparse
import math
import os

import torch
from test_logprobs import ENTROPY_COEF, TEMPERATURE, batch, weighted_loss
from torch.distributed.tensor import DTensor
from trainer_models import load_as_a_run

import fsdp_train as ft
import losses
from reporting import report, shut_down

ROWS = {1: [[0, 1, 2, 3, 4, 5]], 2: [[0, 1, 3, 4], [2, 5]]}  # rank -> rows (rank 1: the empty and a short one)


class GradRecorder(torch.optim.Optimizer):
    """An "optimizer" that keeps a full copy of every gradient it is given and changes nothing."""

    def __init__(self, named_params):
        self.names = [n for n, _ in named_params]
        super().__init__([p for _, p in named_params], {})
        self.grads = {}

    def step(self, closure=None):
        for name, p in zip(self.names, self.param_groups[0]["params"], strict=True):
            g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            self.grads[name] = g.detach().clone()


def optimizer_after_a_no_grad_forward(model, mine) -> bool:
    """A no-grad forward leaves the FSDP2 root unsharded; an optimizer built then must still train every
    parameter (make_optimizer reshards first). True when one AdamW step changed every local shard."""
    with torch.no_grad():
        ft._forward(model, mine, TEMPERATURE)
    optimizer, _ = ft.make_optimizer(model, lr=1e-2)
    params = optimizer.param_groups[0]["params"]
    local = lambda p: p.detach().to_local() if isinstance(p, DTensor) else p.detach()  # noqa: E731 (no collective)
    before = [local(p).clone() for p in params]
    ft.train_step(
        model,
        optimizer,
        mine,
        weighted_loss,
        temperature=TEMPERATURE,
        max_tokens=48,
        entropy_fn=losses.entropy_from_logits,
    )
    return all(not torch.equal(b, local(p)) for b, p in zip(before, params, strict=True))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("out")
    ap.add_argument("--chunk-sizes", default="0,16,40")
    args = ap.parse_args()
    rank, world, device = ft.init_distributed()
    model = load_as_a_run(args.model, device=device)
    full = batch(model.config.vocab_size)
    rows = ROWS[world][rank]
    mine = ft.select(full, rows)
    recorder = GradRecorder(list(model.named_parameters()))  # before any forward: the sharded parameters
    state = {}
    for chunk in map(int, args.chunk_sizes.split(",")):
        logp, entropy = ft.compute_logprobs(
            model, mine, temperature=TEMPERATURE, max_tokens=48, entropy_fn=losses.entropy_from_logits, chunk_size=chunk
        )
        resharded = all(isinstance(p, DTensor) for p in model.parameters()) if world > 1 else True
        metrics = ft.train_step(
            model,
            recorder,
            mine,
            weighted_loss,
            temperature=TEMPERATURE,
            max_tokens=48,
            grad_clip=math.inf,
            entropy_fn=losses.entropy_from_logits,
            chunk_size=chunk,
        )
        torch.save(
            {"rows": rows, "logp": logp, "entropy": entropy}, os.path.join(args.out, f"logp_c{chunk}_rank{rank}.pt")
        )
        if rank == 0:
            torch.save(recorder.grads, os.path.join(args.out, f"grads_c{chunk}.pt"))
        recorder.grads = {}
        state[chunk] = {
            "loss": metrics["loss"],
            "resharded_after_logprobs": resharded,
            "grads_freed": all(p.grad is None for p in model.parameters()),
        }
    report(
        rank,
        {"state": state, "entropy_coef": ENTROPY_COEF, "all_trained": optimizer_after_a_no_grad_forward(model, mine)},
    )
    shut_down()


if __name__ == "__main__":
    main()
