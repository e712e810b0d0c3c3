# Citation: facebookresearch/audiocraft audiocraft/modules/transformer.py (StreamingMultiheadAttention._get_mask,
#   _complete_kv, forward custom non-xformers path) and audiocraft/models/lm.py (LMModel.generate: CFG doubles the
#   batch as [conditional, null-condition], streaming decode over delayed codebooks, logits mixed with cfg_coef).
# Masking: causal self-attention as an additive bias built from absolute positions of the streamed queries vs. the
#   cached keys (queries_pos - keys_pos >= 0 and <= past_context), so the prefill uses a banded causal mask and each
#   decode step sees exactly the cached window (cache truncated to past_context keys); cross-attention to the
#   conditions has no mask (all condition steps are real; the null condition is an all-zero embedding, by design).
import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


class StreamingMultiheadAttention(nn.Module):
    def __init__(self, embed_dim, num_heads, causal=False, past_context=None, cross_attention=False):
        super().__init__()
        self.embed_dim, self.num_heads = embed_dim, num_heads
        self.causal, self.past_context, self.cross_attention = causal, past_context, cross_attention
        self.in_proj_weight = nn.Parameter(torch.randn(3 * embed_dim, embed_dim) * embed_dim ** -0.5)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=False)
        self._streaming_state = {}
        self._is_streaming = False

    def _get_mask(self, current_steps, device, dtype):
        time_dim = 1
        if self._streaming_state:
            past_keys = self._streaming_state['past_keys']
            past_steps = past_keys.shape[time_dim]
        else:
            past_steps = 0
        queries_pos = torch.arange(past_steps, current_steps + past_steps, device=device).view(-1, 1)
        keys_pos = torch.arange(past_steps + current_steps, device=device).view(1, -1)
        delta = queries_pos - keys_pos
        valid = delta >= 0
        if self.past_context is not None:
            valid &= (delta <= self.past_context)
        return torch.where(valid, torch.zeros([], device=device, dtype=dtype),
                           torch.full([], float('-inf'), device=device, dtype=dtype))

    def _complete_kv(self, k, v):
        time_dim = 1
        if self.cross_attention:
            return k, v
        if self._streaming_state:
            pk = self._streaming_state['past_keys']
            nk = torch.cat([pk, k], dim=time_dim)
            pv = self._streaming_state['past_values']
            nv = torch.cat([pv, v], dim=time_dim)
        else:
            nk, nv = k, v
        offset = 0
        if self.past_context is not None:
            offset = max(0, nk.shape[time_dim] - self.past_context)
        if self._is_streaming:
            self._streaming_state['past_keys'] = nk[:, offset:]
            self._streaming_state['past_values'] = nv[:, offset:]
        return nk, nv

    def forward(self, query, key, value):
        attn_mask = None
        if self.causal:
            attn_mask = self._get_mask(query.shape[1], query.device, query.dtype)
        dim = self.in_proj_weight.shape[0] // 3
        B = query.shape[0]
        q = F.linear(query, self.in_proj_weight[:dim]).view(B, -1, self.num_heads, dim // self.num_heads)
        k = F.linear(key, self.in_proj_weight[dim:2 * dim]).view(B, -1, self.num_heads, dim // self.num_heads)
        v = F.linear(value, self.in_proj_weight[2 * dim:]).view(B, -1, self.num_heads, dim // self.num_heads)
        k, v = self._complete_kv(k, v)
        q = q * (q.shape[-1] ** -0.5)
        pre_w = torch.einsum("bqhc,bkhc->bhqk", q, k)
        if attn_mask is not None:
            pre_w = pre_w + attn_mask
        w = torch.softmax(pre_w, dim=-1)
        x = torch.einsum("bhqk,bkhc->bqhc", w, v).reshape(B, -1, dim)
        return self.out_proj(x)


class Layer(nn.Module):
    def __init__(self, d, h, past_context):
        super().__init__()
        self.self_attn = StreamingMultiheadAttention(d, h, causal=True, past_context=past_context)
        self.cross_attention = StreamingMultiheadAttention(d, h, cross_attention=True)
        self.norm1, self.norm_cross, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d), nn.LayerNorm(d)
        self.ff = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def forward(self, x, cross_attention_src):
        h = self.norm1(x)
        x = x + self.self_attn(h, h, h)
        x = x + self.cross_attention(self.norm_cross(x), cross_attention_src, cross_attention_src)
        return x + self.ff(self.norm2(x))


class LMModel(nn.Module):
    def __init__(self, n_q=3, card=16, dim=32, heads=4, past_context=5):
        super().__init__()
        self.n_q, self.card = n_q, card
        self.special_token_id = card
        self.emb = nn.ModuleList([nn.Embedding(card + 1, dim) for _ in range(n_q)])
        self.layers = nn.ModuleList([Layer(dim, heads, past_context) for _ in range(2)])
        self.linears = nn.ModuleList([nn.Linear(dim, card) for _ in range(n_q)])

    def streaming(self, on):
        for m in self.modules():
            if isinstance(m, StreamingMultiheadAttention):
                m._is_streaming = on
                m._streaming_state = {}

    def forward(self, sequence, condition):
        x = sum(self.emb[k](sequence[:, k]) for k in range(self.n_q))
        for layer in self.layers:
            x = layer(x, condition)
        return torch.stack([self.linears[k](x) for k in range(self.n_q)], dim=1)

    @torch.no_grad()
    def generate(self, prompt, condition, max_gen_len=10, cfg_coef=3.0):
        B = prompt.shape[0]
        null_condition = torch.zeros_like(condition)
        cfg_conditions = torch.cat([condition, null_condition], dim=0)
        # delay pattern: codebook k is shifted by k steps, unknown positions hold the special token
        total = prompt.shape[-1] + max_gen_len + self.n_q - 1
        gen_codes = torch.full((B, self.n_q, total), -1, dtype=torch.long)
        gen_codes[..., :prompt.shape[-1]] = prompt
        seq = torch.full((B, self.n_q, total), self.special_token_id, dtype=torch.long)
        for k in range(self.n_q):
            seq[:, k, k:] = gen_codes[:, k, :total - k].clamp(min=0).masked_fill(gen_codes[:, k, :total - k] < 0,
                                                                                  self.special_token_id)
        self.streaming(True)
        start = prompt.shape[-1]
        prev = 0
        for offset in range(start, total):
            curr = seq[..., prev:offset]
            curr = torch.cat([curr, curr], dim=0)
            logits = self(curr, cfg_conditions)[..., -1, :]
            cond_logits, uncond_logits = logits.split(B, dim=0)
            logits = uncond_logits + (cond_logits - uncond_logits) * cfg_coef
            next_token = logits.argmax(-1)
            for k in range(self.n_q):
                if offset - k >= start:
                    seq[:, k, offset] = next_token[:, k]
            prev = offset
        self.streaming(False)
        out = torch.stack([seq[:, k, k:k + start + max_gen_len] for k in range(self.n_q)], dim=1)
        return out


lm = LMModel().eval()
prompt = torch.randint(0, 16, (2, 3, 4))
condition = torch.randn(2, 6, 32)
codes = lm.generate(prompt, condition)
print("codes", tuple(codes.shape), int(codes.sum()))
