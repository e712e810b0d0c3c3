# huggingface/transformers#40269: RT-DETR's get_contrastive_denoising_training_group returned a *bool*
# attn_mask (True = blocked) and RTDetrMultiheadAttention added it to the logits, i.e. +0 / +1 instead of -inf.
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class RTDetrMultiheadAttention(nn.Module):
    def __init__(self, embed_dim, num_heads, dropout=0.0, bias=True):
        super().__init__()
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.dropout = dropout
        self.head_dim = embed_dim // num_heads
        self.scaling = self.head_dim**-0.5
        self.k_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.v_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias)

    def _reshape(self, tensor, seq_len, batch_size):
        return tensor.view(batch_size, seq_len, self.num_heads, self.head_dim).transpose(1, 2).contiguous()

    def forward(self, hidden_states, attention_mask=None, position_embeddings=None):
        batch_size, target_len, embed_dim = hidden_states.size()
        hidden_states_original = hidden_states
        if position_embeddings is not None:
            hidden_states = hidden_states + position_embeddings
        query_states = self.q_proj(hidden_states) * self.scaling
        key_states = self._reshape(self.k_proj(hidden_states), -1, batch_size)
        value_states = self._reshape(self.v_proj(hidden_states_original), -1, batch_size)
        proj_shape = (batch_size * self.num_heads, -1, self.head_dim)
        query_states = self._reshape(query_states, target_len, batch_size).view(*proj_shape)
        key_states = key_states.view(*proj_shape)
        value_states = value_states.view(*proj_shape)
        source_len = key_states.size(1)

        attn_weights = torch.bmm(query_states, key_states.transpose(1, 2))
        if attention_mask is not None:
            # [seq_len, seq_len] -> [batch_size, 1, target_seq_len, source_seq_len]
            attention_mask = attention_mask.expand(batch_size, 1, *attention_mask.size())
            if FIXED and attention_mask.dtype == torch.bool:
                # the fix: convert a boolean mask to an additive float mask, as nn.MultiheadAttention does
                attention_mask = torch.zeros_like(attention_mask, dtype=attn_weights.dtype).masked_fill_(
                    attention_mask, float("-inf")
                )
            attn_weights = attn_weights.view(batch_size, self.num_heads, target_len, source_len) + attention_mask
            attn_weights = attn_weights.view(batch_size * self.num_heads, target_len, source_len)
        attn_weights = nn.functional.softmax(attn_weights, dim=-1)
        attn_output = torch.bmm(attn_weights, value_states)
        attn_output = attn_output.view(batch_size, self.num_heads, target_len, self.head_dim).transpose(1, 2)
        attn_output = attn_output.reshape(batch_size, target_len, embed_dim)
        return self.out_proj(attn_output)


class RTDetrDecoderLayer(nn.Module):
    def __init__(self, d_model=32, heads=4, ffn=64):
        super().__init__()
        self.self_attn = RTDetrMultiheadAttention(d_model, heads)
        self.self_attn_layer_norm = nn.LayerNorm(d_model)
        self.fc1, self.fc2 = nn.Linear(d_model, ffn), nn.Linear(ffn, d_model)
        self.final_layer_norm = nn.LayerNorm(d_model)

    def forward(self, hidden_states, position_embeddings, encoder_attention_mask=None):
        residual = hidden_states
        hidden_states = self.self_attn(hidden_states, attention_mask=encoder_attention_mask,
                                       position_embeddings=position_embeddings)
        hidden_states = self.self_attn_layer_norm(residual + hidden_states)
        residual = hidden_states
        hidden_states = self.fc2(torch.relu(self.fc1(hidden_states)))
        return self.final_layer_norm(residual + hidden_states)


def get_contrastive_denoising_training_group(targets, num_queries, num_denoising, class_embed, d_model):
    num_ground_truths = [len(t["class_labels"]) for t in targets]
    max_gt_num = max(num_ground_truths)
    num_groups_denoising_queries = num_denoising // max_gt_num
    batch_size = len(targets)
    num_denoising_queries = int(max_gt_num * 2 * num_groups_denoising_queries)
    labels = torch.zeros(batch_size, max_gt_num * 2 * num_groups_denoising_queries, dtype=torch.long)
    for i, t in enumerate(targets):
        n = num_ground_truths[i]
        for g in range(num_groups_denoising_queries * 2):
            labels[i, g * max_gt_num: g * max_gt_num + n] = t["class_labels"]
    input_query_class = class_embed(labels)

    target_size = num_denoising_queries + num_queries
    attn_mask = torch.full([target_size, target_size], False, dtype=torch.bool)
    # match query cannot see the reconstruction
    attn_mask[num_denoising_queries:, :num_denoising_queries] = True
    # reconstructions cannot see each other
    for i in range(num_groups_denoising_queries):
        idx_block_start = max_gt_num * 2 * i
        idx_block_end = max_gt_num * 2 * (i + 1)
        attn_mask[idx_block_start:idx_block_end, :idx_block_start] = True
        attn_mask[idx_block_start:idx_block_end, idx_block_end:num_denoising_queries] = True
    return input_query_class, attn_mask, num_denoising_queries


d_model, num_queries, num_denoising = 32, 6, 8
layers = nn.ModuleList([RTDetrDecoderLayer(d_model) for _ in range(2)])
class_embed = nn.Embedding(5, d_model)
query_pos = nn.Embedding(num_queries, d_model)
targets = [{"class_labels": torch.tensor([1, 3])}, {"class_labels": torch.tensor([2, 4, 0])}]
batch_size = len(targets)

# training step: denoising queries are prepended to the matching (object) queries
dn_embed, attn_mask, num_dn = get_contrastive_denoising_training_group(
    targets, num_queries, num_denoising, class_embed, d_model)
target = torch.cat([dn_embed, torch.randn(batch_size, num_queries, d_model)], dim=1)
pos = torch.cat([torch.zeros(batch_size, num_dn, d_model),
                 query_pos.weight.unsqueeze(0).expand(batch_size, -1, -1)], dim=1)

with torch.no_grad():
    hidden = target
    for layer in layers:
        hidden = layer(hidden, pos, encoder_attention_mask=attn_mask)
    # reference: the matching queries alone (they must not see any denoising query)
    ref = target[:, num_dn:]
    for layer in layers:
        ref = layer(ref, pos[:, num_dn:])

leak = (hidden[:, num_dn:] - ref).abs().max().item()
print(f"fixed={FIXED} denoising->matching leak (max |diff| of matching-query outputs): {leak:.3e}")
