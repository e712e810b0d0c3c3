# Citation: SalesforceAIResearch/uni2ts src/uni2ts/common/torch_util.py packed_attention_mask,
#   src/uni2ts/model/moirai/module.py MoiraiModule.forward, src/uni2ts/module/attention.py GroupedQueryAttention,
#   src/uni2ts/module/position/attn_bias.py BinaryAttentionBias.
# Several series (each with several variates flattened into patch tokens) are packed in one row; sample_id==0 marks
# padding. The bool mask (True = keep) is sample_id[:, :, None] == sample_id[:, None, :], so tokens attend only inside
# their own sample (padding tokens attend among themselves, never fully masked; their output is dropped by the loss
# mask). A learned binary bias (same variate / different variate) is added inside the kept positions only.
import torch
import torch.nn.functional as F
from torch import nn

torch.manual_seed(0)


def packed_attention_mask(sample_id):
    sample_id = sample_id.unsqueeze(-1)
    attention_mask = sample_id.eq(sample_id.mT)
    return attention_mask


class BinaryAttentionBias(nn.Module):
    def __init__(self, dim, num_heads):
        super().__init__()
        self.num_heads = num_heads
        self.emb = nn.Embedding(num_embeddings=2, embedding_dim=num_heads)

    def forward(self, query, key, query_id, kv_id):
        ind = torch.eq(query_id.unsqueeze(-1), kv_id.unsqueeze(-2))          # (b, q, kv)
        weight = self.emb.weight.view(2, self.num_heads, 1, 1)               # (2, h, 1, 1)
        bias = ~ind.unsqueeze(1) * weight[:1] + ind.unsqueeze(1) * weight[1:]  # (b, h, q, kv)
        return bias


class GroupedQueryAttention(nn.Module):
    def __init__(self, dim, num_heads):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.q_proj, self.k_proj, self.v_proj = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.out_proj = nn.Linear(dim, dim)
        self.var_attn_bias = BinaryAttentionBias(dim, num_heads)

    def forward(self, x, attn_mask, query_var_id, kv_var_id):
        b, n, d = x.shape
        q = self.q_proj(x).view(b, n, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, n, self.num_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, n, self.num_heads, self.head_dim).transpose(1, 2)
        attn_mask = attn_mask.unsqueeze(1)                                    # "batch *q_len kv_len" -> heads
        bias = self.var_attn_bias(q, k, query_var_id, kv_var_id)
        attn_mask = torch.zeros_like(attn_mask, dtype=q.dtype).masked_fill(
            attn_mask.logical_not(), float("-inf")) + bias if attn_mask is not None else bias
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
        return self.out_proj(out.transpose(1, 2).reshape(b, n, d))


class TransformerEncoderLayer(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.self_attn = GroupedQueryAttention(dim, heads)
        self.norm1, self.norm2 = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.ffn = nn.Sequential(nn.Linear(dim, 2 * dim), nn.SiLU(), nn.Linear(2 * dim, dim))

    def forward(self, x, attn_mask, var_id):
        x = x + self.self_attn(self.norm1(x), attn_mask, var_id, var_id)
        return x + self.ffn(self.norm2(x))


patch_size, dim = 8, 32
in_proj = nn.Linear(patch_size * 2, dim)
layers = nn.ModuleList([TransformerEncoderLayer(dim, 4) for _ in range(2)])
head = nn.Linear(dim, patch_size)

# row 0: sample 1 (2 variates x 3 patches) + sample 2 (1 variate x 4 patches) + 2 pad tokens
# row 1: sample 1 (3 variates x 4 patches)
sample_id = torch.tensor([[1] * 6 + [2] * 4 + [0] * 2, [1] * 12])
variate_id = torch.tensor([[0, 0, 0, 1, 1, 1, 0, 0, 0, 0, 0, 0], [0] * 4 + [1] * 4 + [2] * 4])
target = torch.randn(2, 12, patch_size)
observed_mask = torch.ones(2, 12, patch_size, dtype=torch.bool)
observed_mask[1, 3, 5:] = False                      # missing values inside a patch
prediction_mask = torch.zeros(2, 12, dtype=torch.bool)
prediction_mask[0, [2, 5, 9]] = True
prediction_mask[1, [3, 7, 11]] = True
# MoiraiModule: scaled target, masked patches replaced by a mask token, observed mask concatenated
scaled = target * observed_mask
mask_encoding = nn.Parameter(torch.zeros(dim))
reprs = in_proj(torch.cat([scaled, observed_mask.float()], -1))
reprs = torch.where(prediction_mask.unsqueeze(-1), mask_encoding.expand_as(reprs), reprs)
attn_mask = packed_attention_mask(sample_id)
for layer in layers:
    reprs = layer(reprs, attn_mask, variate_id)
pred = head(reprs)
loss_mask = prediction_mask.unsqueeze(-1) & observed_mask & (sample_id > 0).unsqueeze(-1)
loss = ((pred - target).abs() * loss_mask).sum() / loss_mask.sum()
loss.backward()
print("packed loss %.4f" % loss.item())
