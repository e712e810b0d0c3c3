# AnswerDotAI/ModernBERT commit f3a5402 ("split window between left & right context"): FlexBert attention passed
# window_size=(sliding_window, sliding_window) to flash_attn, so a local layer with "window size n" attended to
# 2n+1 tokens (n on each side) instead of n+1; the fix passes (sliding_window // 2, sliding_window // 2).
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, deterministic=False,
                                     window_size=(-1, -1)):
    """CPU stand-in for flash_attn.flash_attn_varlen_qkvpacked_func (non-causal), same semantics:
    sequences are delimited by cu_seqlens; with window_size=(left, right) != -1, query i attends key j
    iff i - left <= j <= i + right (within its own sequence). qkv: (total_nnz, 3, nheads, headdim)."""
    out = torch.empty_like(qkv[:, 0])
    left, right = window_size
    for b in range(cu_seqlens.shape[0] - 1):
        s, e = int(cu_seqlens[b]), int(cu_seqlens[b + 1])
        q, k, v = qkv[s:e].unbind(dim=1)  # (L, h, d)
        n = e - s
        i = torch.arange(n)[:, None]
        j = torch.arange(n)[None, :]
        allowed = torch.ones(n, n, dtype=torch.bool)
        if left >= 0:
            allowed &= j >= i - left
        if right >= 0:
            allowed &= j <= i + right
        o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=allowed)
        out[s:e] = o.transpose(0, 1)
    return out


def unpad_input(hidden_states, attention_mask):
    seqlens_in_batch = attention_mask.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(attention_mask.flatten(), as_tuple=False).flatten()
    max_seqlen_in_batch = seqlens_in_batch.max().item()
    cu_seqlens = F.pad(torch.cumsum(seqlens_in_batch, dim=0, dtype=torch.int32), (1, 0))
    b, s = hidden_states.shape[:2]
    return hidden_states.reshape(b * s, -1)[indices], indices, cu_seqlens, max_seqlen_in_batch


def pad_input(hidden_states, indices, batch, seqlen):
    output = torch.zeros(batch * seqlen, *hidden_states.shape[1:], dtype=hidden_states.dtype)
    output[indices] = hidden_states
    return output.view(batch, seqlen, *hidden_states.shape[1:])


class FlexBertConfig:
    def __init__(self, vocab_size=50, hidden_size=32, num_attention_heads=4, num_hidden_layers=3,
                 intermediate_size=64, max_position_embeddings=64, sliding_window=8, global_attn_every_n_layers=2,
                 use_fa2=True):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_attention_heads = num_attention_heads
        self.num_hidden_layers = num_hidden_layers
        self.intermediate_size = intermediate_size
        self.max_position_embeddings = max_position_embeddings
        self.sliding_window = sliding_window
        self.global_attn_every_n_layers = global_attn_every_n_layers
        self.use_fa2 = use_fa2
        self.attention_probs_dropout_prob = 0.0
        self.deterministic_fa2 = False
        if global_attn_every_n_layers > 0 and (self.num_hidden_layers - 1) % global_attn_every_n_layers != 0:
            raise ValueError("global_attn_every_n_layers must be a divisor of one less than num_hidden_layers")


class FlexBertUnpadAttention(nn.Module):
    def __init__(self, config, layer_id=None):
        super().__init__()
        self.num_attention_heads = config.num_attention_heads
        self.attn_head_size = int(config.hidden_size / config.num_attention_heads)
        self.all_head_size = self.num_attention_heads * self.attn_head_size
        self.p_dropout = config.attention_probs_dropout_prob
        self.Wqkv = nn.Linear(config.hidden_size, 3 * self.all_head_size, bias=False)
        self.Wo = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.out_drop = nn.Identity()
        self.use_fa2 = config.use_fa2
        self.deterministic_fa2 = config.deterministic_fa2

        if config.global_attn_every_n_layers > 0:
            if config.sliding_window == -1:
                raise ValueError("global_attn_every_n_layers` requires `sliding_window` to be set")
            if layer_id % config.global_attn_every_n_layers != 0:
                if FIXED:
                    self.sliding_window = (config.sliding_window // 2, config.sliding_window // 2)
                else:
                    self.sliding_window = (config.sliding_window, config.sliding_window)
            else:
                self.sliding_window = (-1, -1)
        else:
            if FIXED:
                self.sliding_window = (config.sliding_window // 2, config.sliding_window // 2)
            else:
                self.sliding_window = (config.sliding_window, config.sliding_window)

    def forward(self, hidden_states, cu_seqlens, max_seqlen, indices, attn_mask):
        bs, dim = hidden_states.shape
        qkv = self.Wqkv(hidden_states)
        qkv = qkv.view(-1, 3, self.num_attention_heads, self.attn_head_size)
        attn = flash_attn_varlen_qkvpacked_func(
            qkv,
            cu_seqlens=cu_seqlens,
            max_seqlen=max_seqlen,
            dropout_p=self.p_dropout,
            deterministic=self.deterministic_fa2,
            window_size=self.sliding_window,
        )
        attn = attn.view(bs, dim)
        return self.out_drop(self.Wo(attn))


class FlexBertGLU(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.Wi = nn.Linear(config.hidden_size, config.intermediate_size * 2, bias=False)
        self.act = nn.GELU()
        self.Wo = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, hidden_states):
        input, gate = self.Wi(hidden_states).chunk(2, dim=-1)
        return self.Wo(self.act(input) * gate)


class FlexBertUnpadPreNormLayer(nn.Module):
    def __init__(self, config, layer_id=None):
        super().__init__()
        self.attn_norm = nn.LayerNorm(config.hidden_size, bias=False)
        self.attn = FlexBertUnpadAttention(config, layer_id=layer_id)
        self.mlp_norm = nn.LayerNorm(config.hidden_size, bias=False)
        self.mlp = FlexBertGLU(config)

    def forward(self, hidden_states, cu_seqlens, max_seqlen, indices=None, attn_mask=None):
        attn_out = hidden_states + self.attn(self.attn_norm(hidden_states), cu_seqlens, max_seqlen, indices, attn_mask)
        return attn_out + self.mlp(self.mlp_norm(attn_out))


class FlexBertUnpadEncoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.layers = nn.ModuleList(
            [FlexBertUnpadPreNormLayer(config, layer_id=i) for i in range(config.num_hidden_layers)]
        )

    def forward(self, hidden_states, attention_mask, indices=None, cu_seqlens=None, max_seqlen=None):
        if indices is None and cu_seqlens is None:
            batch, seqlen = hidden_states.shape[:2]
            hidden_states, indices, cu_seqlens, max_seqlen = unpad_input(hidden_states, attention_mask.bool())
            for layer_module in self.layers:
                hidden_states = layer_module(hidden_states, cu_seqlens, max_seqlen, indices, attn_mask=attention_mask)
            return pad_input(hidden_states, indices, batch, seqlen)
        raise NotImplementedError


class FlexBertAbsoluteEmbeddings(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.norm = nn.LayerNorm(config.hidden_size, bias=False)

    def forward(self, input_ids, position_ids=None):
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1]).unsqueeze(0)
        return self.norm(self.tok_embeddings(input_ids) + self.position_embeddings(position_ids))


class FlexBertModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embeddings = FlexBertAbsoluteEmbeddings(config)
        self.encoder = FlexBertUnpadEncoder(config)
        self.final_norm = nn.LayerNorm(config.hidden_size, bias=False)

    def forward(self, input_ids, attention_mask=None):
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        embedding_output = self.embeddings(input_ids)
        return self.final_norm(self.encoder(embedding_output, attention_mask))


config = FlexBertConfig(sliding_window=8, global_attn_every_n_layers=2, num_hidden_layers=3)
model = FlexBertModel(config).eval()
print("local layer window_size =", [l.attn.sliding_window for l in model.encoder.layers])

lengths = [32, 21]
input_ids = torch.randint(0, config.vocab_size, (2, 32))
attention_mask = torch.zeros(2, 32, dtype=torch.long)
for b, n in enumerate(lengths):
    attention_mask[b, :n] = 1

with torch.no_grad():
    out = model(input_ids, attention_mask)

    # Reference: the documented layer pattern with a local window of `sliding_window` tokens in total, i.e.
    # sliding_window // 2 to the left and to the right, computed densely for each sequence alone.
    def reference(ids):
        h = model.embeddings(ids)
        n = ids.shape[1]
        i = torch.arange(n)[:, None]
        j = torch.arange(n)[None, :]
        for layer_id, layer in enumerate(model.encoder.layers):
            a = layer.attn
            x = layer.attn_norm(h)
            q, k, v = a.Wqkv(x).view(1, n, 3, a.num_attention_heads, a.attn_head_size).permute(2, 0, 3, 1, 4)
            if layer_id % config.global_attn_every_n_layers != 0:
                allowed = (j - i).abs() <= config.sliding_window // 2
            else:
                allowed = torch.ones(n, n, dtype=torch.bool)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed).transpose(1, 2).reshape(1, n, -1)
            h = h + a.Wo(o)
            h = h + layer.mlp(layer.mlp_norm(h))
        return model.final_norm(h)

    max_diff = 0.0
    for b, n in enumerate(lengths):
        ref = reference(input_ids[b:b + 1, :n])
        max_diff = max(max_diff, (out[b, :n] - ref[0]).abs().max().item())
print(f"max |model - reference with a {config.sliding_window}-token local window|: {max_diff:.6f}")
