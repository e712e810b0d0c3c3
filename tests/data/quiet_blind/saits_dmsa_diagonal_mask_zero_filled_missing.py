"""SAITS imputation: zero-filled missing sensor values with an explicit missing mask, diagonally-masked attention.

Follows WenjieDu/SAITS modeling/SA_models.py (SAITS._process: torch.cat([X, masks], dim=2) as input,
diagonal_attention_mask=True in the DMSA blocks) and modeling/layers.py (ScaledDotProductAttention:
attn.masked_fill(attn_mask == 1, -1e9) with attn_mask = torch.eye(d_time) in EncoderLayer). layers.py read at the stored version; the rest recalled.

Masks meant: a zero in X is a real reading only where masks == 1; where masks == 0 the zero is a fill value,
and the model knows because the mask is concatenated to every time step's features (so no key is hidden for
it). Each time step attends every OTHER time step and never itself (the diagonal is masked): imputation must
come from the other steps, not from the step's own (possibly zero-filled) input. Every sample has the same
d_time, so there is no padding.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


class ScaledDotProductAttention(nn.Module):
    def __init__(self, temperature):
        super().__init__()
        self.temperature = temperature

    def forward(self, q, k, v, attn_mask=None):
        attn = torch.matmul(q / self.temperature, k.transpose(2, 3))
        if attn_mask is not None:
            attn = attn.masked_fill(attn_mask == 1, -1e9)
        attn = F.softmax(attn, dim=-1)
        return torch.matmul(attn, v), attn


class DMSALayer(nn.Module):
    def __init__(self, d_model, n_head, d_k, diagonal_attention_mask=True):
        super().__init__()
        self.diagonal_attention_mask = diagonal_attention_mask
        self.n_head, self.d_k = n_head, d_k
        self.w_qs = nn.Linear(d_model, n_head * d_k, bias=False)
        self.w_ks = nn.Linear(d_model, n_head * d_k, bias=False)
        self.w_vs = nn.Linear(d_model, n_head * d_k, bias=False)
        self.fc = nn.Linear(n_head * d_k, d_model, bias=False)
        self.attention = ScaledDotProductAttention(d_k ** 0.5)

    def forward(self, x):
        b, t, _ = x.shape
        mask = torch.eye(t).unsqueeze(0).unsqueeze(0) if self.diagonal_attention_mask else None
        q = self.w_qs(x).view(b, t, self.n_head, self.d_k).transpose(1, 2)
        k = self.w_ks(x).view(b, t, self.n_head, self.d_k).transpose(1, 2)
        v = self.w_vs(x).view(b, t, self.n_head, self.d_k).transpose(1, 2)
        out, attn = self.attention(q, k, v, mask)
        return x + self.fc(out.transpose(1, 2).reshape(b, t, -1)), attn


class SAITSLite(nn.Module):
    def __init__(self, d_feature, d_model=32):
        super().__init__()
        self.embedding_1 = nn.Linear(d_feature * 2, d_model)
        self.layer = DMSALayer(d_model, 4, 8)
        self.reduce_dim = nn.Linear(d_model, d_feature)

    def impute(self, X, masks):
        input_X = torch.cat([X, masks], dim=2)
        h, attn = self.layer(self.embedding_1(input_X))
        X_tilde = self.reduce_dim(h)
        return masks * X + (1 - masks) * X_tilde, attn


X_true = torch.randn(3, 10, 5)
X_true[:, 2:4, 1] = 0.0                       # a sensor that really reads 0.0 (observed)
masks = (torch.rand(3, 10, 5) > 0.3).float()
masks[:, 2:4, 1] = 1.0
X = X_true * masks                            # missing entries filled with 0
model = SAITSLite(5).eval()
with torch.no_grad():
    imputed, attn = model.impute(X, masks)
    # reference: per query step a loop over the other time steps only
    h = model.embedding_1(torch.cat([X, masks], 2))
    lyr = model.layer
    q = lyr.w_qs(h).view(3, 10, 4, 8)
    k = lyr.w_ks(h).view(3, 10, 4, 8)
    v = lyr.w_vs(h).view(3, 10, 4, 8)
    ref = torch.zeros(3, 10, 4, 8)
    for i in range(10):
        others = [j for j in range(10) if j != i]
        s = torch.einsum("bhd,bjhd->bhj", q[:, i], k[:, others]) / 8 ** 0.5
        ref[:, i] = torch.einsum("bhj,bjhd->bhd", s.softmax(-1), v[:, others])
    ref_h = h + lyr.fc(ref.reshape(3, 10, 32))
    ref_imp = masks * X + (1 - masks) * model.reduce_dim(ref_h)
    assert torch.allclose(imputed, ref_imp, atol=1e-5)
    assert attn.diagonal(dim1=-2, dim2=-1).max() < 1e-6
    assert torch.equal(imputed[:, 2:4, 1], torch.zeros(3, 2))  # observed zeros kept as data
print(f"imputed {int((1 - masks).sum())} missing values; observed zeros kept; ok")
