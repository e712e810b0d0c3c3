# pytorch/executorch PR #18380 (commit 07b7c7e): qwen3_5_moe export.py's _materialize_buffers zero-fills meta
# buffers and re-creates the FullAttention bool causal mask only `if isinstance(layer.attn, FullAttention)`, which
# fails when model.py is imported under another path, so the exported static-cache model runs with an all-False mask.
import sys
import types
import torch

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

# examples/models/qwen3_5_moe/model.py, trimmed to the full-attention path (partial RoPE and the
# GatedDeltaNet / MoE layers omitted; the mask and static KV cache are as upstream).
MODEL_SRC = r'''
import torch
import torch.nn as nn
import torch.nn.functional as F


class Config:
    hidden_size = 32
    num_attention_heads = 4
    num_kv_heads = 2
    head_dim = 8
    rms_norm_eps = 1e-6
    max_seq_len = 16
    vocab_size = 64
    num_hidden_layers = 2


class GemmaRMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x):
        out = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * (1.0 + self.weight.float())).type_as(x)


class KVCache(nn.Module):
    def __init__(self, n_kv_heads, head_dim, max_seq_len):
        super().__init__()
        self.register_buffer("k_cache", torch.zeros(1, n_kv_heads, max_seq_len, head_dim))
        self.register_buffer("v_cache", torch.zeros(1, n_kv_heads, max_seq_len, head_dim))

    def update(self, input_pos, k_val, v_val):
        self.k_cache[:, :, input_pos] = k_val
        self.v_cache[:, :, input_pos] = v_val
        return self.k_cache, self.v_cache


class FullAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.n_heads = config.num_attention_heads
        self.n_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.n_kv_groups = self.n_heads // self.n_kv_heads
        # q_proj includes output gate: 2x heads
        self.q_proj = nn.Linear(config.hidden_size, self.n_heads * self.head_dim * 2, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, self.n_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, self.n_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, config.hidden_size, bias=False)
        self.q_norm = GemmaRMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.kv_cache = KVCache(self.n_kv_heads, self.head_dim, config.max_seq_len)
        mask = torch.tril(torch.ones(config.max_seq_len, config.max_seq_len, dtype=torch.bool))
        self.register_buffer("mask", mask)

    def forward(self, x, input_pos):
        B, T, _ = x.size()
        dtype = x.dtype
        q_and_gate = self.q_proj(x).view(B, T, self.n_heads, self.head_dim * 2)
        q = q_and_gate[..., : self.head_dim]
        gate = q_and_gate[..., self.head_dim :]
        k = self.k_proj(x).view(B, T, self.n_kv_heads, self.head_dim)
        v = self.v_proj(x).view(B, T, self.n_kv_heads, self.head_dim)
        q = self.q_norm(q)
        k = self.k_norm(k)
        q = q.to(dtype).transpose(1, 2)
        k = k.to(dtype).transpose(1, 2)
        v = v.transpose(1, 2)
        # KV cache
        k, v = self.kv_cache.update(input_pos, k, v)
        # GQA expansion
        if self.n_kv_groups > 1:
            k = k.repeat_interleave(self.n_kv_groups, dim=1)
            v = v.repeat_interleave(self.n_kv_groups, dim=1)
        # SDPA with bool mask
        attn_mask = self.mask[input_pos].unsqueeze(0).unsqueeze(0)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
        y = y.transpose(1, 2).contiguous().view(B, T, -1)
        # Output gate
        gate = gate.reshape(B, T, -1)
        y = y * torch.sigmoid(gate)
        return self.o_proj(y)


class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.input_layernorm = GemmaRMSNorm(config.hidden_size)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size)
        self.attn = FullAttention(config)
        self.mlp = nn.Sequential(nn.Linear(config.hidden_size, 64, bias=False), nn.SiLU(),
                                 nn.Linear(64, config.hidden_size, bias=False))

    def forward(self, x, input_pos):
        x = x + self.attn(self.input_layernorm(x), input_pos)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen35MoE(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.num_hidden_layers))
        self.norm = GemmaRMSNorm(config.hidden_size)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, tokens, input_pos):
        x = self.embed_tokens(tokens)
        for layer in self.layers:
            x = layer(x, input_pos)
        return self.lm_head(self.norm(x))
'''


def load_module(name):
    mod = types.ModuleType(name)
    exec(MODEL_SRC, mod.__dict__)
    return mod


# The same model.py imported under two paths: the model is built through one, export.py imports the other.
model_mod = load_module("examples.models.qwen3_5_moe.model")
export_mod = load_module("executorch.examples.models.qwen3_5_moe.model")
FullAttention = export_mod.FullAttention  # export.py: from executorch.examples...model import FullAttention

config = model_mod.Config()

# Reference eager model (real buffers) and its weights, standing in for the HF checkpoint (weights only).
ref_model = model_mod.Qwen35MoE(config).eval()
with torch.no_grad():
    for n, p in ref_model.named_parameters():
        if n.endswith("norm.weight"):
            p.normal_(0, 0.1)
state_dict = {n: p.detach().clone() for n, p in ref_model.named_parameters()}

# Qwen35MoE.from_hf_checkpoint: build on meta, load weights with assign=True; buffers stay on meta.
with torch.device("meta"):
    model = model_mod.Qwen35MoE(config)
model.load_state_dict(state_dict, strict=False, assign=True)
model.eval()


def _materialize_buffers(model, config):
    """Materialize meta-device buffers before torch.export (export.py)."""
    for fqn, buf in list(model.named_buffers()):
        if buf.device.type == "meta":
            parts = fqn.rsplit(".", 1)
            parent = model.get_submodule(parts[0]) if len(parts) > 1 else model
            parent.register_buffer(parts[-1], torch.zeros(buf.shape, dtype=buf.dtype, device="cpu"))

    # Recompute causal masks for full attention layers
    for layer in model.layers:
        if (hasattr(layer.attn, "mask") if FIXED else isinstance(layer.attn, FullAttention)):
            mask = torch.tril(torch.ones(config.max_seq_len, config.max_seq_len, dtype=torch.bool))
            layer.attn.register_buffer("mask", mask)


_materialize_buffers(model, config)


def run(m, prompt, n_new):
    """Runner: prefill with input_pos = arange(T), then one token at a time into the static cache."""
    logits_all = []
    with torch.no_grad():
        T = prompt.shape[1]
        logits = m(prompt, torch.arange(T))
        logits_all.append(logits[:, -1])
        tok = logits[:, -1:].argmax(-1)
        for i in range(n_new):
            logits = m(tok, torch.tensor([T + i]))
            logits_all.append(logits[:, -1])
            tok = logits[:, -1:].argmax(-1)
    return torch.stack(logits_all, 1)


prompt = torch.tensor([[3, 17, 42, 8, 25, 11]])
exported = run(model, prompt, 5)
reference = run(ref_model, prompt, 5)
print("causal mask buffer all False after materialize:", bool((~model.layers[0].attn.mask).all()))
print(f"max |exported-model logits - eager logits| over prefill+decode: {(exported - reference).abs().max().item():.6f}")
