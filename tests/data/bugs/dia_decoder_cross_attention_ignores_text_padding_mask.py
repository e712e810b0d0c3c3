# nari-labs/dia: PR nari-labs/dia#230 (commit e4f886a, "fix cross attention mask").
# DecoderLayer called CrossAttention without attn_mask, so every decoder step attended to the
# padded text positions of the encoder output (only K was zeroed there, V was not).
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

TEXT_PAD_VALUE = 0
D_ENC, D_DEC, N_Q, N_KV, HEAD = 32, 32, 4, 2, 8
CHANNELS, TGT_VOCAB, SRC_VOCAB, MAX_AUDIO = 3, 40, 30, 8


def create_attn_mask(q_padding_mask_1d, k_padding_mask_1d, device, is_causal=False):
    p_mask_q = q_padding_mask_1d.unsqueeze(2)  # [B, Tq, 1]
    p_mask_k = k_padding_mask_1d.unsqueeze(1)  # [B, 1, Tk]
    non_pad_attends_non_pad = p_mask_q & p_mask_k
    pad_attends_pad = (~p_mask_q) & (~p_mask_k)
    mask = non_pad_attends_non_pad | pad_attends_pad
    if is_causal:
        causal_mask_2d = torch.tril(torch.ones_like(mask[0], dtype=torch.bool, device=device))
        return (mask & causal_mask_2d).unsqueeze(1)
    return mask.unsqueeze(1)


class RotaryEmbedding(nn.Module):
    def __init__(self, embedding_dims, min_timescale=1, max_timescale=10000):
        super().__init__()
        half = embedding_dims // 2
        fraction = (2.0 * torch.arange(0, half)) / embedding_dims
        self.register_buffer("timescale", (min_timescale * (max_timescale / min_timescale) ** fraction).float(), persistent=False)

    def forward(self, inputs, position):
        position = position.unsqueeze(-1).unsqueeze(-1)
        sinusoid_inp = position / self.timescale
        sin, cos = torch.sin(sinusoid_inp), torch.cos(sinusoid_inp)
        first_half, second_half = torch.chunk(inputs.float(), 2, dim=-1)
        return torch.cat((first_half * cos - second_half * sin, second_half * cos + first_half * sin), dim=-1)


class KVCache:
    def __init__(self, k, v):
        self.k, self.v = k, v

    @classmethod
    def empty(cls, batch_size, num_heads, max_len, head_dim):
        return cls(torch.zeros(2 * batch_size, num_heads, max_len, head_dim), torch.zeros(2 * batch_size, num_heads, max_len, head_dim))

    def update(self, k, v, current_idx):
        self.k[:, :, current_idx, :] = k
        self.v[:, :, current_idx, :] = v
        return self.k, self.v


class Attention(nn.Module):
    """SelfAttention / CrossAttention of dia/layers.py (DenseGeneral written as Linear + reshape)."""

    def __init__(self, q_dim, kv_dim):
        super().__init__()
        self.q_proj = nn.Linear(q_dim, N_Q * HEAD, bias=False)
        self.k_proj = nn.Linear(kv_dim, N_KV * HEAD, bias=False)
        self.v_proj = nn.Linear(kv_dim, N_KV * HEAD, bias=False)
        self.o_proj = nn.Linear(N_Q * HEAD, q_dim, bias=False)
        self.rotary_emb = RotaryEmbedding(HEAD)
        self.num_gqa_groups = N_Q // N_KV

    def q(self, x, pos):
        return self.rotary_emb(self.q_proj(x).unflatten(-1, (N_Q, HEAD)), position=pos).transpose(1, 2)

    def kv(self, x, pos):
        k = self.rotary_emb(self.k_proj(x).unflatten(-1, (N_KV, HEAD)), position=pos).transpose(1, 2)
        v = self.v_proj(x).unflatten(-1, (N_KV, HEAD)).transpose(1, 2)
        return k, v

    def out(self, q, k, v, attn_mask):
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=1.0, enable_gqa=self.num_gqa_groups > 1)
        return self.o_proj(o.transpose(1, 2).flatten(-2))


class EncoderLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.pre_sa_norm = nn.RMSNorm(D_ENC)
        self.post_sa_norm = nn.RMSNorm(D_ENC)
        self.self_attention = Attention(D_ENC, D_ENC)
        self.mlp = nn.Sequential(nn.Linear(D_ENC, 64), nn.SiLU(), nn.Linear(64, D_ENC))

    def forward(self, x, state):
        h = self.pre_sa_norm(x)
        k, v = self.self_attention.kv(h, state["positions"])
        x = x + self.self_attention.out(self.self_attention.q(h, state["positions"]), k, v, state["attn_mask"])
        return x + self.mlp(self.post_sa_norm(x))


class DecoderLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.pre_sa_norm = nn.RMSNorm(D_DEC)
        self.pre_ca_norm = nn.RMSNorm(D_DEC)
        self.pre_mlp_norm = nn.RMSNorm(D_DEC)
        self.self_attention = Attention(D_DEC, D_DEC)
        self.cross_attention = Attention(D_DEC, D_ENC)
        self.mlp = nn.Sequential(nn.Linear(D_DEC, 64), nn.SiLU(), nn.Linear(64, D_DEC))

    def forward(self, x, state, self_attn_cache, cross_attn_cache, current_idx):
        x_norm = self.pre_sa_norm(x)
        self_attn_mask = state["casual_attn_mask"][None, None, current_idx]
        k, v = self.self_attention.kv(x_norm, state["dec_positions"])
        k, v = self_attn_cache.update(k[:, :, 0], v[:, :, 0], current_idx)
        x = x + self.self_attention.out(self.self_attention.q(x_norm, state["dec_positions"]), k, v, self_attn_mask)

        x_norm = self.pre_ca_norm(x)
        q = self.cross_attention.q(x_norm, state["dec_positions"])
        if FIXED:
            ca_out = self.cross_attention.out(q, cross_attn_cache.k, cross_attn_cache.v, state["cross_attn_mask"])
        else:
            ca_out = self.cross_attention.out(q, cross_attn_cache.k, cross_attn_cache.v, None)
        x = x + ca_out
        return x + self.mlp(self.pre_mlp_norm(x))


class DiaModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc_embedding = nn.Embedding(SRC_VOCAB, D_ENC)
        self.enc_layers = nn.ModuleList([EncoderLayer() for _ in range(2)])
        self.enc_norm = nn.RMSNorm(D_ENC)
        self.embeddings = nn.ModuleList([nn.Embedding(TGT_VOCAB, D_DEC) for _ in range(CHANNELS)])
        self.dec_layers = nn.ModuleList([DecoderLayer() for _ in range(2)])
        self.dec_norm = nn.RMSNorm(D_DEC)
        self.logits_dense = nn.Linear(D_DEC, CHANNELS * TGT_VOCAB, bias=False)

    def precompute_cross_attn_cache(self, enc_out, enc_positions, k_padding_mask=None):
        caches = []
        for layer in self.dec_layers:
            k, v = layer.cross_attention.kv(enc_out, enc_positions)
            if k_padding_mask is not None:
                k = k.masked_fill(~k_padding_mask.unsqueeze(1).unsqueeze(3), 0.0)
            caches.append(KVCache(k, v))
        return caches

    @torch.no_grad()
    def generate_logits(self, text, tokens):  # text: [B, T_text] padded with TEXT_PAD_VALUE; tokens: teacher-forced codes
        B, text_length = text.shape
        # _prepare_generation: unconditional (all zeros) and conditional rows, stacked for CFG
        stacked = torch.stack([torch.zeros_like(text), text], dim=1).view(2 * B, -1)
        positions = torch.arange(text_length, dtype=torch.float32).unsqueeze(0)
        padding_mask = (stacked != TEXT_PAD_VALUE)
        enc_state = {"positions": positions, "attn_mask": create_attn_mask(padding_mask, padding_mask, "cpu")}
        x = self.enc_embedding(stacked)
        for layer in self.enc_layers:
            x = layer(x, enc_state)
        enc_out = self.enc_norm(x)
        cross_cache = self.precompute_cross_attn_cache(enc_out, positions, padding_mask)

        # DecoderInferenceState.new
        dec_mask = torch.ones((2 * B, 1), dtype=torch.bool)
        state = {
            "casual_attn_mask": torch.tril(torch.ones(MAX_AUDIO, MAX_AUDIO, dtype=torch.bool)),
            "cross_attn_mask": create_attn_mask(dec_mask, padding_mask, "cpu", is_causal=False),
        }
        self_caches = [KVCache.empty(B, N_KV, MAX_AUDIO, HEAD) for _ in self.dec_layers]
        out = []
        for step in range(MAX_AUDIO):
            state["dec_positions"] = torch.full((1, 1), step, dtype=torch.float32)
            tok = tokens[:, step : step + 1].repeat_interleave(2, dim=0)
            x = sum(self.embeddings[c](tok[..., c]) for c in range(CHANNELS))
            for i, layer in enumerate(self.dec_layers):
                x = layer(x, state, self_caches[i], cross_cache[i], step)
            logits = self.logits_dense(self.dec_norm(x)).view(2 * B, CHANNELS, TGT_VOCAB)
            out.append(logits.view(B, 2, CHANNELS, TGT_VOCAB))
        return torch.stack(out, dim=1)  # [B, steps, 2(uncond, cond), C, V]


model = DiaModel().eval()
g = torch.Generator().manual_seed(2)
TEXT_LENGTH = 16
lens = [6, 11]
text = torch.full((2, TEXT_LENGTH), TEXT_PAD_VALUE)
for b, n in enumerate(lens):
    text[b, :n] = torch.randint(1, SRC_VOCAB, (n,), generator=g)

tokens = torch.randint(0, TGT_VOCAB, (2, MAX_AUDIO, CHANNELS), generator=g)
batched = model.generate_logits(text, tokens)
diff = 0.0
for b, n in enumerate(lens):
    alone = model.generate_logits(text[b : b + 1, :n], tokens[b : b + 1])  # same prompt, no text padding
    diff = max(diff, (batched[b, :, 1] - alone[0, :, 1]).abs().max().item())
print(f"fixed={FIXED} max |cond logits(padded text) - cond logits(unpadded text)| = {diff:.6f}")
print(f"uncond logits finite: {bool(torch.isfinite(batched[:, :, 0]).all())}")
