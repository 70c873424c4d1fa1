"""Draft trees with a fixed node count N: node 0 is the root (the token the target last chose,
not yet in its KV cache); nodes are in topological order (every parent before its children).

`mask_NN[i, j]` is True when j is i itself or one of its ancestors; `depth_N` gives RoPE positions."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Tree:
    tokens_N: torch.Tensor   # target vocabulary ids
    parent_N: torch.Tensor   # parent index, -1 for the root
    depth_N: torch.Tensor
    mask_NN: torch.Tensor
    # sampled drafts: `proposal_RV[child_proposal_N[n]]` is the distribution node n's children were
    # drawn from, without replacement and in child order (-1 / None: deterministic drafts)
    proposal_RV: torch.Tensor | None = None
    child_proposal_N: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.tokens_N)

    def children(self, node: int) -> list[int]:
        return torch.nonzero(self.parent_N == node).flatten().tolist()


def ancestor_mask(parent_N: torch.Tensor, depth_N: torch.Tensor, max_depth: int | None = None) -> torch.Tensor:
    """Row i = i plus its ancestors; built depth by depth (parents precede children). Leading batch
    dimensions are kept ([..., N] -> [..., N, N]). With `max_depth` given, nothing reads back from the
    device (no host sync)."""
    N = parent_N.shape[-1]
    mask = torch.eye(N, dtype=torch.bool, device=parent_N.device).expand(*parent_N.shape[:-1], N, N).clone()
    levels = max_depth if max_depth is not None else (int(depth_N.max()) if N > 1 else 0)
    parent = parent_N.clamp(min=0)[..., :, None].expand(mask.shape)
    for d in range(1, levels + 1):
        mask = torch.where((depth_N == d)[..., None], mask | mask.gather(-2, parent), mask)
    return mask


def assemble_trees(roots_B: torch.Tensor, tokens_BC: torch.Tensor, parent_BC: torch.Tensor, score_BC: torch.Tensor,
                   depth_BC: torch.Tensor, num_nodes: int, max_depth: int | None = None) -> list[Tree]:
    """EAGLE-2 rerank, for B rows at once: each row keeps its best num_nodes-1 candidates by cumulative
    log-prob. Candidates are listed in creation order (parents first); a stable sort keeps a parent
    ahead of a child with an equal score, so the chosen set is ancestor-closed even with ties. NaN
    scores (a broken head) sort last instead of corrupting the tree."""
    B, C = tokens_BC.shape
    keep, dev = min(num_nodes - 1, C), roots_B.device
    score = torch.nan_to_num(score_BC, nan=float("-inf"))
    order = torch.sort(-score, dim=-1, stable=True).indices[:, :keep]
    chosen = torch.sort(order, dim=-1).values  # back to creation order = topological order
    position = torch.full((B, C), -1, dtype=torch.long, device=dev)
    position.scatter_(1, chosen, torch.arange(1, keep + 1, device=dev).expand(B, keep))
    chosen_parent = parent_BC.gather(1, chosen)
    parent = torch.where(chosen_parent < 0, 0, position.gather(1, chosen_parent.clamp(min=0)))
    tokens = torch.cat([roots_B.view(B, 1), tokens_BC.gather(1, chosen)], 1)
    parent = torch.cat([torch.full((B, 1), -1, dtype=torch.long, device=dev), parent], 1)
    depth = torch.cat([torch.zeros(B, 1, dtype=torch.long, device=dev), depth_BC.gather(1, chosen)], 1)
    mask = ancestor_mask(parent, depth, max_depth)
    return [Tree(tokens[b], parent[b], depth[b], mask[b]) for b in range(B)]


def assemble_tree(root: torch.Tensor, cand_tokens: torch.Tensor, cand_parent: torch.Tensor,
                  cand_score: torch.Tensor, cand_depth: torch.Tensor, num_nodes: int, max_depth: int | None = None) -> Tree:
    """One row of `assemble_trees`."""
    return assemble_trees(root.view(1), cand_tokens[None], cand_parent[None], cand_score[None], cand_depth[None],
                          num_nodes, max_depth)[0]


class StaticLayout:
    """A Medusa-style choice list, laid out once: path [a, b] = rank a at depth 1, then rank b at
    depth 2 (ranks of the heads' candidates, one head per depth). Each step only gathers tokens,
    on the device. With `by_child_order`, node j-th-child-of-its-parent takes candidate j instead of
    its rank: sampled drafts then give every parent the first samples of its depth (lossless
    verification with proposals needs that)."""

    def __init__(self, choices: list[list[int]], device=None):
        paths = sorted({tuple(c) for c in choices}, key=lambda p: (len(p), p))
        index, parent, depth, rank, order = {(): 0}, [-1], [0], [0], [0]
        children = {}
        for path in paths:
            if not path or min(path) < 0:
                raise ValueError(f"tree choice {list(path)}: expected a non-empty list of ranks >= 0")
            if path[:-1] not in index:
                raise ValueError(f"tree choice {list(path)} lacks its parent {list(path[:-1])}")
            index[path] = len(parent)
            parent.append(index[path[:-1]])
            depth.append(len(path))
            rank.append(path[-1])
            order.append(children.setdefault(path[:-1], 0))
            children[path[:-1]] += 1
        self.choices = [list(p) for p in paths]
        self.max_depth = max(depth)
        self.max_rank = max(rank) + 1
        self.parent_N = torch.tensor(parent, device=device)
        self.depth_N = torch.tensor(depth, device=device)
        self.rank_N = torch.tensor(rank, device=device)
        self.order_N = torch.tensor(order, device=device)
        self.mask_NN = ancestor_mask(self.parent_N, self.depth_N)

    def __len__(self) -> int:
        return len(self.parent_N)

    def tree(self, root: torch.Tensor, candidates_DK: torch.Tensor, by_child_order: bool = False) -> Tree:
        """`candidates_DK[d]`: ranked (or sampled) candidates for depth d+1."""
        column = self.order_N if by_child_order else self.rank_N
        picked = candidates_DK[(self.depth_N - 1).clamp(min=0), column]
        tokens = torch.where(self.depth_N == 0, root.view(1), picked)
        return Tree(tokens, self.parent_N, self.depth_N, self.mask_NN)


def static_tree(root: torch.Tensor, choices: list[list[int]], topk_tokens_DK: torch.Tensor) -> Tree:
    """One tree from a choice list and ranked candidates (see `StaticLayout`)."""
    return StaticLayout(choices, topk_tokens_DK.device).tree(root, topk_tokens_DK)


def tree_from_accuracies(accuracy_DK: list[list[float]], num_nodes: int, spine: int = 0) -> list[list[int]]:
    """The Medusa paper's accuracy-built tree: `accuracy_DK[d][r]` is the measured probability that
    depth d+1's rank-r candidate is the right token. A path's expected contribution to the
    acceptance length is the product of its ranks' accuracies (independence assumed); greedily add
    the child of an existing node with the largest product until the tree holds `num_nodes` nodes
    (root included). With `spine` d, the rank-0 chain to depth d is in the tree first. Returns the choice list."""
    import heapq
    depth_max, ranks = len(accuracy_DK), len(accuracy_DK[0]) if accuracy_DK else 0
    chosen = [[0] * d for d in range(1, min(spine, depth_max, num_nodes - 1) + 1)]
    heap, score = [], 1.0
    for path in [()] + [tuple(c) for c in chosen]:  # every child of the root and of the spine not in it yet
        score *= accuracy_DK[len(path) - 1][0] if path else 1.0
        heap += [(-score * accuracy_DK[len(path)][r], path + (r,)) for r in range(ranks)
                 if len(path) < depth_max and list(path + (r,)) not in chosen]
    heapq.heapify(heap)
    while heap and len(chosen) < num_nodes - 1:
        neg, path = heapq.heappop(heap)
        chosen.append(list(path))
        if len(path) < depth_max:
            for r in range(ranks):
                heapq.heappush(heap, (neg * accuracy_DK[len(path)][r], path + (r,)))
    return chosen


def chain_tree(root: torch.Tensor, tokens: torch.Tensor) -> Tree:
    """A chain is the tree where every node has one child."""
    n = len(tokens) + 1
    parent = torch.arange(-1, n - 1, device=root.device)
    depth = torch.arange(n, device=root.device)
    return Tree(torch.cat([root.view(1), tokens]), parent, depth, torch.ones(n, n, dtype=torch.bool, device=root.device).tril())


class Chains:
    """Every row's chain of drafts, [root, drafts_BK[b]]: a sequence of `chain_tree`s built on demand, with the batch's
    tokens [B, 1 + K] at hand (`tokens_BN`), so that the batched runtime pads and verifies the chains of all rows at
    once, without a host step per row."""

    def __init__(self, roots_B: torch.Tensor, drafts_BK: torch.Tensor):
        self.tokens_BN = torch.cat([roots_B.view(-1, 1), drafts_BK], dim=1)

    def __len__(self) -> int:
        return len(self.tokens_BN)

    def __getitem__(self, b: int) -> Tree:
        if not -len(self) <= b < len(self):
            raise IndexError(b)
        return chain_tree(self.tokens_BN[b, 0], self.tokens_BN[b, 1:])

    def __iter__(self):
        return (self[b] for b in range(len(self)))


def marginal_trees(roots_B: torch.Tensor, logits_BDV: torch.Tensor, top_k: int, num_nodes: int, to_target=None):
    """A parallel drafter's trees (DDTree, for DFlash and P-EAGLE), one per row: `logits_BDV[b, d]` is depth d+1's
    distribution, drafted in one forward without seeing the tokens before it, so a path's probability is the product
    of its tokens' marginals. The best-first tree on those products (`tree_from_accuracies`, each depth's `top_k` most
    likely tokens as ranks) of `num_nodes` nodes; `top_k` 1 is the chain of argmaxes (one argmax for every row).
    `to_target` maps draft-vocabulary ids to the target's."""
    if top_k <= 1:
        tokens = logits_BDV[:, :num_nodes - 1].argmax(-1)
        tokens = to_target(tokens) if to_target is not None else tokens
        return Chains(roots_B, tokens)
    probs, tokens = torch.softmax(logits_BDV.float(), dim=-1).topk(top_k, dim=-1)
    tokens = to_target(tokens) if to_target is not None else tokens
    return [static_tree(root, tree_from_accuracies(p.tolist(), num_nodes, spine=len(p)), t) for root, p, t in zip(roots_B, probs, tokens)]
