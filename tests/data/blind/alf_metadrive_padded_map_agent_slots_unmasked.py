# HorizonRobotics/alf#1303 (commit caccedd8): the MetaDrive PPG transformer encoder ran its
# TransformerBlocks over [ego, map polylines, agents] with no mask, so padded polyline/agent slots were attended.
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


def _masked_softmax(logits, mask, dim=-1):
    if mask is not None:
        logits.masked_fill_(mask, -float('inf'))
    return nn.functional.softmax(logits, dim=dim)


class TransformerBlock(nn.Module):
    """alf.layers.TransformerBlock, positional_encoding='none'.

    mask[b, n] = True indicates NOT using memory[b, n].
    """

    def __init__(self, d_model, num_heads, memory_size):
        super().__init__()
        d_k = d_v = d_model // num_heads
        self._q_proj = nn.Parameter(torch.randn(d_model, num_heads * d_k) * d_model**-0.5)
        self._k_proj = nn.Parameter(torch.randn(d_model, num_heads * d_k) * d_model**-0.5)
        self._v_proj = nn.Parameter(torch.randn(d_model, num_heads * d_v) * d_model**-0.5)
        self._o_proj = nn.Parameter(torch.randn(num_heads * d_v, d_model) * d_model**-0.5)
        self._qk_bias = nn.Parameter(torch.zeros(num_heads, d_k))
        self._d_k, self._d_v, self._num_heads = d_k, d_v, num_heads
        self._memory_size = memory_size
        self._attention_scale = d_k**-0.5
        self._mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.ReLU(),
                                  nn.Linear(4 * d_model, d_model))
        self._norm1 = nn.LayerNorm(d_model)
        self._norm2 = nn.LayerNorm(d_model)

    def forward(self, memory, query=None, mask=None):
        original_query = memory
        memory = self._norm1(memory)
        query = memory
        if mask is not None:
            if mask.ndim == 2:
                mask = mask.unsqueeze(1)
            # [B, M, 1, N]
            mask = mask.unsqueeze(2)
        batch_size, m, n = query.shape[0], query.shape[1], memory.shape[1]
        assert n <= self._memory_size
        h, d_k, d_v = self._num_heads, self._d_k, self._d_v
        q = torch.matmul(query, self._q_proj).reshape(batch_size, m, h, d_k)
        k = torch.matmul(memory, self._k_proj).reshape(batch_size, n, h, d_k)
        # [B, M, H, N]
        logits = torch.einsum('bmhd,bnhd->bmhn', q + self._qk_bias, k)
        logits.mul_(self._attention_scale)
        a = _masked_softmax(logits, mask)
        v = torch.matmul(memory, self._v_proj).reshape(batch_size, n, h, d_v)
        att_result = torch.einsum('bmhn,bnhd->bmhd', a, v)
        att_result = att_result.reshape(batch_size, m, h * d_v)
        x = original_query + torch.matmul(att_result, self._o_proj)
        return x + self._mlp(self._norm2(x))


class ObservationCombiner(nn.Module):
    def __init__(self, d_map_feature, d_ego_feature, d_agent_feature, d_model):
        super().__init__()
        self._map_fc = nn.Sequential(nn.Linear(d_map_feature, d_model), nn.ReLU())
        self._agent_fc = nn.Sequential(nn.Linear(d_agent_feature, d_model), nn.ReLU())
        self._ego_fc = nn.Sequential(nn.Linear(d_ego_feature, d_model), nn.ReLU())

    def forward(self, inputs):
        map_sequence, ego, agents = inputs
        x0 = self._ego_fc(ego).unsqueeze(1)  # [B, 1, d_model]
        x1 = self._map_fc(map_sequence)  # [B, L, d_model]
        x2 = self._agent_fc(agents.view(*agents.shape[:2], -1))  # [B, A, d_model]
        return torch.cat([x0, x1, x2], dim=1)


class MaskedTransformer(nn.Module):
    def __init__(self, d_model, num_heads, num_layers, map_limit, agent_limit):
        super().__init__()
        self._memory_size = 1 + map_limit + agent_limit
        self._tf_layers = nn.ModuleList([
            TransformerBlock(d_model, num_heads, self._memory_size) for _ in range(num_layers)])

    def forward(self, inputs):
        x, map_mask, agent_mask = inputs
        B = x.shape[0]
        mask = torch.hstack((torch.zeros(B, 1, dtype=bool), map_mask, agent_mask))
        for layer in self._tf_layers:
            x = layer(memory=x, mask=mask)
        return x


# VectorizedObservation: map polylines / agent history slots padded up to the limits.
B, MAP_LIMIT, AGENT_LIMIT, POLY, HIST, D = 2, 6, 4, 4, 3, 32
obs = {
    'map': torch.randn(B, MAP_LIMIT, POLY * 2),
    'ego': torch.randn(B, 5),
    'agents': torch.randn(B, AGENT_LIMIT, HIST, 2),
    'map_mask': torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 0, 0, 0]], dtype=torch.bool),  # True = valid
    'agent_mask': torch.tensor([[1, 1, 0, 0], [1, 0, 0, 0]], dtype=torch.bool),
}
# padded slots carry zeros, as the sensor writes them
obs['map'][~obs['map_mask']] = 0.
obs['agents'][~obs['agent_mask']] = 0.

combiner = ObservationCombiner(POLY * 2, 5, HIST * 2, D)
encoder = MaskedTransformer(D, num_heads=4, num_layers=2, map_limit=MAP_LIMIT, agent_limit=AGENT_LIMIT)

with torch.no_grad():
    x = combiner((obs['map'], obs['ego'], obs['agents']))
    if FIXED:
        out = encoder((x, ~obs['map_mask'], ~obs['agent_mask']))
    else:
        out = x
        for layer in encoder._tf_layers:
            out = layer(memory=out)
    ego_out = out[:, 0]  # encoder output = the ego slot

    # reference: each scene alone, with only its valid slots
    ref = []
    for b in range(B):
        keep = torch.cat([torch.ones(1, dtype=torch.bool), obs['map_mask'][b], obs['agent_mask'][b]])
        y = x[b:b + 1, keep]
        for layer in encoder._tf_layers:
            y = layer(memory=y)
        ref.append(y[:, 0])
    ref = torch.cat(ref)

print(f"fixed={FIXED} max|ego_out - ref(valid slots only)| = {(ego_out - ref).abs().max().item():.3e}")
