"""Correct program: nomic-embed-text (NomicBert) retrieval embeddings for right-padded batches
of queries and documents, shrunk to tiny sizes.

Ported from nomic-ai/contrastors @1e27692238fd259025c56b56926893d21f691d84,
src/contrastors/models/huggingface/modeling_hf_nomic_bert.py (NomicBertModel.forward,
NomicBertEncoder, NomicBertBlock post-norm, NomicBertAttention, NomicBertRotaryEmbedding,
apply_rotary_emb, NomciBertGatedMLP), with `get_extended_attention_mask` from
transformers' ModuleUtilsMixin, and the pooling of the nomic-embed-text-v1.5 model card
(mean_pooling over the attention mask, layer_norm, matryoshka truncation, L2 normalise).

Masking, as in the project:
  * the tokenizer's 1/0 attention_mask (right padding) becomes the additive finite bias
    `(1.0 - mask[:, None, None, :]) * torch.finfo(dtype).min`, added to the scores of every
    layer (keys only; padded query rows still produce values, ignored later);
  * rotary positions are 0..S-1 for every row (seqlen_offset=0), which is right for right
    padding: each real token keeps the position it has when its text is run alone;
  * mean pooling multiplies by the same attention_mask and divides by its clamped count.

Checked: every query / document embedding, and the query-document similarity matrix, equal
those of each text run alone without padding.
"""
import math
from functools import partial

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


class Config:
    vocab_size = 50
    n_embd = 32
    n_head = 4
    n_layer = 2
    n_inner = 48
    type_vocab_size = 2
    pad_token_id = 0
    rotary_emb_fraction = 1.0
    rotary_emb_base = 1000.0
    rotary_emb_interleaved = False
    qkv_proj_bias = False
    mlp_fc1_bias = False
    mlp_fc2_bias = False
    activation_function = "swiglu"
    layer_norm_epsilon = 1e-12
    prenorm = False
    causal = False
    attn_pdrop = 0.0
    resid_pdrop = 0.0
    initializer_range = 0.1


def _init_weights(module, initializer_range=0.02):
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, std=initializer_range)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, std=initializer_range)
        if module.padding_idx is not None:
            nn.init.zeros_(module.weight[module.padding_idx])


class NomicBertEmbeddings(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.n_embd, padding_idx=config.pad_token_id)
        self.type_vocab_size = config.type_vocab_size
        if self.type_vocab_size > 0:
            self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.n_embd)

    def forward(self, input_ids, token_type_ids=None):
        batch_size, seqlen = input_ids.shape
        embeddings = self.word_embeddings(input_ids)
        if self.type_vocab_size > 0:
            if token_type_ids is None:
                token_type_ids = torch.zeros(seqlen, dtype=torch.long, device=input_ids.device)
            embeddings = embeddings + self.token_type_embeddings(token_type_ids)
        return embeddings


class NomciBertGatedMLP(nn.Module):
    def __init__(self, in_features, hidden_features, bias1=True, bias2=True, activation=F.silu):
        super().__init__()
        self.fc11 = nn.Linear(in_features, hidden_features, bias=bias1)
        self.fc12 = nn.Linear(in_features, hidden_features, bias=bias1)
        self.activation = activation
        self.fc2 = nn.Linear(hidden_features, in_features, bias=bias2)

    def forward(self, x):
        y = self.fc11(x)
        gate = self.fc12(x)
        y = y * self.activation(gate)
        return self.fc2(y)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_emb(x, cos, sin, offset=0):
    """x: (batch, seqlen, nheads, headdim); cos, sin: (seqlen, rotary_dim / 2)."""
    ro_dim = cos.shape[-1] * 2
    cos, sin = cos[offset : offset + x.shape[1]], sin[offset : offset + x.shape[1]]
    cos = torch.cat([cos, cos], dim=-1)[:, None, :]  # repeat "... d -> ... 1 (2 d)"
    sin = torch.cat([sin, sin], dim=-1)[:, None, :]
    return torch.cat([x[..., :ro_dim] * cos + rotate_half(x[..., :ro_dim]) * sin, x[..., ro_dim:]], dim=-1)


class NomicBertRotaryEmbedding(nn.Module):
    def __init__(self, dim, base=10000.0):
        super().__init__()
        self.dim = dim
        self.base = float(base)
        self.register_buffer("inv_freq", 1.0 / (self.base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)),
                             persistent=False)
        self._seq_len_cached = 0
        self._cos_cached = None
        self._sin_cached = None

    def _update_cos_sin_cache(self, seqlen, device=None, dtype=None):
        if seqlen > self._seq_len_cached or self._cos_cached is None or self._cos_cached.dtype != dtype:
            self._seq_len_cached = seqlen
            t = torch.arange(seqlen, device=device, dtype=torch.float32)
            freqs = torch.outer(t, self.inv_freq)
            self._cos_cached = torch.cos(freqs).to(dtype)
            self._sin_cached = torch.sin(freqs).to(dtype)

    def forward(self, qkv, seqlen_offset=0):
        seqlen = qkv.shape[1]
        if seqlen > self._seq_len_cached:
            self._update_cos_sin_cache(seqlen, device=qkv.device, dtype=qkv.dtype)
        elif isinstance(seqlen_offset, int):
            self._update_cos_sin_cache(seqlen + seqlen_offset, device=qkv.device, dtype=qkv.dtype)
        q_rot = apply_rotary_emb(qkv[:, :, 0], self._cos_cached, self._sin_cached, seqlen_offset)
        k_rot = apply_rotary_emb(qkv[:, :, 1], self._cos_cached, self._sin_cached, seqlen_offset)
        return torch.stack((q_rot, k_rot, qkv[:, :, 2]), dim=2)


class NomicBertAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_dim = config.n_embd
        self.num_heads = config.n_head
        self.head_dim = self.embed_dim // self.num_heads
        qkv_dim = self.head_dim * (3 * self.num_heads)
        self.register_buffer("norm_factor", torch.sqrt(torch.tensor(self.head_dim, dtype=torch.float32)),
                             persistent=False)
        self.rotary_emb_dim = int(self.head_dim * config.rotary_emb_fraction)
        self.rotary_emb = NomicBertRotaryEmbedding(dim=self.rotary_emb_dim, base=config.rotary_emb_base)
        self.Wqkv = nn.Linear(self.embed_dim, qkv_dim, bias=config.qkv_proj_bias)
        self.out_proj = nn.Linear(self.embed_dim, self.embed_dim, bias=config.qkv_proj_bias)
        self.drop = nn.Dropout(config.attn_pdrop)

    def forward(self, hidden_states, attention_mask=None):
        past_len = 0
        qkv = self.Wqkv(hidden_states)
        b, s, _ = qkv.shape
        qkv = qkv.view(b, s, 3, self.num_heads, self.head_dim)  # "... (three h d) -> ... three h d"
        if self.rotary_emb_dim > 0:
            qkv = self.rotary_emb(qkv, seqlen_offset=past_len)
        query, key, value = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        query = query.permute(0, 2, 1, 3)
        key = key.permute(0, 2, 1, 3)
        value = value.permute(0, 2, 1, 3)
        attention_scores = torch.matmul(query, key.transpose(-1, -2)) / self.norm_factor
        if attention_mask is not None:
            attention_scores = attention_scores + attention_mask
        attentions_probs = F.softmax(attention_scores, dim=-1)
        attentions_probs = self.drop(attentions_probs)
        attn_output = torch.matmul(attentions_probs, value)
        attn_output = attn_output.permute(0, 2, 1, 3).reshape(b, s, self.embed_dim)
        return self.out_proj(attn_output)


class NomicBertBlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.prenorm = config.prenorm
        self.attn = NomicBertAttention(config)
        self.mlp = NomciBertGatedMLP(config.n_embd, hidden_features=config.n_inner, bias1=config.mlp_fc1_bias,
                                     bias2=config.mlp_fc2_bias, activation=F.silu)
        self.dropout1 = nn.Dropout(config.resid_pdrop)
        self.norm1 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.norm2 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.dropout2 = nn.Dropout(config.resid_pdrop)

    def forward(self, hidden_states, attention_mask=None):
        attn_outputs = self.attn(hidden_states, attention_mask=attention_mask)
        hidden_states = self.norm1((self.dropout1(attn_outputs) + hidden_states).to(dtype=self.norm1.weight.dtype))
        mlp_out = self.mlp(hidden_states)
        hidden_states = self.norm2((self.dropout2(mlp_out) + hidden_states).to(dtype=self.norm2.weight.dtype))
        return hidden_states


class NomicBertModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embeddings = NomicBertEmbeddings(config)
        self.emb_drop = nn.Dropout(config.resid_pdrop)
        self.emb_ln = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.layers = nn.ModuleList([NomicBertBlock(config) for _ in range(config.n_layer)])
        self.apply(partial(_init_weights, initializer_range=config.initializer_range))

    @property
    def dtype(self):
        return self.emb_ln.weight.dtype

    def get_extended_attention_mask(self, attention_mask, input_shape):
        # transformers ModuleUtilsMixin.get_extended_attention_mask (encoder, 2-D mask)
        extended_attention_mask = attention_mask[:, None, None, :]
        extended_attention_mask = extended_attention_mask.to(dtype=self.dtype)
        extended_attention_mask = (1.0 - extended_attention_mask) * torch.finfo(self.dtype).min
        return extended_attention_mask

    def forward(self, input_ids, token_type_ids=None, attention_mask=None):
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        hidden_states = self.embeddings(input_ids, token_type_ids=token_type_ids)
        hidden_states = self.emb_ln(hidden_states)
        hidden_states = self.emb_drop(hidden_states)
        attention_mask = self.get_extended_attention_mask(attention_mask, input_ids.shape)
        for layer in self.layers:
            hidden_states = layer(hidden_states, attention_mask=attention_mask)
        return (hidden_states,)


def mean_pooling(model_output, attention_mask):
    token_embeddings = model_output[0]
    input_mask_expanded = attention_mask.unsqueeze(-1).expand(token_embeddings.size()).float()
    return torch.sum(token_embeddings * input_mask_expanded, 1) / torch.clamp(input_mask_expanded.sum(1), min=1e-9)


def encode(model, batch_ids, matryoshka_dim):
    """batch_ids: list of 1-D token tensors; pads on the right like the BERT tokenizer."""
    S = max(len(t) for t in batch_ids)
    input_ids = torch.full((len(batch_ids), S), Config.pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros(len(batch_ids), S, dtype=torch.long)
    for i, t in enumerate(batch_ids):
        input_ids[i, : len(t)] = t
        attention_mask[i, : len(t)] = 1
    out = model(input_ids, attention_mask=attention_mask)
    emb = mean_pooling(out, attention_mask)
    emb = F.layer_norm(emb, normalized_shape=(emb.shape[1],))
    emb = emb[:, :matryoshka_dim]
    return F.normalize(emb, p=2, dim=1)


def ref_encode_alone(model, ids, matryoshka_dim):
    """Independent reference: the text alone, no padding, attention without any mask."""
    x = model.emb_ln(model.embeddings(ids[None]))
    L = ids.numel()
    for layer in model.layers:
        att = layer.attn
        qkv = att.Wqkv(x).view(1, L, 3, att.num_heads, att.head_dim)
        inv = 1.0 / (att.rotary_emb.base ** (torch.arange(0, att.head_dim, 2).float() / att.head_dim))
        ang = torch.arange(L).float()[:, None] * inv[None]
        cos, sin = ang.cos().repeat(1, 2)[:, None], ang.sin().repeat(1, 2)[:, None]
        q = qkv[0, :, 0] * cos + rotate_half(qkv[0, :, 0]) * sin
        k = qkv[0, :, 1] * cos + rotate_half(qkv[0, :, 1]) * sin
        v = qkv[0, :, 2]
        o = torch.einsum("qhd,khd->hqk", q, k).div(math.sqrt(att.head_dim)).softmax(-1)
        o = torch.einsum("hqk,khd->qhd", o, v).reshape(1, L, -1)
        h = layer.norm1(att.out_proj(o) + x)
        x = layer.norm2(layer.mlp(h) + h)
    emb = x[0].mean(0, keepdim=True)
    emb = F.layer_norm(emb, normalized_shape=(emb.shape[1],))[:, :matryoshka_dim]
    return F.normalize(emb, p=2, dim=1)[0]


def main():
    model = NomicBertModel(Config()).eval()
    query_prefix = torch.tensor([5, 6])  # "search_query:"
    doc_prefix = torch.tensor([7, 8])  # "search_document:"
    queries = [torch.cat([query_prefix, torch.randint(9, 50, (n,))]) for n in (3, 9, 5)]
    docs = [torch.cat([doc_prefix, torch.randint(9, 50, (n,))]) for n in (14, 4, 8, 11)]
    ok = True
    with torch.no_grad():
        for mdim in (32, 16):
            q = encode(model, queries, mdim)
            d = encode(model, docs, mdim)
            rq = torch.stack([ref_encode_alone(model, t, mdim) for t in queries])
            rd = torch.stack([ref_encode_alone(model, t, mdim) for t in docs])
            err = max((q - rq).abs().max().item(), (d - rd).abs().max().item())
            sim_err = (q @ d.T - rq @ rd.T).abs().max().item()
            rank_ok = torch.equal((q @ d.T).argmax(1), (rq @ rd.T).argmax(1))
            good = err < 1e-5 and sim_err < 1e-5 and rank_ok
            ok &= good
            print(f"matryoshka dim {mdim}: embeddings max err {err:.2e}, similarity max err {sim_err:.2e}, "
                  f"same top-1 docs {rank_ok} -> {'match' if good else 'MISMATCH'}")
    print("ALL MATCH" if ok else "MISMATCH")
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
