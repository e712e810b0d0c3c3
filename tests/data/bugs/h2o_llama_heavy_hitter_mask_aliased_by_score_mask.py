# FMInference/H2O PR #34 (commits df486e7, d5962aa), h2o_hf/utils_hh/modify_llama.py LlamaAttention_heavy_hitter.
# The next-step eviction mask is a view that `score_mask[:, -recent_budget:] = 1` writes into (and with recent_budget == 0
# the mask is never zeroed), so decode steps attend to more keys than heavy+recent budget (all keys in heavy-only mode).
import sys, math
from types import SimpleNamespace
import torch
from torch import nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


class LlamaRotaryEmbedding(nn.Module):
    def __init__(self, dim, max_position_embeddings=64, base=10000):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim))
        t = torch.arange(max_position_embeddings).float()
        freqs = torch.einsum("i,j->ij", t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos_cached = emb.cos()[None, None]
        self.sin_cached = emb.sin()[None, None]

    def forward(self, x, seq_len=None):
        return self.cos_cached[:, :, :seq_len], self.sin_cached[:, :, :seq_len]


def apply_rotary_pos_emb(q, k, cos, sin, position_ids):
    cos = cos.squeeze(1).squeeze(0)[position_ids].unsqueeze(1)
    sin = sin.squeeze(1).squeeze(0)[position_ids].unsqueeze(1)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


class LlamaAttention_heavy_hitter(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = self.hidden_size // self.num_heads
        self.q_proj = nn.Linear(self.hidden_size, self.hidden_size, bias=False)
        self.k_proj = nn.Linear(self.hidden_size, self.hidden_size, bias=False)
        self.v_proj = nn.Linear(self.hidden_size, self.hidden_size, bias=False)
        self.o_proj = nn.Linear(self.hidden_size, self.hidden_size, bias=False)
        self.rotary_emb = LlamaRotaryEmbedding(self.head_dim, max_position_embeddings=config.max_position_embeddings)
        self.heavy_budget_ratio = config.heavy_ratio
        self.recent_budget_ratio = config.recent_ratio
        self._reset_masks()
        self.attended = []

    def _reset_masks(self):
        self.attention_masks_next = None
        self.heavy_budget = None
        self.recent_budget = None
        self.cache_budget = None
        self.previous_scores = None

    def forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_value=None, use_cache=False):
        bsz, q_len, _ = hidden_states.size()
        query_states = self.q_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)

        kv_seq_len = key_states.shape[-2]
        if past_key_value is not None:
            kv_seq_len += past_key_value[0].shape[-2]
        cos, sin = self.rotary_emb(value_states, seq_len=kv_seq_len)
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin, position_ids)

        if past_key_value is not None:
            key_states = torch.cat([past_key_value[0], key_states], dim=2)
            value_states = torch.cat([past_key_value[1], value_states], dim=2)
        past_key_value = (key_states, value_states) if use_cache else None

        attn_weights = torch.matmul(query_states, key_states.transpose(2, 3)) / math.sqrt(self.head_dim)
        if attention_mask is not None:
            attn_weights = attn_weights + attention_mask
            attn_weights = torch.max(attn_weights, torch.tensor(torch.finfo(attn_weights.dtype).min))

        if self.attention_masks_next is not None:
            self.attended.append(int(self.attention_masks_next.sum(-1).max()))
            attn_weights = attn_weights * self.attention_masks_next + (1 - self.attention_masks_next) * torch.finfo(attn_weights.dtype).min

        attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query_states.dtype)

        current_scores_sum = attn_weights.sum(0).sum(1)  # (heads, k-tokens)
        if not self.previous_scores == None:
            current_scores_sum[:, :-1] += self.previous_scores
        else:
            self.heavy_budget = int(self.heavy_budget_ratio * current_scores_sum.shape[-1])
            self.recent_budget = int(self.recent_budget_ratio * current_scores_sum.shape[-1])
            self.cache_budget = self.heavy_budget + self.recent_budget

        dtype_attn_weights = attn_weights.dtype
        assert attn_weights.shape[0] == 1
        self.previous_scores = current_scores_sum
        attn_mask = torch.ones(current_scores_sum.shape[0], current_scores_sum.shape[1] + 1).to(dtype_attn_weights)

        attn_tokens_all = self.previous_scores.shape[-1]
        if attn_tokens_all > self.cache_budget:
            if not self.recent_budget == 0:
                attn_mask[:, :-self.recent_budget] = 0
                selected_set = self.previous_scores[:, :-self.recent_budget]
            else:
                if FIXED:
                    attn_mask[:, :] = 0
                selected_set = self.previous_scores
            if not self.heavy_budget == 0:
                _, keep_topk = selected_set.topk(k=self.heavy_budget, dim=-1, largest=True)
                attn_mask = attn_mask.scatter(-1, keep_topk, 1)

        if FIXED:
            self.attention_masks_next = attn_mask.clone().unsqueeze(0).unsqueeze(2)
        else:
            self.attention_masks_next = attn_mask.unsqueeze(0).unsqueeze(2)

        score_mask = attn_mask[:, :-1]
        score_mask[:, -self.recent_budget:] = 1
        self.previous_scores = self.previous_scores * score_mask

        attn_output = torch.matmul(attn_weights, value_states)
        attn_output = attn_output.transpose(1, 2).reshape(bsz, q_len, self.hidden_size)
        return self.o_proj(attn_output), past_key_value


def run(heavy_ratio, recent_ratio, prompt_len=16, new_tokens=8):
    torch.manual_seed(0)
    cfg = SimpleNamespace(hidden_size=32, num_attention_heads=4, max_position_embeddings=64,
                          heavy_ratio=heavy_ratio, recent_ratio=recent_ratio)
    attn = LlamaAttention_heavy_hitter(cfg).eval()
    x = torch.randn(1, prompt_len + new_tokens, cfg.hidden_size)
    with torch.no_grad():
        minf = torch.finfo(torch.float32).min
        causal = torch.triu(torch.full((prompt_len, prompt_len), minf), 1)[None, None]
        out, past = attn(x[:, :prompt_len], attention_mask=causal,
                         position_ids=torch.arange(prompt_len)[None], use_cache=True)
        for t in range(prompt_len, prompt_len + new_tokens):
            kv = past[0].shape[-2] + 1
            out, past = attn(x[:, t:t + 1], attention_mask=torch.zeros(1, 1, 1, kv),
                             position_ids=torch.tensor([[t]]), past_key_value=past, use_cache=True)
    return max(attn.attended) - attn.cache_budget, attn.cache_budget


for heavy, recent in [(0.25, 0.25), (0.5, 0.0)]:
    over, budget = run(heavy, recent)
    print(f"heavy_ratio={heavy} recent_ratio={recent}: cache_budget={budget}, "
          f"keys attended beyond budget at a decode step = {over}")
