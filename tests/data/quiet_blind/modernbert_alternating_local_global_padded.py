"""ModernBERT encoder (answerdotai/ModernBERT via transformers modeling_modernbert.py) on a padded batch.

Follows src/transformers/models/modernbert/modeling_modernbert.py (ModernBertModel._update_attention_mask:
4-D additive global mask from the padding attention_mask, then `window_mask = distance <=
local_attention // 2` and `sliding_window_mask = global_attention_mask.masked_fill(window_mask.logical_not(),
torch.finfo(dtype).min)`; ModernBertAttention uses the sliding mask when `layer_id %
global_attn_every_n_layers != 0`, with a separate local rope theta; sdpa_attention_forward). Bidirectional
everywhere (it is an encoder): global layers (0, 3) see every real token; local layers see real tokens
within +-local_attention//2 positions in both directions.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

CONFIG = {
    "vocab_size": 64, "hidden_size": 32, "num_attention_heads": 4, "num_hidden_layers": 4,
    "global_attn_every_n_layers": 3, "local_attention": 8, "global_rope_theta": 160000.0,
    "local_rope_theta": 10000.0, "pad_token_id": 0,
}


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x, theta):
    seq_len, d = x.shape[-2], x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2).float() / d))
    freqs = torch.outer(torch.arange(seq_len).float(), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return x * emb.cos() + rotate_half(x) * emb.sin()


class ModernBertAttention(nn.Module):
    def __init__(self, config, layer_id):
        super().__init__()
        self.num_heads = config["num_attention_heads"]
        self.head_dim = config["hidden_size"] // self.num_heads
        self.Wqkv = nn.Linear(config["hidden_size"], 3 * config["hidden_size"], bias=False)
        self.Wo = nn.Linear(config["hidden_size"], config["hidden_size"], bias=False)
        if layer_id % config["global_attn_every_n_layers"] != 0:
            self.local_attention = (config["local_attention"] // 2, config["local_attention"] // 2)
            self.rope_theta = config["local_rope_theta"]
        else:
            self.local_attention = (-1, -1)
            self.rope_theta = config["global_rope_theta"]

    def forward(self, hidden_states, attention_mask, sliding_window_mask):
        bs, seqlen, dim = hidden_states.shape
        qkv = self.Wqkv(hidden_states).view(bs, seqlen, 3, self.num_heads, self.head_dim)
        query, key, value = qkv.transpose(3, 1).unbind(dim=2)
        query, key = apply_rotary(query, self.rope_theta), apply_rotary(key, self.rope_theta)
        if self.local_attention != (-1, -1):
            attention_mask = sliding_window_mask
        attn = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask)
        return self.Wo(attn.transpose(1, 2).contiguous().view(bs, -1, dim))


class ModernBertModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config["vocab_size"], config["hidden_size"], padding_idx=config["pad_token_id"])
        self.layers = nn.ModuleList([ModernBertAttention(config, i) for i in range(config["num_hidden_layers"])])
        self.norms = nn.ModuleList([nn.LayerNorm(config["hidden_size"]) for _ in range(config["num_hidden_layers"])])
        self.final_norm = nn.LayerNorm(config["hidden_size"])

    def _update_attention_mask(self, attention_mask, dtype):
        global_attention_mask = (1.0 - attention_mask[:, None, None, :].to(dtype)) * torch.finfo(dtype).min
        global_attention_mask = global_attention_mask.expand(-1, 1, attention_mask.shape[1], -1)
        rows = torch.arange(global_attention_mask.shape[2]).unsqueeze(0)
        distance = torch.abs(rows - rows.T)
        window_mask = (distance <= self.config["local_attention"] // 2).unsqueeze(0).unsqueeze(0)
        sliding_window_mask = global_attention_mask.masked_fill(window_mask.logical_not(), torch.finfo(dtype).min)
        return global_attention_mask, sliding_window_mask

    def forward(self, input_ids, attention_mask):
        hidden_states = self.tok_embeddings(input_ids)
        global_mask, sliding_window_mask = self._update_attention_mask(attention_mask, hidden_states.dtype)
        for norm, layer in zip(self.norms, self.layers):
            hidden_states = hidden_states + layer(norm(hidden_states), global_mask, sliding_window_mask)
        return self.final_norm(hidden_states)


def main():
    torch.manual_seed(0)
    model = ModernBertModel(CONFIG).eval()
    lengths = [20, 13, 7]
    input_ids = torch.zeros(3, 20, dtype=torch.long)
    attention_mask = torch.zeros(3, 20, dtype=torch.long)
    for b, n in enumerate(lengths):
        input_ids[b, :n] = torch.randint(1, CONFIG["vocab_size"], (n,))
        attention_mask[b, :n] = 1  # tokenizer pads on the right
    with torch.no_grad():
        last_hidden_state = model(input_ids, attention_mask)
    # mean pooling over real tokens, as sentence-transformers does for ModernBERT embedders
    m = attention_mask.unsqueeze(-1).float()
    pooled = (last_hidden_state * m).sum(1) / m.sum(1)
    print("pooled", tuple(pooled.shape), f"{pooled.norm(dim=-1).mean().item():.4f}")


if __name__ == "__main__":
    main()
