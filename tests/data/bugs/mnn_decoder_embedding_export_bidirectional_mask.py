# alibaba/MNN#4548: the llm export wrote every embedding model's runtime config onto the
# bidirectional ("int") attention-mask path, so a decoder-style embedding (Qwen3-Embedding,
# last-token pooling) ran without its causal mask; the fix puts decoder embeddings on the causal float path.
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class Attention(nn.Module):
    def __init__(self, hidden, heads):
        super().__init__()
        self.num_heads, self.head_dim = heads, hidden // heads
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.o_proj = nn.Linear(hidden, hidden)

    def forward(self, hidden_states, attention_mask):
        b, s, _ = hidden_states.shape
        q, k, v = self.qkv(hidden_states).view(b, s, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        attn_weights = torch.matmul(q, k.transpose(2, 3)) / self.head_dim ** 0.5
        attn_weights = attn_weights + attention_mask
        attn_weights = torch.softmax(attn_weights, dim=-1)
        out = torch.matmul(attn_weights, v).transpose(1, 2).reshape(b, s, -1)
        return self.o_proj(out)


class Block(nn.Module):
    def __init__(self, hidden, heads):
        super().__init__()
        self.input_layernorm = nn.LayerNorm(hidden)
        self.self_attn = Attention(hidden, heads)
        self.post_attention_layernorm = nn.LayerNorm(hidden)
        self.mlp = nn.Sequential(nn.Linear(hidden, 2 * hidden), nn.SiLU(), nn.Linear(2 * hidden, hidden))

    def forward(self, x, attention_mask):
        x = x + self.self_attn(self.input_layernorm(x), attention_mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class Embedding(nn.Module):
    """Qwen3-Embedding style: decoder-only backbone, last-token pooling."""

    def __init__(self, vocab=120, hidden=32, heads=4, layers=2, max_pos=64):
        super().__init__()
        self.model_type = "qwen3"
        self.is_decoder = True
        self.pooling = "last_token"
        self.embed_tokens = nn.Embedding(vocab, hidden)
        self.embed_positions = nn.Embedding(max_pos, hidden)
        self.blocks = nn.ModuleList(Block(hidden, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(hidden)

    def forward(self, input_ids, attention_mask):
        pos = torch.arange(input_ids.shape[1])
        h = self.embed_tokens(input_ids) + self.embed_positions(pos)
        for blk in self.blocks:
            h = blk(h, attention_mask)
        h = self.norm(h)
        return nn.functional.normalize(h[:, -1], dim=-1)


def get_attention_mask(seq_len):
    # mask used when tracing the decoder for export: causal float mask
    return (1 - torch.tril(torch.ones([1, 1, seq_len, seq_len]))) * torch.finfo(torch.float32).min


def export_llm_config(model):
    config = {"model_type": model.model_type, "is_single": True, "pooling": model.pooling}
    if FIXED:
        config["attention_mask"] = "float" if model.is_decoder else "int"
    else:
        config["attention_mask"] = "int"
    return config


def runtime_attention_mask(llm_config, seq_len):
    # MNN runtime: the "int" path is the encoder (BERT-style) mask, every token sees every token;
    # the "float" path rebuilds the causal mask the graph was traced with.
    if llm_config["attention_mask"] == "int":
        return torch.zeros([1, 1, seq_len, seq_len], dtype=torch.float32)
    return (1 - torch.tril(torch.ones([1, 1, seq_len, seq_len]))) * torch.finfo(torch.float32).min


model = Embedding().eval()
input_ids = torch.randint(1, 120, (1, 12))
seq_len = input_ids.shape[1]

with torch.no_grad():
    traced = model(input_ids, get_attention_mask(seq_len))  # what the exporter verified
    llm_config = export_llm_config(model)
    runtime = model(input_ids, runtime_attention_mask(llm_config, seq_len))

cos = torch.nn.functional.cosine_similarity(traced, runtime).item()
print(f"fixed={FIXED} attention_mask={llm_config['attention_mask']} cos(runtime, traced) = {cos:.6f}"
      f" max diff = {(traced - runtime).abs().max():.4e}")
