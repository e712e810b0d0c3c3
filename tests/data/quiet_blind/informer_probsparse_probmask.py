# Follows Informer2020 models/attn.py ProbAttention (_prob_QK, _get_initial_context, _update_context) and
# utils/masking.py ProbMask: only the top-u "active" queries get a causal softmax row (ProbMask gathers the
# triu(1) rows of those queries); the other rows are not attended at all but set to V.cumsum (mask_flag=True).
import math
import numpy as np
import torch

torch.manual_seed(0)
torch.set_default_dtype(torch.float64)


class ProbMask:
    def __init__(self, B, H, L, index, scores, device="cpu"):
        _mask = torch.ones(L, scores.shape[-1], dtype=torch.bool).to(device).triu(1)
        _mask_ex = _mask[None, None, :].expand(B, H, L, scores.shape[-1])
        indicator = _mask_ex[torch.arange(B)[:, None, None], torch.arange(H)[None, :, None], index, :].to(device)
        self._mask = indicator.view(scores.shape).to(device)

    @property
    def mask(self):
        return self._mask


class ProbAttention(torch.nn.Module):
    def __init__(self, mask_flag=True, factor=2, scale=None):
        super().__init__()
        self.factor, self.scale, self.mask_flag = factor, scale, mask_flag

    def _prob_QK(self, Q, K, sample_k, n_top):
        B, H, L_K, E = K.shape
        _, _, L_Q, _ = Q.shape
        K_expand = K.unsqueeze(-3).expand(B, H, L_Q, L_K, E)
        index_sample = torch.randint(L_K, (L_Q, sample_k))
        K_sample = K_expand[:, :, torch.arange(L_Q).unsqueeze(1), index_sample, :]
        Q_K_sample = torch.matmul(Q.unsqueeze(-2), K_sample.transpose(-2, -1)).squeeze(-2)
        M = Q_K_sample.max(-1)[0] - torch.div(Q_K_sample.sum(-1), L_K)
        M_top = M.topk(n_top, sorted=False)[1]
        Q_reduce = Q[torch.arange(B)[:, None, None], torch.arange(H)[None, :, None], M_top, :]
        Q_K = torch.matmul(Q_reduce, K.transpose(-2, -1))
        return Q_K, M_top

    def _get_initial_context(self, V, L_Q):
        B, H, L_V, D = V.shape
        assert L_Q == L_V  # requires that L_Q == L_V, i.e. for self-attention only
        return V.cumsum(dim=-2)

    def _update_context(self, context_in, V, scores, index, L_Q):
        B, H, L_V, D = V.shape
        if self.mask_flag:
            attn_mask = ProbMask(B, H, L_Q, index, scores, device=V.device)
            scores.masked_fill_(attn_mask.mask, -np.inf)
        attn = torch.softmax(scores, dim=-1)
        context_in[torch.arange(B)[:, None, None], torch.arange(H)[None, :, None], index, :] = torch.matmul(attn, V).type_as(context_in)
        return context_in

    def forward(self, queries, keys, values):
        B, L_Q, H, D = queries.shape
        _, L_K, _, _ = keys.shape
        queries, keys, values = queries.transpose(2, 1), keys.transpose(2, 1), values.transpose(2, 1)
        U_part = min(self.factor * int(np.ceil(np.log(L_K))), L_K)
        u = min(self.factor * int(np.ceil(np.log(L_Q))), L_Q)
        scores_top, index = self._prob_QK(queries, keys, sample_k=U_part, n_top=u)
        scale = self.scale or 1.0 / math.sqrt(D)
        scores_top = scores_top * scale
        context = self._get_initial_context(values, L_Q)
        context = self._update_context(context, values, scores_top, index, L_Q)
        return context.transpose(2, 1).contiguous(), index


B, L, H, D = 2, 16, 2, 8
q, k, v = torch.randn(B, L, H, D), torch.randn(B, L, H, D), torch.randn(B, L, H, D)
out, index = ProbAttention(mask_flag=True, factor=2)(q, k, v)

# reference: for each query either an explicit causal softmax (if selected) or the running sum of V (if lazy)
ref = torch.zeros_like(out)
for b in range(B):
    for h in range(H):
        chosen = set(index[b, h].tolist())
        for i in range(L):
            if i in chosen:
                s = (k[b, : i + 1, h] @ q[b, i, h]) / math.sqrt(D)
                ref[b, i, h] = torch.softmax(s, 0) @ v[b, : i + 1, h]
            else:
                ref[b, i, h] = v[b, : i + 1, h].sum(0)
diff = (out - ref).abs().max().item()
print(f"selected queries per head: {index.shape[-1]} of {L}; max abs diff: {diff:.3e}")
assert diff < 1e-12
