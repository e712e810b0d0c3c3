# TimeFilter (TROUBADOUR000/TimeFilter#13; same layers in thuml/Time-Series-Library models/TimeFilter.py):
# GraphFilter filters edges (KNN top-k mask and MoE region mask) by multiplying adj by 0, then softmaxes,
# so every filtered-out edge still gets weight exp(0); the fix sets the filtered entries to -inf before softmax.
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class GCN(nn.Module):
    def __init__(self, dim, n_heads):
        super().__init__()
        self.proj = nn.Linear(dim, dim)
        self.n_heads = n_heads

    def forward(self, adj, x):
        # adj [B, H, L, L]
        B, L, D = x.shape
        x = self.proj(x).view(B, L, self.n_heads, -1)  # [B, L, H, D_]
        adj = F.normalize(adj, p=1, dim=-1)
        x = torch.einsum("bhij,bjhd->bihd", adj, x).contiguous()  # [B, L, H, D_]
        x = x.view(B, L, -1)
        return x


class mask_moe(nn.Module):
    def __init__(self, n_vars, top_p=0.5, num_experts=3, in_dim=96):
        super().__init__()
        self.num_experts = num_experts
        self.n_vars = n_vars
        self.in_dim = in_dim
        self.gate = nn.Linear(self.in_dim, num_experts, bias=False)
        self.noise = nn.Linear(self.in_dim, num_experts, bias=False)
        self.noisy_gating = True
        self.softplus = nn.Softplus()
        self.softmax = nn.Softmax(2)
        self.top_p = top_p

    def cv_squared(self, x):
        eps = 1e-10
        if x.shape[0] == 1:
            return torch.tensor([0], device=x.device, dtype=x.dtype)
        return x.float().var() / (x.float().mean() ** 2 + eps)

    def cross_entropy(self, x):
        eps = 1e-10
        if x.shape[0] == 1:
            return torch.tensor([0], device=x.device, dtype=x.dtype)
        return -torch.mul(x, torch.log(x + eps)).sum(dim=1).mean()

    def noisy_top_k_gating(self, x, is_training, noise_epsilon=1e-2):
        clean_logits = self.gate(x)
        if self.noisy_gating and is_training:
            raw_noise = self.noise(x)
            noise_stddev = ((self.softplus(raw_noise) + noise_epsilon))
            noisy_logits = clean_logits + torch.randn_like(clean_logits) * noise_stddev
            logits = noisy_logits
        else:
            logits = clean_logits
        logits = self.softmax(logits)
        loss_dynamic = self.cross_entropy(logits)

        sorted_probs, sorted_indices = torch.sort(logits, descending=True)
        cumulative_probs = torch.cumsum(sorted_probs, dim=-1)
        mask = cumulative_probs > self.top_p

        threshold_indices = mask.long().argmax(dim=-1)
        threshold_mask = torch.nn.functional.one_hot(threshold_indices, num_classes=sorted_indices.size(-1)).bool()
        mask = mask & ~threshold_mask

        top_p_mask = torch.zeros_like(mask)
        zero_indices = (mask == 0).nonzero(as_tuple=True)
        top_p_mask[zero_indices[0], zero_indices[1], sorted_indices[zero_indices[0], zero_indices[1], zero_indices[2]]] = 1

        sorted_probs = torch.where(mask, 0.0, sorted_probs)
        loss_importance = self.cv_squared(sorted_probs.sum(0))
        lambda_2 = 0.1
        loss = loss_importance + lambda_2 * loss_dynamic
        return top_p_mask, loss

    def forward(self, x, masks=None, is_training=None):
        # x [B, H, L, L]
        B, H, L, _ = x.shape
        device = x.device
        dtype = torch.float32
        mask_base = torch.eye(L, device=device, dtype=dtype).unsqueeze(0).unsqueeze(0)
        if self.top_p == 0.0:
            return mask_base, 0.0
        x = x.reshape(B * H, L, L)
        gates, loss = self.noisy_top_k_gating(x, is_training)
        gates = gates.reshape(B, H, L, -1).float()
        mask = torch.einsum('bhli,lid->bhld', gates, masks) + mask_base
        return mask, loss


def mask_topk(x, alpha=0.5, largest=False):
    # x: [B, H, L, L]
    k = int(alpha * x.shape[-1])
    _, topk_indices = torch.topk(x, k, dim=-1, largest=largest)
    mask = torch.ones_like(x, dtype=torch.float32)
    mask.scatter_(-1, topk_indices, 0)  # 1 is topk
    return mask  # [B, H, L, L]


class GraphLearner(nn.Module):
    def __init__(self, dim, n_vars, top_p=0.5, in_dim=96):
        super().__init__()
        self.dim = dim
        self.proj_1 = nn.Linear(dim, dim)
        self.proj_2 = nn.Linear(dim, dim)
        self.n_vars = n_vars
        self.mask_moe = mask_moe(n_vars, top_p=top_p, in_dim=in_dim)

    def forward(self, x, masks=None, alpha=0.5, is_training=False):
        # x: [B, H, L, D]
        adj = F.gelu(torch.einsum('bhid,bhjd->bhij', self.proj_1(x), self.proj_2(x)))
        knn = mask_topk(adj, alpha)
        adj = adj * knn  # KNN
        mask, loss = self.mask_moe(adj, masks, is_training)
        adj = adj * mask
        keep = (knn != 0) & (mask != 0)
        self.last_keep = keep  # instrumentation only
        if FIXED:
            # fix: filtered-out edges must be -inf before the softmax in GraphFilter
            adj = adj.masked_fill(~keep, float('-inf'))
        return adj, loss  # [B, H, L, L]


class GraphFilter(nn.Module):
    def __init__(self, dim, n_vars, n_heads=4, scale=None, top_p=0.5, dropout=0., in_dim=96):
        super().__init__()
        self.dim = dim
        self.n_heads = n_heads
        self.scale = dim ** (-0.5) if scale is None else scale
        self.dropout = nn.Dropout(dropout)
        self.graph_learner = GraphLearner(self.dim // self.n_heads, n_vars, top_p, in_dim=in_dim)
        self.graph_conv = GCN(self.dim, self.n_heads)

    def forward(self, x, masks=None, alpha=0.5, is_training=False):
        B, L, D = x.shape
        adj, loss = self.graph_learner(x.reshape(B, L, self.n_heads, -1).permute(0, 2, 1, 3), masks,
                                       alpha, is_training)  # [B, H, L, L]
        adj = torch.softmax(adj, dim=-1)
        self.last_probs = adj  # instrumentation only
        adj = self.dropout(adj)
        out = self.graph_conv(adj, x)
        return out, loss


class GraphBlock(nn.Module):
    def __init__(self, dim, n_vars, d_ff=None, n_heads=4, top_p=0.5, dropout=0., in_dim=96):
        super().__init__()
        self.dim = dim
        self.d_ff = dim * 4 if d_ff is None else d_ff
        self.gnn = GraphFilter(self.dim, n_vars, n_heads, top_p=top_p, dropout=dropout, in_dim=in_dim)
        self.norm1 = nn.LayerNorm(self.dim)
        self.ffn = nn.Sequential(nn.Linear(self.dim, self.d_ff), nn.GELU(), nn.Dropout(dropout),
                                 nn.Linear(self.d_ff, self.dim))
        self.norm2 = nn.LayerNorm(self.dim)

    def forward(self, x, masks=None, alpha=0.5, is_training=False):
        out, loss = self.gnn(self.norm1(x), masks, alpha, is_training)
        x = x + out
        x = x + self.ffn(self.norm2(x))
        return x, loss


class TimeFilter_Backbone(nn.Module):
    def __init__(self, hidden_dim, n_vars, d_ff=None, n_heads=4, n_blocks=3, top_p=0.5, dropout=0., in_dim=96):
        super().__init__()
        self.dim = hidden_dim
        self.d_ff = self.dim * 2 if d_ff is None else d_ff
        self.blocks = nn.ModuleList([GraphBlock(self.dim, n_vars, self.d_ff, n_heads, top_p, dropout, in_dim)
                                     for _ in range(n_blocks)])
        self.n_blocks = n_blocks

    def forward(self, x, masks=None, alpha=0.5, is_training=False):
        moe_loss = 0.0
        for block in self.blocks:
            x, loss = block(x, masks, alpha, is_training)
            moe_loss += loss
        moe_loss /= self.n_blocks
        return x, moe_loss


class PatchEmbed(nn.Module):
    def __init__(self, dim, patch_len, stride=None):
        super().__init__()
        self.patch_len = patch_len
        self.stride = patch_len if stride is None else stride
        self.patch_proj = nn.Linear(self.patch_len, dim)

    def forward(self, x):
        x = x.unfold(dimension=-1, size=self.patch_len, step=self.stride)
        return self.patch_proj(x)


class Model(nn.Module):
    """thuml/Time-Series-Library models/TimeFilter.py, long_term_forecast path (no RevIN, no pos emb)."""

    def __init__(self, seq_len=16, pred_len=8, c_out=3, d_model=32, n_heads=4, e_layers=2, patch_len=4,
                 alpha=0.3, top_p=0.5):
        super().__init__()
        self.seq_len, self.pred_len, self.n_vars = seq_len, pred_len, c_out
        self.dim, self.patch_len = d_model, patch_len
        self.num_patches = int((seq_len - patch_len) / patch_len + 1)
        self.alpha = alpha
        self.patch_embed = PatchEmbed(d_model, patch_len, patch_len)
        self.backbone = TimeFilter_Backbone(d_model, c_out, 2 * d_model, n_heads, e_layers, top_p, 0.0,
                                            seq_len * c_out // patch_len)
        self.head = nn.Linear(d_model * self.num_patches, pred_len)

    def _get_mask(self, device):
        dtype = torch.float32
        L = self.seq_len * self.n_vars // self.patch_len
        N = self.seq_len // self.patch_len
        masks = []
        for k in range(L):
            S = ((torch.arange(L) % N == k % N) & (torch.arange(L) != k)).to(dtype).to(device)
            T = ((torch.arange(L) >= k // N * N) & (torch.arange(L) < k // N * N + N) & (torch.arange(L) != k)).to(
                dtype).to(device)
            ST = torch.ones(L).to(dtype).to(device) - S - T
            ST[k] = 0.0
            masks.append(torch.stack([S, T, ST], dim=0))
        return torch.stack(masks, dim=0)

    def forward(self, x):
        B, T, C = x.shape
        means = x.mean(1, keepdim=True)
        stdev = torch.sqrt(x.var(1, keepdim=True, unbiased=False) + 1e-5)
        x = (x - means) / stdev
        x = x.permute(0, 2, 1).reshape(-1, C * T)
        x = self.patch_embed(x)
        x, moe_loss = self.backbone(x, self._get_mask(x.device), self.alpha)
        x = self.head(x.reshape(-1, self.n_vars, self.num_patches, self.dim).flatten(start_dim=-2))
        x = x.permute(0, 2, 1)
        return x * stdev + means


model = Model().eval()
x = torch.randn(2, 16, 3).cumsum(1)
with torch.no_grad():
    y = model(x)

leak = 0.0
for blk in model.backbone.blocks:
    probs = blk.gnn.last_probs
    keep = blk.gnn.graph_learner.last_keep
    leak = max(leak, (probs * (~keep).float()).sum(-1).max().item())
frac = (~model.backbone.blocks[0].gnn.graph_learner.last_keep).float().mean().item()
print(f"fraction of edges filtered out (layer 0): {frac:.3f}")
print(f"forecast finite: {bool(torch.isfinite(y).all())}")
print(f"max softmax mass on filtered-out edges: {leak:.4f}")
