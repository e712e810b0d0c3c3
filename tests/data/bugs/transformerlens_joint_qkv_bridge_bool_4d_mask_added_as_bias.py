# TransformerLens (TransformerLensOrg/TransformerLens#1198, commit 42a2d52): JointQKVAttentionBridge._reconstruct_attention
# added HuggingFace's boolean 4D attention mask (True = attend) straight onto the scores, so padded keys got +0
# and real keys +1 instead of being masked: a left-padded row attends to its padding.
import sys
import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class Cfg:
    n_heads = 4
    d_model = 32
    scale_attn_by_inverse_layer_idx = False


class Conv1D(nn.Module):
    """GPT-2's fused c_attn projection (weight is (nx, nf))."""

    def __init__(self, nf, nx):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.2)
        self.bias = nn.Parameter(torch.randn(nf) * 0.02)

    def forward(self, x):
        return torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight).view(*x.shape[:-1], -1)


class GPT2AttentionStub(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.c_attn = Conv1D(3 * cfg.d_model, cfg.d_model)
        self.attn_dropout = nn.Dropout(0.0)


class JointQKVAttentionBridge(nn.Module):
    def __init__(self, original_component, config):
        super().__init__()
        self.original_component = original_component
        self.config = config
        self._layer_idx = 0
        self.o = nn.Linear(config.d_model, config.d_model)
        self.hook_attn_scores = nn.Identity()
        self.hook_pattern = nn.Identity()

    def split_qkv(self, x):
        qkv = self.original_component.c_attn(x)
        return qkv.split(self.config.d_model, dim=-1)

    def _apply_reconstruct_attention_mask(self, attn_scores, attention_mask, seq_len):
        # added by the fix
        min_dtype = torch.finfo(attn_scores.dtype).min
        use_direct_hf_mask = attention_mask is not None and attention_mask.ndim >= 4
        if not use_direct_hf_mask:
            causal_mask = torch.tril(torch.ones(seq_len, seq_len, device=attn_scores.device, dtype=torch.bool))
            attn_scores = attn_scores.masked_fill(~causal_mask, min_dtype)
        if attention_mask is None:
            return attn_scores
        if attention_mask.shape[-1] != seq_len:
            attention_mask = attention_mask[..., :seq_len]
        if attention_mask.ndim >= 3 and attention_mask.shape[-2] != seq_len:
            attention_mask = attention_mask[..., :seq_len, :]
        if attention_mask.dtype == torch.bool:
            attention_mask = torch.where(
                attention_mask,
                torch.zeros((), dtype=attn_scores.dtype, device=attn_scores.device),
                torch.full((), min_dtype, dtype=attn_scores.dtype, device=attn_scores.device),
            )
        else:
            attention_mask = attention_mask.to(dtype=attn_scores.dtype)
        return attn_scores + attention_mask

    def _reconstruct_attention(self, q, k, v, **kwargs):
        """Manual attention computation as fallback using TransformerLens computation logic."""
        num_heads = self.config.n_heads
        batch_size, seq_len, hidden_size = q.shape
        head_dim = hidden_size // num_heads
        q = q.view(batch_size, seq_len, num_heads, head_dim).transpose(1, 2)
        k = k.view(batch_size, seq_len, num_heads, head_dim).transpose(1, 2)
        v = v.view(batch_size, seq_len, num_heads, head_dim).transpose(1, 2)

        scale = head_dim ** (-0.5)
        attn_scores = torch.matmul(q, k.transpose(-2, -1)) * scale

        attention_mask = kwargs.get("attention_mask", None)
        if FIXED:
            attn_scores = self._apply_reconstruct_attention_mask(
                attn_scores=attn_scores, attention_mask=attention_mask, seq_len=seq_len
            )
        else:
            causal_mask = torch.tril(torch.ones(seq_len, seq_len, device=q.device))
            attn_scores = attn_scores.masked_fill(causal_mask == 0, float("-inf"))
            if attention_mask is not None:
                if attention_mask.shape[-1] != seq_len:
                    attention_mask = attention_mask[..., :seq_len]
                if attention_mask.shape[-2] != seq_len:
                    attention_mask = attention_mask[..., :seq_len, :]
                attn_scores = attn_scores + attention_mask
        attn_scores = self.hook_attn_scores(attn_scores)

        attn_weights = torch.nn.functional.softmax(attn_scores, dim=-1)
        attn_weights = self.original_component.attn_dropout(attn_weights)
        attn_weights = self.hook_pattern(attn_weights)
        attn_output = torch.matmul(attn_weights, v)
        attn_output = attn_output.transpose(1, 2).contiguous()
        attn_output = attn_output.view(batch_size, seq_len, num_heads * head_dim)
        attn_output = self.o(attn_output)
        return (attn_output, attn_weights)

    def forward(self, hidden_states, attention_mask=None):
        q, k, v = self.split_qkv(hidden_states)
        return self._reconstruct_attention(q, k, v, attention_mask=attention_mask)


def hf_sdpa_bool_mask(padding_mask_2d):
    """4D boolean mask as transformers' sdpa mask interface hands to attention (True = may attend)."""
    b, t = padding_mask_2d.shape
    causal = torch.tril(torch.ones(t, t, dtype=torch.bool))
    return causal[None, None] & padding_mask_2d[:, None, None, :].bool()


cfg = Cfg()
bridge = JointQKVAttentionBridge(GPT2AttentionStub(cfg), cfg).eval()

# batch of two prompts, left padded (generation-style batching)
T = 10
lengths = [10, 6]
x = torch.randn(2, T, cfg.d_model)
pad = torch.zeros(2, T, dtype=torch.long)
for i, L in enumerate(lengths):
    pad[i, T - L:] = 1
mask4d = hf_sdpa_bool_mask(pad)

with torch.no_grad():
    out_batched, _ = bridge(x, attention_mask=mask4d)
    worst = 0.0
    for i, L in enumerate(lengths):
        xi = x[i:i + 1, T - L:]
        out_alone, _ = bridge(xi, attention_mask=hf_sdpa_bool_mask(torch.ones(1, L, dtype=torch.long)))
        worst = max(worst, (out_batched[i, T - L:] - out_alone[0]).abs().max().item())

print(f"max |padded batch - each prompt alone| over real tokens: {worst:.6f}")
