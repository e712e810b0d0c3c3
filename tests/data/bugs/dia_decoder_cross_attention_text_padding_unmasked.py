# nari-labs/dia: PR #230 (commit 2811af1) "fix cross attention mask".
# The decoder's CrossAttention was called without attn_mask, so every decode step attended to the
# text_pad_value positions the text prompt was padded with (text_length); the fix passes state.cross_attn_mask.
import sys
import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

D, H, HD, V_SRC, V_TGT, C = 32, 4, 8, 40, 24, 2
TEXT_PAD = 0


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
        self.register_buffer("timescale", min_timescale * (max_timescale / min_timescale) ** fraction)

    def forward(self, inputs, position):
        position = position.unsqueeze(-1).unsqueeze(-1)
        sinusoid_inp = position / self.timescale
        sin, cos = torch.sin(sinusoid_inp), torch.cos(sinusoid_inp)
        first_half, second_half = torch.chunk(inputs, 2, dim=-1)
        return torch.cat((first_half * cos - second_half * sin, second_half * cos + first_half * sin), dim=-1)


class KVCache:
    def __init__(self, k, v):
        self.k, self.v = k, v

    def update(self, k, v, current_idx):
        self.k[:, :, current_idx, :] = k[:, :, 0]
        self.v[:, :, current_idx, :] = v[:, :, 0]
        return self.k, self.v


class Attention(nn.Module):
    """Trimmed SelfAttention / CrossAttention of dia/layers.py (DenseGeneral -> Linear + view)."""

    def __init__(self):
        super().__init__()
        self.q_proj = nn.Linear(D, H * HD, bias=False)
        self.k_proj = nn.Linear(D, H * HD, bias=False)
        self.v_proj = nn.Linear(D, H * HD, bias=False)
        self.o_proj = nn.Linear(H * HD, D, bias=False)
        self.rotary_emb = RotaryEmbedding(HD)

    def proj(self, lin, x):
        return lin(x).view(x.shape[0], x.shape[1], H, HD)


class SelfAttention(Attention):
    def forward(self, X, q_positions, kv_positions, attn_mask=None, cache=None, current_idx=None):
        q = self.rotary_emb(self.proj(self.q_proj, X), q_positions).transpose(1, 2)
        k = self.rotary_emb(self.proj(self.k_proj, X), kv_positions).transpose(1, 2)
        v = self.proj(self.v_proj, X).transpose(1, 2)
        if cache is not None:
            k, v = cache.update(k, v, current_idx)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=1.0)
        return self.o_proj(out.transpose(1, 2).reshape(X.shape[0], X.shape[1], -1))


class CrossAttention(Attention):
    def forward(self, Xq, q_positions, kv_positions=None, attn_mask=None, cache=None, is_causal=False):
        q = self.rotary_emb(self.proj(self.q_proj, Xq), q_positions).transpose(1, 2)
        attn_k, attn_v = cache.k, cache.v
        out = F.scaled_dot_product_attention(
            q, attn_k, attn_v, attn_mask=attn_mask if not is_causal else None, scale=1.0, is_causal=is_causal
        )
        return self.o_proj(out.transpose(1, 2).reshape(Xq.shape[0], Xq.shape[1], -1))


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(V_SRC, D)
        self.norm1 = nn.RMSNorm(D)
        self.self_attention = SelfAttention()
        self.norm = nn.RMSNorm(D)

    def forward(self, x_ids, state):
        x = self.embedding(x_ids)
        x = x + self.self_attention(self.norm1(x), state.positions, state.positions, attn_mask=state.attn_mask)
        return self.norm(x)


class EncoderInferenceState:
    def __init__(self, text_length, cond_src):
        self.positions = torch.arange(text_length, dtype=torch.float32).unsqueeze(0)
        self.padding_mask = (cond_src.squeeze(1) != TEXT_PAD).repeat_interleave(2, dim=0)
        self.attn_mask = create_attn_mask(self.padding_mask, self.padding_mask, None, is_causal=False)


class DecoderLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.pre_sa_norm, self.pre_ca_norm = nn.RMSNorm(D), nn.RMSNorm(D)
        self.self_attention = SelfAttention()
        self.cross_attention = CrossAttention()

    def forward(self, x, state, self_attn_cache, cross_attn_cache, current_idx):
        self_attn_mask = state.casual_attn_mask[None, None, current_idx]
        x = x + self.self_attention(
            self.pre_sa_norm(x), state.dec_positions, state.dec_positions,
            attn_mask=self_attn_mask, cache=self_attn_cache, current_idx=current_idx,
        )
        x_norm = self.pre_ca_norm(x)
        if FIXED:
            ca_out = self.cross_attention(
                Xq=x_norm, q_positions=state.dec_positions, kv_positions=state.enc_positions,
                attn_mask=state.cross_attn_mask, cache=cross_attn_cache,
            )
        else:
            ca_out = self.cross_attention(
                Xq=x_norm, q_positions=state.dec_positions, kv_positions=state.enc_positions,
                cache=cross_attn_cache,
            )
        return x + ca_out


class Decoder(nn.Module):
    def __init__(self, n_layer=2):
        super().__init__()
        self.embeddings = nn.ModuleList([nn.Embedding(V_TGT, D) for _ in range(C)])
        self.layers = nn.ModuleList([DecoderLayer() for _ in range(n_layer)])
        self.norm = nn.RMSNorm(D)
        self.logits_dense = nn.Linear(D, C * V_TGT)

    def precompute_cross_attn_cache(self, enc_out, enc_positions, k_padding_mask=None):
        caches = []
        for layer in self.layers:
            ca = layer.cross_attention
            k = ca.rotary_emb(ca.proj(ca.k_proj, enc_out), enc_positions).transpose(1, 2)
            v = ca.proj(ca.v_proj, enc_out).transpose(1, 2)
            if k_padding_mask is not None:
                k = k.masked_fill(~k_padding_mask.unsqueeze(1).unsqueeze(3), 0.0)
            caches.append(KVCache(k, v))
        return caches

    def decode_step(self, tgt_ids_Bx1xC, state, current_idx):
        x = sum(self.embeddings[i](tgt_ids_Bx1xC[..., i]) for i in range(C))
        for i, layer in enumerate(self.layers):
            x = layer(x, state, state.self_attn_cache[i], state.cross_attn_cache[i], current_idx)
        return self.logits_dense(self.norm(x)).view(x.shape[0], 1, C, V_TGT)


class DecoderInferenceState:
    def __init__(self, enc_state, enc_out, cross_cache, max_audio_len, n_layer):
        B2 = enc_out.shape[0]
        self.enc_positions = enc_state.positions
        self.dec_positions = torch.zeros((B2, 1), dtype=torch.int32)
        self.casual_attn_mask = torch.tril(torch.ones(max_audio_len, max_audio_len, dtype=torch.bool))
        self.self_attn_cache = [KVCache(torch.zeros(B2, H, max_audio_len, HD), torch.zeros(B2, H, max_audio_len, HD))
                                for _ in range(n_layer)]
        self.cross_attn_cache = cross_cache
        dec_mask = torch.ones((B2, 1), dtype=torch.bool)
        self.cross_attn_mask = create_attn_mask(dec_mask, enc_state.padding_mask, None, is_causal=False)

    def prepare_step(self, step_from):
        self.dec_positions = torch.arange(step_from, step_from + 1, dtype=torch.int32).unsqueeze(0)


encoder, decoder = Encoder().eval(), Decoder().eval()
STEPS = 6


@torch.no_grad()
def generate(text_tokens, text_length):
    """Dia.generate path: _pad_text_input -> CFG stacking -> encoder -> cross cache -> greedy decode loop."""
    B = len(text_tokens)
    src = torch.full((B, 1, text_length), TEXT_PAD, dtype=torch.long)
    for i in range(B):
        src[i, 0, : len(text_tokens[i])] = text_tokens[i]
    text = src.squeeze(1)
    enc_input = torch.stack([torch.zeros_like(text), text], dim=1).view(2 * B, -1)
    enc_state = EncoderInferenceState(text_length, src)
    enc_out = encoder(enc_input, enc_state)
    cross = decoder.precompute_cross_attn_cache(enc_out, enc_state.positions, enc_state.padding_mask)
    state = DecoderInferenceState(enc_state, enc_out, cross, STEPS, len(decoder.layers))
    tokens = torch.ones((2 * B, 1, C), dtype=torch.long)
    all_logits = []
    for step in range(STEPS):
        state.prepare_step(step)
        logits = decoder.decode_step(tokens, state, step)  # [2B, 1, C, V]
        uncond, cond = logits.view(B, 2, C, V_TGT).unbind(1)
        cfg = cond + 3.0 * (cond - uncond)
        all_logits.append(cfg)
        tokens = cfg.argmax(-1).repeat_interleave(2, dim=0).unsqueeze(1)
    return torch.stack(all_logits, 1)


texts = [torch.randint(1, V_SRC, (5,)), torch.randint(1, V_SRC, (11,))]
batched = generate(texts, text_length=16)  # padded to config.data.text_length
diff = 0.0
for i, t in enumerate(texts):
    alone = generate([t], text_length=len(t))  # no text padding at all
    diff = max(diff, (batched[i] - alone[0]).abs().max().item())
print(f"max |logits(padded text_length) - logits(unpadded text)| over decode loop: {diff:.6f}")
