# microsoft/onnxruntime#4889: the BERT attention fusion reduced the 2D attention_mask to a 1D mask_index
# (ReduceSum = number of valid tokens), which the Attention op reads as "keys [0, len) are valid"; a left-padded
# or holed mask then attends to pads and drops real tokens. Fix: feed the raw 2D attention mask to the fused op.
import math
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class BertConfig:
    vocab_size = 60
    hidden_size = 32
    num_attention_heads = 4
    num_hidden_layers = 2
    intermediate_size = 64
    max_position_embeddings = 16


def process_mask(attention_mask):
    """What the fused graph feeds to com.microsoft.Attention as its mask input."""
    if FIXED:
        return attention_mask.to(torch.int32)  # use_raw_attention_mask: 2D (batch, total_sequence_length)
    return attention_mask.sum(dim=1).to(torch.int32)  # ReduceSum -> mask_index: 1D (batch,)


def ort_attention(q, k, v, mask_index):
    """Reference of the Attention contrib op for a 1D mask_index (end positions) or a raw 2D mask."""
    B, H, L, D = q.shape
    S = k.shape[-2]
    if mask_index.dim() == 1:
        keep = torch.arange(S)[None, :] < mask_index[:, None].long()
    else:
        keep = mask_index.bool()
    keep = keep[:, None, None, :].expand(B, 1, L, S)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=keep, scale=1.0 / math.sqrt(D))


class BertAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.h = config.num_attention_heads
        self.d = config.hidden_size // self.h
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size)
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, x, mask_index):
        B, L, _ = x.shape
        q, k, v = self.qkv(x).view(B, L, 3, self.h, self.d).permute(2, 0, 3, 1, 4)
        ctx = ort_attention(q, k, v, mask_index)
        return self.dense(ctx.transpose(1, 2).reshape(B, L, -1))


class BertLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.attention = BertAttention(config)
        self.ln1 = nn.LayerNorm(config.hidden_size)
        self.ffn = nn.Sequential(nn.Linear(config.hidden_size, config.intermediate_size), nn.GELU(),
                                 nn.Linear(config.intermediate_size, config.hidden_size))
        self.ln2 = nn.LayerNorm(config.hidden_size)

    def forward(self, x, mask_index):
        x = self.ln1(x + self.attention(x, mask_index))  # SkipLayerNormalization
        return self.ln2(x + self.ffn(x))


class OptimizedBertModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.emb_ln = nn.LayerNorm(config.hidden_size)
        self.layer = nn.ModuleList([BertLayer(config) for _ in range(config.num_hidden_layers)])

    def forward(self, input_ids, attention_mask, position_ids):
        # EmbedLayerNormalization also emits the mask input of every fused Attention node
        x = self.emb_ln(self.word_embeddings(input_ids) + self.position_embeddings(position_ids))
        mask_index = process_mask(attention_mask)
        for layer in self.layer:
            x = layer(x, mask_index)
        return x


config = BertConfig()
model = OptimizedBertModel(config).eval()
PAD = 0
# left-padded batch (tokenizer.padding_side = "left")
input_ids = torch.tensor([[PAD, PAD, PAD, 12, 7, 33, 5, 9],
                          [PAD, 41, 3, 18, 27, 8, 50, 2]])
attention_mask = (input_ids != PAD).long()
position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)

with torch.no_grad():
    out = model(input_ids, attention_mask, position_ids)
    worst = 0.0
    for b in range(2):
        real = attention_mask[b].bool()
        ids = input_ids[b:b + 1, real]
        alone = model(ids, torch.ones_like(ids), torch.arange(ids.shape[1])[None])
        worst = max(worst, (out[b, real] - alone[0]).abs().max().item())
print(f"fixed={FIXED} max |left-padded batch - unpadded| over real tokens: {worst:.3e}")
