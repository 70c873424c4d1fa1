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

    def __len__(self) -> int:
        return len(self.tokens_N)

    def children(self, node: int) -> list[int]:
        return torch.nonzero(self.parent_N == node).flatten().tolist()


def ancestor_mask(parent_N: torch.Tensor, depth_N: torch.Tensor, max_depth: int | None = None) -> torch.Tensor:
    """Row i = i plus its ancestors; built depth by depth (parents precede children). With
    `max_depth` given, nothing reads back from the device (no host sync)."""
    N = len(parent_N)
    mask = torch.eye(N, dtype=torch.bool, device=parent_N.device)
    levels = max_depth if max_depth is not None else (int(depth_N.max()) if N > 1 else 0)
    parent = parent_N.clamp(min=0)
    for d in range(1, levels + 1):
        mask = torch.where((depth_N == d)[:, None], mask | mask[parent], mask)
    return mask


def assemble_tree(root: torch.Tensor, cand_tokens: torch.Tensor, cand_parent: torch.Tensor,
                  cand_score: torch.Tensor, cand_depth: torch.Tensor, num_nodes: int, max_depth: int | None = None) -> Tree:
    """EAGLE-2 rerank: keep the best num_nodes-1 candidates by cumulative log-prob.

    Candidates are listed in creation order (parents first); a stable sort keeps a parent ahead of
    a child with an equal score, so the chosen set is ancestor-closed even with ties. NaN scores
    (a broken head) sort last instead of corrupting the tree."""
    keep = min(num_nodes - 1, len(cand_tokens))
    score = torch.nan_to_num(cand_score, nan=float("-inf"))
    order = torch.sort(-score, stable=True).indices[:keep]
    chosen = torch.sort(order).values  # back to creation order = topological order
    position = torch.full((len(cand_tokens) + 1,), -1, dtype=torch.long, device=root.device)
    position[chosen] = torch.arange(1, keep + 1, device=root.device)
    parent = torch.where(cand_parent[chosen] < 0, torch.zeros_like(chosen), position[cand_parent[chosen]])
    tokens = torch.cat([root.view(1), cand_tokens[chosen]])
    parent = torch.cat([torch.tensor([-1], device=root.device), parent])
    depth = torch.cat([torch.zeros(1, dtype=torch.long, device=root.device), cand_depth[chosen]])
    return Tree(tokens, parent, depth, ancestor_mask(parent, depth, max_depth))


def static_tree(root: torch.Tensor, choices: list[list[int]], topk_tokens_DK: torch.Tensor) -> Tree:
    """Medusa-style choice list: path [a, b] = top-a at depth 1, then top-b at depth 2.
    `topk_tokens_DK[d]` are the ranked candidates for depth d+1 (heads that predict ahead)."""
    paths = sorted({tuple(c) for c in choices}, key=lambda p: (len(p), p))
    index = {(): 0}
    tokens, parent, depth = [int(root)], [-1], [0]
    for path in paths:
        if path[:-1] not in index:
            raise ValueError(f"tree choice {list(path)} lacks its parent {list(path[:-1])}")
        index[path] = len(tokens)
        tokens.append(int(topk_tokens_DK[len(path) - 1, path[-1]]))
        parent.append(index[path[:-1]])
        depth.append(len(path))
    device = topk_tokens_DK.device
    parent_t, depth_t = torch.tensor(parent, device=device), torch.tensor(depth, device=device)
    return Tree(torch.tensor(tokens, device=device), parent_t, depth_t, ancestor_mask(parent_t, depth_t))


def chain_tree(root: torch.Tensor, tokens: torch.Tensor) -> Tree:
    """A chain is the tree where every node has one child."""
    n = len(tokens) + 1
    parent = torch.arange(-1, n - 1, device=root.device)
    depth = torch.arange(n, device=root.device)
    return Tree(torch.cat([root.view(1), tokens]), parent, depth, torch.ones(n, n, dtype=torch.bool, device=root.device).tril())
