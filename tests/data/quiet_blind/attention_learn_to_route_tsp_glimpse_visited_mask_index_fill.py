"""Attention Model for TSP (Kool et al.): decoder glimpse and pointer logits masked by visited nodes via indexing.

Follows wouterkool/attention-learn-to-route nets/attention_model.py@f563e33dd43924e7f4c3f97da1a010a36fe96cf5
(AttentionModel._precompute, _get_parallel_step_context with W_placeholder, _one_to_many_logits:
``compatibility[mask[None, :, :, None, :].expand_as(compatibility)] = -math.inf`` and ``logits[mask] = -math.inf``
after tanh clipping), problems/tsp/state_tsp.py (StateTSP.visited_ as uint8, get_mask = visited_ > 0) and
nets/graph_encoder.py (GraphAttentionEncoder: full attention over all nodes, no mask). Recalled; greedy decoding.
Mask meant: encoder -- every node attends to every node of its own graph; decoder -- at each step the context
query (graph mean + first + last node) glimpses only the not-yet-visited nodes, and the pointer can select only
those, so the tour is a permutation.
"""
import math
from typing import NamedTuple

import torch
import torch.nn as nn


class StateTSP(NamedTuple):
    first_a: torch.Tensor
    prev_a: torch.Tensor
    visited_: torch.Tensor  # [batch, 1, n] uint8, 1 = visited
    i: torch.Tensor

    @staticmethod
    def initialize(loc):
        batch_size, n_loc, _ = loc.size()
        prev_a = torch.zeros(batch_size, 1, dtype=torch.long)
        return StateTSP(prev_a, prev_a, torch.zeros(batch_size, 1, n_loc, dtype=torch.uint8), torch.zeros(1, dtype=torch.int64))

    def update(self, selected):
        prev_a = selected[:, None]
        first_a = prev_a if self.i.item() == 0 else self.first_a
        visited_ = self.visited_.scatter(-1, prev_a[:, :, None], 1)
        return self._replace(first_a=first_a, prev_a=prev_a, visited_=visited_, i=self.i + 1)

    def get_mask(self):
        return self.visited_ > 0  # True = may not be visited again


class MultiHeadAttentionLayer(nn.Module):
    def __init__(self, n_heads, embed_dim):
        super().__init__()
        self.mha = nn.MultiheadAttention(embed_dim, n_heads, batch_first=True)
        self.norm1, self.norm2 = nn.BatchNorm1d(embed_dim), nn.BatchNorm1d(embed_dim)
        self.ff = nn.Sequential(nn.Linear(embed_dim, 64), nn.ReLU(), nn.Linear(64, embed_dim))

    def forward(self, h):
        h = h + self.mha(h, h, h, need_weights=False)[0]
        h = self.norm1(h.transpose(1, 2)).transpose(1, 2)
        h = h + self.ff(h)
        return self.norm2(h.transpose(1, 2)).transpose(1, 2)


class AttentionModel(nn.Module):
    def __init__(self, embedding_dim=32, n_encode_layers=2, tanh_clipping=10.0, mask_inner=True, mask_logits=True, n_heads=4):
        super().__init__()
        self.embedding_dim, self.n_heads = embedding_dim, n_heads
        self.tanh_clipping, self.mask_inner, self.mask_logits = tanh_clipping, mask_inner, mask_logits
        self.init_embed = nn.Linear(2, embedding_dim)
        self.embedder = nn.Sequential(*(MultiHeadAttentionLayer(n_heads, embedding_dim) for _ in range(n_encode_layers)))
        self.W_placeholder = nn.Parameter(torch.Tensor(2 * embedding_dim).uniform_(-1, 1))
        self.project_node_embeddings = nn.Linear(embedding_dim, 3 * embedding_dim, bias=False)
        self.project_fixed_context = nn.Linear(embedding_dim, embedding_dim, bias=False)
        self.project_step_context = nn.Linear(2 * embedding_dim, embedding_dim, bias=False)
        self.project_out = nn.Linear(embedding_dim, embedding_dim, bias=False)

    def _make_heads(self, v):
        # [batch, 1, graph, dim] -> [n_heads, batch, 1, graph, head_dim]
        return v.contiguous().view(v.size(0), v.size(1), v.size(2), self.n_heads, -1).permute(3, 0, 1, 2, 4)

    def _get_parallel_step_context(self, embeddings, state):
        batch_size = embeddings.size(0)
        if state.i.item() == 0:
            return self.W_placeholder[None, None, :].expand(batch_size, 1, self.W_placeholder.size(-1))
        idx = torch.cat((state.first_a, state.prev_a), 1)[:, :, None].expand(batch_size, 2, embeddings.size(-1))
        return embeddings.gather(1, idx).view(batch_size, 1, -1)

    def _one_to_many_logits(self, query, glimpse_K, glimpse_V, logit_K, mask):
        batch_size, num_steps, embed_dim = query.size()
        key_size = val_size = embed_dim // self.n_heads
        glimpse_Q = query.view(batch_size, num_steps, self.n_heads, 1, key_size).permute(2, 0, 1, 3, 4)
        compatibility = torch.matmul(glimpse_Q, glimpse_K.transpose(-2, -1)) / math.sqrt(glimpse_Q.size(-1))
        if self.mask_inner:
            assert self.mask_logits, "Cannot mask inner without masking logits"
            compatibility[mask[None, :, :, None, :].expand_as(compatibility)] = -math.inf
        heads = torch.matmul(torch.softmax(compatibility, dim=-1), glimpse_V)
        glimpse = self.project_out(heads.permute(1, 2, 3, 0, 4).contiguous().view(-1, num_steps, 1, self.n_heads * val_size))
        logits = torch.matmul(glimpse, logit_K.transpose(-2, -1)).squeeze(-2) / math.sqrt(glimpse.size(-1))
        if self.tanh_clipping > 0:
            logits = torch.tanh(logits) * self.tanh_clipping
        if self.mask_logits:
            logits[mask] = -math.inf
        return logits, glimpse.squeeze(-2)

    def forward(self, loc):
        embeddings = self.embedder(self.init_embed(loc))
        fixed_context = self.project_fixed_context(embeddings.mean(1))[:, None, :]
        glimpse_key, glimpse_val, logit_key = self.project_node_embeddings(embeddings[:, None, :, :]).chunk(3, dim=-1)
        glimpse_K, glimpse_V = self._make_heads(glimpse_key), self._make_heads(glimpse_val)
        state, tour, steps = StateTSP.initialize(loc), [], []
        for _ in range(loc.size(1)):
            query = fixed_context + self.project_step_context(self._get_parallel_step_context(embeddings, state))
            mask = state.get_mask()
            logits, glimpse = self._one_to_many_logits(query, glimpse_K, glimpse_V, logit_key.contiguous(), mask)
            selected = logits.squeeze(1).argmax(-1)
            steps.append((query, mask.clone(), glimpse))
            state = state.update(selected)
            tour.append(selected)
        return torch.stack(tour, 1), steps, (glimpse_key, glimpse_val)


def main():
    torch.manual_seed(0)
    model = AttentionModel().eval()
    loc = torch.rand(3, 7, 2)
    with torch.no_grad():
        tour, steps, (gk, gv) = model(loc)
        for b in range(3):
            assert sorted(tour[b].tolist()) == list(range(7))  # every node exactly once
        # reference glimpse: per head, softmax over the unvisited nodes only, by a loop over nodes
        hd = model.embedding_dim // model.n_heads
        for query, mask, glimpse in steps[1:]:
            for b in range(3):
                free = [j for j in range(7) if not mask[b, 0, j]]
                heads = []
                for h in range(model.n_heads):
                    q = query[b, 0, h * hd:(h + 1) * hd]
                    s = torch.stack([q @ gk[b, 0, j, h * hd:(h + 1) * hd] for j in free]) / math.sqrt(hd)
                    heads.append(torch.softmax(s, 0) @ gv[b, 0, free, h * hd:(h + 1) * hd])
                assert torch.allclose(model.project_out(torch.cat(heads)), glimpse[b, 0], atol=1e-5)
    print("attention model tsp ok", tour.tolist())


if __name__ == "__main__":
    main()
