"""Run under torchrun (gloo, CPU): one sample split over the world as a sequence-parallel group, for each
TTT kind, with and without step checkpointing and small blocks; rank 0 compares the loss, every metric and
every gradient (summed over the group) with the whole sample in one process and writes the differences.

    python -m torch.distributed.run --nproc-per-node=P tests/sequence_parallel_worker.py OUT.json T"""
import json
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
from test_long_sequences import _batch, _head  # noqa: E402  the same tiny heads and samples as the one-process tests

from draftsmith.heads import objective, ttt  # noqa: E402
from draftsmith.heads.ttt import SequenceShard  # noqa: E402


def run(head, batch):
    head.zero_grad()
    loss, metrics = head.loss(batch)
    loss.backward()
    return metrics, {n: p.grad.clone() for n, p in head.named_parameters() if p.grad is not None}


def main(out: str, num_tokens: int) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(list(range(world)))
    worst = {}
    for kind in ("eagle3", "eagle2", "mtp"):
        for checkpointed in (False, True):
            head = _head(kind)
            head.eval()
            ttt.SCORE_BUDGET, objective.LOSS_BUDGET = (2 * 4 * 5 * 50, 2 * 64 * 4) if checkpointed else (2 ** 24, 2 ** 25)
            head.checkpoint_steps = checkpointed
            batch = _batch(head, T=num_tokens)
            whole_metrics, whole_grads = run(head, dict(batch))
            metrics, grads = run(head, {**batch, "sequence_shard": SequenceShard.split(num_tokens, rank, world, group)})
            for grad in grads.values():
                dist.all_reduce(grad, group=group)
            assert grads.keys() == whole_grads.keys()
            diffs = {f"grad {n}": float((g - whole_grads[n]).abs().max() / whole_grads[n].abs().max().clamp(min=1e-12))
                     for n, g in grads.items()}
            diffs.update({f"metric {n}": float((metrics[n].float() - v.float()).abs()) for n, v in whole_metrics.items()})
            worst[f"{kind}{'+ckpt' if checkpointed else ''}"] = {"max": max(diffs.values()), "where": max(diffs, key=diffs.get),
                                                                 "num_compared": len(diffs)}
    if rank == 0:
        with open(out, "w") as f:
            json.dump(worst, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
