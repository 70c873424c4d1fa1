"""Drafting with Medusa heads: one forward of the K heads on the target's last feature gives
candidates for depths 1..K at once; a static tree (a Medusa choice list, or one built from the
heads' measured per-rank accuracies, `calibrate`) arranges them. No draft KV cache: the heads read
only the target's feature at the last committed position.

Greedy: rank r at depth d is head d's r-th most likely token. Sampling: every depth's candidates
are drawn without replacement from the head's distribution (Gumbel top-k), child j of any parent
takes draw j, and the tree carries those distributions as proposals, so verification
(runtime/verify.py) stays lossless."""
from __future__ import annotations

import torch

from draftsmith.heads.drafting import BatchOfOne, Commits, TreeConfig, eager
from draftsmith.heads.tree import StaticLayout, Tree, tree_from_accuracies

PRIOR_FIRST, PRIOR_DECAY = 0.6, 0.5  # accuracy prior for a tree built before any calibration


class MedusaDrafter(BatchOfOne):
    """B rows: one forward of the heads over every row's last committed feature per round."""

    def __init__(self, head, max_len: int, tree: TreeConfig, compile_step=eager, batch_size: int = 1):
        self.head, self.tree_cfg, self.batch_size = head, tree, batch_size
        self.depth = min(tree.depth, head.num_heads)
        self.device = next(head.parameters()).device
        self.feature_BH = None
        self.temperature, self.gen = 0.0, None
        self.set_choices(tree.choices or tree_from_accuracies(
            [[PRIOR_FIRST * PRIOR_DECAY ** (r + d) for r in range(tree.top_k)] for d in range(self.depth)], tree.num_nodes))

    def set_choices(self, choices: list[list[int]]) -> None:
        layout = StaticLayout(choices, self.device)
        if layout.max_depth > self.head.num_heads:
            raise ValueError(f"tree choices reach depth {layout.max_depth}, but the head has {self.head.num_heads} Medusa heads")
        self.layout, self.tree_cfg.choices = layout, layout.choices
        self.num_candidates = max(layout.max_rank, 1)

    def set_sampling(self, temperature: float, gen: torch.Generator | None) -> None:
        """Greedy (temperature 0) drafts take the top ranks; otherwise drafts are sampled."""
        self.temperature, self.gen = temperature, gen

    def reset(self) -> None:
        self.feature_BH = None

    def commit(self, commits: Commits) -> None:
        """Each row keeps the feature at its last committed position."""
        feats, counts_B = commits.feats_BTK, commits.counts_B
        if self.feature_BH is None:
            self.feature_BH = feats.new_zeros(self.batch_size, feats.shape[-1])
        if any(commits.counts):
            last = feats[torch.arange(self.batch_size, device=feats.device), (counts_B - 1).clamp(min=0)]
            self.feature_BH = torch.where((counts_B > 0)[:, None], last, self.feature_BH)

    @torch.no_grad()
    def draft_trees(self, roots_B: torch.Tensor) -> list[Tree]:
        D = self.layout.max_depth
        logits_DBV = self.head.head_logits(self.feature_BH[:, None])[:D, :, 0].float()
        if self.temperature <= 0:
            ranked_DBK = torch.topk(logits_DBV, self.num_candidates, dim=-1).indices
            return [self.layout.tree(root, ranked_DBK[:, b]) for b, root in enumerate(roots_B)]
        return [self._sampled_tree(root, logits_DBV[:, b]) for b, root in enumerate(roots_B)]

    def _sampled_tree(self, root: torch.Tensor, logits_DV: torch.Tensor) -> Tree:
        D = self.layout.max_depth
        probs_DV = torch.softmax(logits_DV / self.temperature, dim=-1)
        uniform = torch.rand(probs_DV.shape, generator=self.gen, device=probs_DV.device).clamp_(min=1e-20)
        keys = torch.log(probs_DV) - torch.log(-torch.log(uniform))  # Gumbel top-k = draws without replacement
        tree = self.layout.tree(root, torch.topk(keys, self.num_candidates, dim=-1).indices, by_child_order=True)
        tree.proposal_RV = probs_DV
        tree.child_proposal_N = torch.where(tree.depth_N < D, tree.depth_N, -1)
        return tree

    @torch.no_grad()
    def calibrate(self, sequences: list[tuple[torch.Tensor, int]], features_of) -> dict:
        """Measure each head's per-rank accuracy on the target's own continuations (token sequences
        with the index where the continuation starts; `features_of(tokens) -> features_TH`) and
        rebuild the tree from them (`tree_from_accuracies`, num_nodes from the tree config)."""
        D, R = self.depth, self.tree_cfg.top_k
        hits, counts = torch.zeros(D, R), torch.zeros(D)
        for tokens, start in sequences:
            logits_DTV = self.head.head_logits(features_of(tokens)[None].to(next(self.head.parameters()).dtype))[:D, 0]
            for d in range(D):
                positions = torch.arange(max(start - 2 - d, 0), len(tokens) - 2 - d, device=tokens.device)
                if len(positions) == 0:
                    continue
                truth = tokens[positions + 2 + d]
                ranked = torch.topk(logits_DTV[d, positions].float(), R, dim=-1).indices
                hits[d] += (ranked == truth[:, None]).sum(0).float().cpu()
                counts[d] += len(positions)
        accuracy = (hits / counts.clamp(min=1)[:, None]).tolist()
        self.set_choices(tree_from_accuracies(accuracy, self.tree_cfg.num_nodes))
        return {"per_head_rank_accuracy": accuracy, "per_head_top1": [a[0] for a in accuracy],
                "num_positions": counts.tolist(), "choices": self.tree_cfg.choices}
