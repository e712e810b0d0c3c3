"""Correct program: fairseq's GShard MoE layer (Top2Gate + MOELayer) in a transformer encoder layer over a
right-padded batch, the padding mask handed to both the self-attention and the gate.

Citation: facebookresearch/fairseq @26d62ae8fbf3deccf01a138d704be1e5c346ca9a
  fairseq/modules/moe/top2gate.py (top2gating: `nonpadding = ~input_mask`, mask1 / mask2 zeroed on
  padding before the capacity cumsum, combine_weights / dispatch_mask), fairseq/modules/moe/moe_layer.py
  (MOELayer.forward: input (s, t, m) and input_padding_mask (s, t) reshaped to S tokens, dispatch
  einsum "sec,sm->ecm", combine "sec,ecm->sm"), and the MoE encoder layer's call
  `self.moe_layer(x, input_padding_mask=encoder_padding_mask)` after x is made batch-first
  (fairseq/modules/transformer_layer.py, TransformerEncoderLayerBase with moe).
Trimmed to one process (no all-to-all, world size 1), tutel / prefix-token logging dropped,
second_expert_policy "all", eval mode with moe_eval_capacity_token_fraction 1.0 (no token dropped).

Padded tokens are excluded from routing: they take no capacity slot and get a zero combine weight, so
their MoE output is 0; the attention's key_padding_mask keeps them out of every real token's keys.

Self-check: each sentence run alone (unpadded, no mask anywhere) gives the same layer output on its real
tokens; the MoE output of every real token equals a per-token loop (softmax gates, top-2 experts,
gates renormalised over the two, sum of gate * expert(x)); pad tokens' MoE output is exactly 0.
"""
import math
from types import SimpleNamespace
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

torch.manual_seed(0)


def one_hot(indices: torch.Tensor, num_classes: int, unsqueeze_indices=False) -> Tensor:
    if unsqueeze_indices:
        indices = indices.unsqueeze(-1)
    assert indices.shape[-1] == 1, "last dimension of indices must be have size 1"
    output = torch.zeros(indices.shape[:-1] + (num_classes,), device=indices.device, dtype=indices.dtype)
    output.scatter_(len(output.shape) - 1, indices, 1)
    return output


def top2gating(logits, input_mask=None, second_expert_policy="all", eval_mode=False,
               moe_eval_capacity_token_fraction=0.25, moe_eval_capacity_length=None):
    gates = F.softmax(logits, dim=1)
    num_tokens = gates.shape[0]
    num_experts = gates.shape[1]
    if moe_eval_capacity_token_fraction > 0.0 and eval_mode:
        if moe_eval_capacity_length is None:
            capacity = math.ceil(moe_eval_capacity_token_fraction * num_tokens)
        else:
            capacity = math.ceil(moe_eval_capacity_token_fraction * moe_eval_capacity_length)
    else:
        capacity = 2 * math.ceil(num_tokens / num_experts)

    indices1_s = torch.argmax(gates, dim=1, keepdim=True)
    mask1 = one_hot(indices1_s, num_experts)
    logits_w_noise = logits
    logits_except1 = logits_w_noise.masked_fill(mask1.bool(), float("-inf"))
    indices2_s = torch.argmax(logits_except1, dim=1, keepdim=True)
    mask2 = one_hot(indices2_s, num_experts)

    # Compute locations in capacity buffer
    if input_mask is not None:
        nonpadding = ~input_mask
        mask1 = mask1 * nonpadding.unsqueeze(-1).to(mask1.dtype)
        mask2 = mask2 * nonpadding.unsqueeze(-1).to(mask1.dtype)
    locations1 = torch.cumsum(mask1, dim=0) - 1
    locations2 = torch.cumsum(mask2, dim=0) - 1
    locations2 += torch.sum(mask1, dim=0, keepdim=True)

    me = torch.mean(gates, dim=0)
    ce = torch.mean(mask1.to(gates.dtype), dim=0)
    l_aux = torch.mean(me * ce) * num_experts * num_experts

    mask1 = mask1 * torch.lt(locations1, capacity)
    mask2 = mask2 * torch.lt(locations2, capacity)

    gates1_s = (gates * mask1).sum(dim=1)
    gates2_s = (gates * mask2).sum(dim=1)
    denom_s = gates1_s + gates2_s
    denom_s = torch.clamp(denom_s, min=torch.finfo(denom_s.dtype).eps)
    gates1_s /= denom_s
    gates2_s /= denom_s

    locations1_s = torch.sum(locations1 * mask1, dim=1)
    locations2_s = torch.sum(locations2 * mask2, dim=1)
    gates1 = gates1_s.unsqueeze(-1) * mask1.to(gates1_s.dtype)
    gates2 = gates2_s.unsqueeze(-1) * mask2.to(gates2_s.dtype)
    locations1_sc = one_hot(locations1_s, num_classes=capacity, unsqueeze_indices=True)
    locations2_sc = one_hot(locations2_s, num_classes=capacity, unsqueeze_indices=True)
    combine1_sec = torch.bmm(gates1.unsqueeze(-1), locations1_sc.to(gates1.dtype).unsqueeze(1))
    combine2_sec = torch.bmm(gates2.unsqueeze(-1), locations2_sc.to(gates2.dtype).unsqueeze(1))
    combine_weights = combine1_sec + combine2_sec
    dispatch_mask = combine_weights.bool()
    return l_aux, combine_weights, dispatch_mask


class Top2Gate(nn.Module):
    def __init__(self, model_dim, num_experts, second_expert_policy="all", moe_eval_capacity_token_fraction=0.25):
        super().__init__()
        self.wg = nn.Linear(model_dim, num_experts, bias=False)
        self.second_expert_policy = second_expert_policy
        self.moe_eval_capacity_token_fraction = moe_eval_capacity_token_fraction

    def forward(self, input, mask=None, moe_eval_capacity_length=None):
        logits = self.wg(input)
        return top2gating(logits, mask, second_expert_policy=self.second_expert_policy,
                          eval_mode=not self.training,
                          moe_eval_capacity_token_fraction=self.moe_eval_capacity_token_fraction,
                          moe_eval_capacity_length=moe_eval_capacity_length)


class MOELayer(nn.Module):
    def __init__(self, gate, experts, args):
        super().__init__()
        self.gate = gate
        self.experts = experts
        self.args = args
        self.num_local_experts = len(self.experts)
        self.all2all_size = 1

    def forward(self, *input: Tensor, input_padding_mask=None):
        input = input[0]
        assert len(input.shape) == 3, "input Tensor must have dimensions: (s)equence, (t)oken, (m)odel"
        if input_padding_mask is not None:
            assert input_padding_mask.shape[0] == input.shape[0]
            assert input_padding_mask.shape[1] == input.shape[1]
        d_model = input.shape[2]
        reshaped_input = input.reshape(-1, d_model)
        reshaped_input_padding_mask = input_padding_mask.reshape(-1) if input_padding_mask is not None else None
        l_aux, combine_weights, dispatch_mask = self.gate(reshaped_input, reshaped_input_padding_mask, None)
        dispatch_mask = dispatch_mask.to(input.dtype).permute(1, 2, 0)  # S,E,C -> E,C,S
        E, C, S = dispatch_mask.size()
        M = reshaped_input.size(1)
        dispatched_input = torch.mm(dispatch_mask.view(E * C, S), reshaped_input)
        dispatched_input = dispatched_input.reshape(self.all2all_size, self.num_local_experts, -1, d_model)
        chunks = dispatched_input.chunk(self.num_local_experts, dim=1)
        expert_outputs = [expert(chunk) for chunk, expert in zip(chunks, self.experts)]
        expert_output = torch.cat(expert_outputs, dim=1)
        expert_output = expert_output.reshape(self.all2all_size * self.num_local_experts, -1, d_model)
        combined_output = combine_weights.view(S, E * C).mm(expert_output.view(E * C, M))
        combined_output = combined_output.reshape(input.shape)
        return combined_output, {"moe_gate_loss": l_aux}


class FeedForwardNetwork(nn.Module):
    def __init__(self, dim, ffn_dim):
        super().__init__()
        self.fc1 = nn.Linear(dim, ffn_dim)
        self.fc2 = nn.Linear(ffn_dim, dim)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x)))


class MoEEncoderLayer(nn.Module):
    """Post-norm encoder layer; x is (T, B, C) as in fairseq, encoder_padding_mask (B, T), True = pad."""

    def __init__(self, args):
        super().__init__()
        self.self_attn = nn.MultiheadAttention(args.encoder_embed_dim, args.encoder_attention_heads)
        self.self_attn_layer_norm = nn.LayerNorm(args.encoder_embed_dim)
        gate = Top2Gate(args.encoder_embed_dim, args.moe_expert_count,
                        second_expert_policy=args.moe_second_expert_policy,
                        moe_eval_capacity_token_fraction=args.moe_eval_capacity_token_fraction)
        experts = nn.ModuleList([FeedForwardNetwork(args.encoder_embed_dim, args.encoder_ffn_embed_dim)
                                 for _ in range(args.moe_expert_count)])
        self.moe_layer = MOELayer(gate, experts, args)
        self.final_layer_norm = nn.LayerNorm(args.encoder_embed_dim)

    def forward(self, x, encoder_padding_mask: Optional[Tensor]):
        residual = x
        x, _ = self.self_attn(query=x, key=x, value=x, key_padding_mask=encoder_padding_mask, need_weights=False)
        x = self.self_attn_layer_norm(residual + x)
        residual = x
        # x - seq_len, batch_size, model_dim
        x = x.transpose(0, 1)  # batch_size, seq_len, model_dim
        x, l_aux = self.moe_layer(x, input_padding_mask=encoder_padding_mask)
        x = x.transpose(0, 1)  # seq_len, batch_size, model_dim
        self.last_moe_out = x
        x = self.final_layer_norm(residual + x)
        return x, l_aux


args = SimpleNamespace(encoder_embed_dim=16, encoder_attention_heads=2, encoder_ffn_embed_dim=32,
                       moe_expert_count=4, moe_second_expert_policy="all",
                       moe_eval_capacity_token_fraction=1.0, batch_size_valid=3)
layer = MoEEncoderLayer(args).eval()
embed = nn.Embedding(30, 16, padding_idx=1)

lengths = [6, 3, 5]
pad = 1
T = max(lengths)
src_tokens = torch.full((len(lengths), T), pad, dtype=torch.long)
for i, L in enumerate(lengths):
    src_tokens[i, :L] = torch.randint(4, 30, (L,))
encoder_padding_mask = src_tokens.eq(pad)

with torch.no_grad():
    x = embed(src_tokens).transpose(0, 1)
    out, _ = layer(x, encoder_padding_mask)
    moe_out = layer.last_moe_out
    # pad tokens are not routed
    assert moe_out.transpose(0, 1)[encoder_padding_mask].abs().max() == 0

    for i, L in enumerate(lengths):
        xi = embed(src_tokens[i:i + 1, :L]).transpose(0, 1)
        oi, _ = layer(xi, None)
        torch.testing.assert_close(out[:L, i], oi[:, 0], atol=1e-5, rtol=1e-5)

    # per-token loop reference of the MoE on the real tokens (input = post-attention normed x)
    residual = layer.self_attn_layer_norm(x + layer.self_attn(x, x, x, key_padding_mask=encoder_padding_mask, need_weights=False)[0])
    for i, L in enumerate(lengths):
        for t in range(L):
            h = residual[t, i]
            g = torch.softmax(layer.moe_layer.gate.wg(h), -1)
            top = g.topk(2).indices
            w = g[top] / g[top].sum()
            ref = sum(w[j] * layer.moe_layer.experts[int(top[j])](h) for j in range(2))
            torch.testing.assert_close(moe_out[t, i], ref, atol=1e-5, rtol=1e-5)

print("ok: MoE encoder layer on the padded batch matches each sentence alone and the per-token loop")
