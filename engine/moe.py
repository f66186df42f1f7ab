"""Sparse mixture-of-experts MLP (Mixtral): a softmax router picks each token's top-k experts.

Routing is transformers' exactly: router logits -> softmax in float32 -> top-k -> weights renormalized to sum to
1. The experts run batched per step: the (token, expert) pairs are sorted by expert, each expert that got any
runs one GEMM over its contiguous slice of gathered tokens, and the weighted outputs are summed back per token
with one index_add_ (a token's k contributions in expert order, as transformers adds them). The only Python
loop is over experts, never over tokens.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.quant import Linear


class SparseMoE:
    def __init__(self, router: Linear, gate_up: list[Linear], down: list[Linear], top_k: int,
                 act: Callable[[torch.Tensor], torch.Tensor]) -> None:
        # router: [num_experts, hidden]; gate_up[e]: [2 * intermediate, hidden]; down[e]: [hidden, intermediate]
        if not len(gate_up) == len(down) >= top_k >= 1:
            raise ValueError(f"{len(gate_up)} gate_up and {len(down)} down experts for top_k {top_k}")
        self.router = router
        self.gate_up = gate_up
        self.down = down
        self.top_k = top_k
        self.act = act

    @property
    def num_experts(self) -> int:
        return len(self.gate_up)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [T, hidden] -> (weights [T, top_k] float32 summing to 1 per token, expert ids [T, top_k] int64)."""
        probs = torch.softmax(self.router.forward(x).float(), dim=-1)  # [T, num_experts]
        weights, expert_ids = torch.topk(probs, self.top_k, dim=-1)
        return weights / weights.sum(dim=-1, keepdim=True), expert_ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, hidden] -> [T, hidden] in x.dtype."""
        weights, expert_ids = self.route(x)
        flat_experts = expert_ids.flatten()  # [T * top_k], pair p = (token p // top_k, its (p % top_k)-th expert)
        order = torch.argsort(flat_experts, stable=True)  # pairs grouped by expert, tokens ascending within
        token_of_pair = order // self.top_k  # [T * top_k]
        counts = torch.bincount(flat_experts, minlength=self.num_experts).tolist()
        gathered = x.index_select(0, token_of_pair)  # [T * top_k, hidden], expert 0's tokens first
        expert_out = torch.empty_like(gathered)
        start = 0
        for e, count in enumerate(counts):
            if count == 0:
                continue
            rows = slice(start, start + count)
            gate, up = self.gate_up[e].forward(gathered[rows]).chunk(2, dim=-1)  # [count, intermediate] each
            expert_out[rows] = self.down[e].forward(self.act(gate) * up)
            start += count
        weighted = expert_out * weights.flatten()[order][:, None]  # float32 product, as transformers
        out = torch.zeros_like(x)
        return out.index_add_(0, token_of_pair, weighted.to(x.dtype))

    @property
    def nbytes(self) -> int:
        """Weight bytes of the router and every expert (a decode step may read any of them)."""
        return self.router.nbytes + sum(w.nbytes for w in self.gate_up) + sum(w.nbytes for w in self.down)
