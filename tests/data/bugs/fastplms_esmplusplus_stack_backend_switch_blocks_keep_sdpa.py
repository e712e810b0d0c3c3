# Synthyra/FastPLMs commit 616e7a7 ("flex backend fix"), esm_plusplus/modeling_esm_plusplus.py.
# ESM++ (an ESMC port): TransformerStack.forward asks get_attention_mask() for either a 4D boolean mask (sdpa) or a
# FlexAttention block mask (flex), chosen by the stack's own `attn_backend`; each MultiHeadAttention keeps its own
# `attn_backend`, copied once in __init__. Before the fix `attn_backend` was a plain attribute: switching a loaded
# model's stack to "flex" made the stack build only the block mask (attention_mask=None) while every block still ran
# SDPA, which then got attn_mask=None, so the real residues of the shorter protein attended the padding.
# The fix makes attn_backend a property on the stack (and the model) whose setter pushes the backend into every block.
import math
import sys
from functools import partial
from typing import Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import PretrainedConfig
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

FIXED = "--fixed" in sys.argv


def get_attention_mask(attn_backend: str, batch_size: int, seq_len: int, device: torch.device,
                       attention_mask: Optional[torch.Tensor] = None):
    if attention_mask is None:
        token_attention_mask = torch.ones((batch_size, seq_len), device=device).bool()
    else:
        token_attention_mask = attention_mask.bool()

    if attn_backend == "flex":
        def mask_mod(batch_idx, head_idx, q_idx, kv_idx):
            return token_attention_mask[batch_idx, q_idx] & token_attention_mask[batch_idx, kv_idx]

        flex_block_mask = create_block_mask(mask_mod, batch_size, 1, seq_len, seq_len, device=device)
        extended_attention_mask = None
    else:
        flex_block_mask = None
        extended_attention_mask = token_attention_mask[:, None, :, None] & token_attention_mask[:, None, None, :]
    return extended_attention_mask, flex_block_mask


class ESMplusplusConfig(PretrainedConfig):
    model_type = "ESMplusplus"

    def __init__(self, vocab_size=64, hidden_size=64, num_attention_heads=4, num_hidden_layers=2,
                 dropout=0.0, attn_backend="sdpa", **kwargs):
        super().__init__(**kwargs)
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_attention_heads = num_attention_heads
        self.num_hidden_layers = num_hidden_layers
        self.dropout = dropout
        self.attn_backend = attn_backend


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RotaryEmbedding(nn.Module):
    def __init__(self, dim: int, base: float = 10000.0):
        super().__init__()
        self.dim = dim
        inv_freq = 1 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, q: torch.Tensor, k: torch.Tensor):
        # q, k: (b, s, h, d)
        seqlen = q.shape[1]
        t = torch.arange(seqlen, dtype=torch.float32)
        freqs = torch.outer(t, self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos()[None, :, None, :].to(q.dtype)
        sin = emb.sin()[None, :, None, :].to(q.dtype)
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def swiglu_correction_fn(expansion_ratio: float, d_model: int) -> int:
    return int(((expansion_ratio * d_model) + 255) // 256 * 256)


class SwiGLU(nn.Module):
    def forward(self, x):
        x1, x2 = x.chunk(2, dim=-1)
        return F.silu(x1) * x2


def swiglu_ln_ffn(d_model: int, expansion_ratio: float):
    return nn.Sequential(
        nn.LayerNorm(d_model),
        nn.Linear(d_model, swiglu_correction_fn(expansion_ratio, d_model) * 2, bias=False),
        SwiGLU(),
        nn.Linear(swiglu_correction_fn(expansion_ratio, d_model), d_model, bias=False),
    )


class MultiHeadAttention(nn.Module):
    def __init__(self, d_model: int, n_heads: int, attn_backend: str = "sdpa"):
        super().__init__()
        self.d_model = d_model
        self.n_heads = n_heads
        self.d_head = self.d_model // self.n_heads
        self.attn_backend = attn_backend
        self.layernorm_qkv = nn.Sequential(nn.LayerNorm(d_model), nn.Linear(d_model, d_model * 3, bias=False))
        self.out_proj = nn.Linear(d_model, d_model, bias=False)
        self.q_ln = nn.LayerNorm(d_model, bias=False)
        self.k_ln = nn.LayerNorm(d_model, bias=False)
        self.reshaper = partial(self._reshape, h=n_heads)
        self.rotary = RotaryEmbedding(d_model // n_heads)

    @staticmethod
    def _reshape(t, h):  # "b s (h d) -> b h s d"
        b, s, _ = t.shape
        return t.view(b, s, h, -1).transpose(1, 2)

    def _apply_rotary(self, q, k):
        q = q.unflatten(-1, (self.n_heads, self.d_head))
        k = k.unflatten(-1, (self.n_heads, self.d_head))
        q, k = self.rotary(q, k)
        return q.flatten(-2, -1), k.flatten(-2, -1)

    def forward(self, x, attention_mask, flex_block_mask, output_attentions=False):
        attn_weights = None
        qkv_BLD3 = self.layernorm_qkv(x)
        query_BLD, key_BLD, value_BLD = torch.chunk(qkv_BLD3, 3, dim=-1)
        query_BLD, key_BLD = (
            self.q_ln(query_BLD).to(query_BLD.dtype),
            self.k_ln(key_BLD).to(query_BLD.dtype),
        )
        query_BLD, key_BLD = self._apply_rotary(query_BLD, key_BLD)
        query_BHLD, key_BHLD, value_BHLD = map(self.reshaper, (query_BLD, key_BLD, value_BLD))
        scale = 1 / math.sqrt(self.d_head)

        if output_attentions:
            attn_weights = torch.matmul(query_BHLD, key_BHLD.transpose(-2, -1)) * scale
            attn_weights = attn_weights.masked_fill(attention_mask.logical_not(), float("-inf"))
            attn_weights = F.softmax(attn_weights, dim=-1)
            context_BHLD = torch.matmul(attn_weights, value_BHLD)
        else:
            if self.attn_backend == "flex":
                assert query_BHLD.dtype in (torch.float16, torch.bfloat16)
                assert flex_block_mask is not None
                context_BHLD = flex_attention(query_BHLD, key_BHLD, value_BHLD,
                                              block_mask=flex_block_mask, scale=scale)
            else:
                context_BHLD = F.scaled_dot_product_attention(query_BHLD, key_BHLD, value_BHLD,
                                                              attn_mask=attention_mask, scale=scale)
        b, h, s, d = context_BHLD.shape
        context_BLD = context_BHLD.transpose(1, 2).reshape(b, s, h * d)
        return self.out_proj(context_BLD), attn_weights


class UnifiedTransformerBlock(nn.Module):
    def __init__(self, d_model, n_heads, residue_scaling_factor=1, expansion_ratio=8 / 3, dropout=0.0,
                 attn_backend="sdpa"):
        super().__init__()
        self.attn = MultiHeadAttention(d_model=d_model, n_heads=n_heads, attn_backend=attn_backend)
        self.ffn = swiglu_ln_ffn(d_model, expansion_ratio)
        self.scaling_factor = residue_scaling_factor
        self.dropout = nn.Dropout(dropout)

    def forward(self, x, attention_mask, flex_block_mask, output_attentions=False):
        attn_output, attn_weights = self.attn(x, attention_mask, flex_block_mask, output_attentions)
        x = x + self.dropout(attn_output) / self.scaling_factor
        x = x + self.dropout(self.ffn(x)) / self.scaling_factor
        return x, attn_weights


class TransformerStack(nn.Module):
    def __init__(self, d_model, n_heads, n_layers, dropout=0.0, attn_backend="sdpa"):
        super().__init__()
        if FIXED:
            self._attn_backend = attn_backend
        else:
            self.attn_backend = attn_backend
        self.blocks = nn.ModuleList([
            UnifiedTransformerBlock(d_model, n_heads, residue_scaling_factor=math.sqrt(n_layers / 36),
                                    dropout=dropout, attn_backend=attn_backend)
            for i in range(n_layers)
        ])
        self.norm = nn.LayerNorm(d_model, bias=False)
        self.gradient_checkpointing = False
        if FIXED:
            self.attn_backend = attn_backend

    if FIXED:
        @property
        def attn_backend(self) -> str:
            return self._attn_backend

        @attn_backend.setter
        def attn_backend(self, backend: str) -> None:
            assert backend in ("sdpa", "flex"), f"Unsupported attn_backend: {backend}"
            self._attn_backend = backend
            for block in self.blocks:
                block.attn.attn_backend = backend

    def forward(self, x, attention_mask=None, output_hidden_states=False, output_attentions=False):
        attention_mask, flex_block_mask = get_attention_mask(
            attn_backend=self._attn_backend if FIXED else self.attn_backend,
            batch_size=x.shape[0],
            seq_len=x.shape[1],
            device=x.device,
            attention_mask=attention_mask,
        )
        for block in self.blocks:
            x, attn_weights = block(x=x, attention_mask=attention_mask, flex_block_mask=flex_block_mask,
                                    output_attentions=output_attentions)
        return self.norm(x)


class ESMplusplusModel(nn.Module):
    def __init__(self, config: ESMplusplusConfig):
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.transformer = TransformerStack(
            d_model=config.hidden_size,
            n_heads=config.num_attention_heads,
            n_layers=config.num_hidden_layers,
            dropout=config.dropout,
            attn_backend=config.attn_backend,
        )

    def forward(self, input_ids, attention_mask=None):
        x = self.embed(input_ids)
        return self.transformer(x, attention_mask=attention_mask)


# ESM sequence vocab: <cls>=0, <pad>=1, <eos>=2, residues from 4
SEQUENCE_VOCAB = ["<cls>", "<pad>", "<eos>", "<unk>", "L", "A", "G", "V", "S", "E", "R", "T", "I", "D", "P", "K",
                  "Q", "N", "F", "Y", "M", "H", "W", "C"]
STOI = {t: i for i, t in enumerate(SEQUENCE_VOCAB)}


def tokenize(seqs):
    ids = [[STOI["<cls>"]] + [STOI[a] for a in s] + [STOI["<eos>"]] for s in seqs]
    L = max(len(t) for t in ids)
    input_ids = torch.full((len(ids), L), STOI["<pad>"], dtype=torch.long)
    attention_mask = torch.zeros((len(ids), L), dtype=torch.long)
    for i, t in enumerate(ids):
        input_ids[i, : len(t)] = torch.tensor(t)
        attention_mask[i, : len(t)] = 1
    return input_ids, attention_mask


def main():
    torch.manual_seed(0)
    config = ESMplusplusConfig(vocab_size=64, hidden_size=64, num_attention_heads=4, num_hidden_layers=2)
    model = ESMplusplusModel(config).to(torch.bfloat16).eval()
    # switch the loaded model to Flex Attention
    model.transformer.attn_backend = "flex"

    seqs = ["MKTAYIAKQRQISFVKSHFSRQDILD", "MKTAYIAKQR"]
    input_ids, attention_mask = tokenize(seqs)
    with torch.no_grad():
        last_hidden_state = model(input_ids, attention_mask=attention_mask)
    # per-protein mean embedding over real residues
    m = attention_mask.unsqueeze(-1).to(last_hidden_state.dtype)
    emb = (last_hidden_state * m).sum(1) / m.sum(1)
    for s, e in zip(seqs, emb.float()):
        print(f"{s[:12]:<12} len={len(s):>3}  emb[:4]={[round(v, 4) for v in e[:4].tolist()]}  norm={e.norm():.4f}")


if __name__ == "__main__":
    main()
