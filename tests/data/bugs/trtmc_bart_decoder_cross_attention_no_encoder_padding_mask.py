# TensorRT-Model-Connect (NVIDIA/TensorRT-Model-Connect commit cc55eb1, "fix(bart): align masking and validation
# semantics"): the BART decoder engine's cross-attention ran over all max_enc_seq encoder rows with no mask, so each
# decode step attended the encoder states of the pad tokens the runtime appends to reach max_source_length.
import sys
import math
import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

D, HEADS, FFN, VOCAB, ENC_LAYERS, DEC_LAYERS = 32, 4, 64, 40, 2, 2
HEAD_DIM = D // HEADS
PAD, BOS, EOS, DEC_START = 1, 0, 2, 2


def add_attention_from_rows(q, k, v, mask=None):
    """graph_ops.add_attention_from_rows: rows [S, D] -> heads, IAttention (non-causal, optional additive mask)."""
    q = q.view(q.shape[0], HEADS, HEAD_DIM).transpose(0, 1)[None]
    k = k.view(k.shape[0], HEADS, HEAD_DIM).transpose(0, 1)[None]
    v = v.view(v.shape[0], HEADS, HEAD_DIM).transpose(0, 1)[None]
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0 / math.sqrt(HEAD_DIM))
    return o[0].transpose(0, 1).reshape(-1, D)


class Attn(nn.Module):
    def __init__(self):
        super().__init__()
        self.w_q, self.w_k, self.w_v, self.w_o = (nn.Linear(D, D) for _ in range(4))


class EncLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = Attn()
        self.input_norm, self.post_attn_norm = nn.LayerNorm(D), nn.LayerNorm(D)
        self.w_fc1, self.w_fc2 = nn.Linear(D, FFN), nn.Linear(FFN, D)

    def forward(self, h, attention_mask):
        a = self.attn
        m4 = attention_mask.reshape(1, 1, 1, -1)
        sa = a.w_o(add_attention_from_rows(a.w_q(h), a.w_k(h), a.w_v(h), m4))
        h = self.input_norm(h + sa)
        return self.post_attn_norm(h + self.w_fc2(F.gelu(self.w_fc1(h))))


class DecLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.self_attn, self.cross = Attn(), Attn()
        self.input_norm, self.cross_attn_norm, self.post_attn_norm = nn.LayerNorm(D), nn.LayerNorm(D), nn.LayerNorm(D)
        self.w_fc1, self.w_fc2 = nn.Linear(D, FFN), nn.Linear(FFN, D)

    def forward(self, hidden, cache_k, cache_v, cross_k, cross_v, attention_mask, cross_attention_mask, max_enc_seq):
        a = self.self_attn
        q, k, v = a.w_q(hidden), a.w_k(hidden), a.w_v(hidden)
        ak, av = torch.cat([cache_k, k], 0), torch.cat([cache_v, v], 0)
        m4 = attention_mask.reshape(1, 1, 1, -1)
        sa = a.w_o(add_attention_from_rows(q, ak, av, m4))
        psa = self.input_norm(hidden + sa)
        c = self.cross
        cq, ck_proj, cv_proj = c.w_q(psa), c.w_k(cross_k), c.w_v(cross_v)
        if FIXED:
            cross_mask_4d = cross_attention_mask.reshape(1, 1, 1, max_enc_seq)
            ccf = add_attention_from_rows(cq, ck_proj, cv_proj, mask=cross_mask_4d)
        else:
            ccf = add_attention_from_rows(cq, ck_proj, cv_proj)
        pca = self.cross_attn_norm(psa + c.w_o(ccf))
        out = self.post_attn_norm(pca + self.w_fc2(F.gelu(self.w_fc1(pca))))
        return out, k, v


class Bart(nn.Module):
    def __init__(self):
        super().__init__()
        self.shared = nn.Embedding(VOCAB, D)
        self.enc_pos, self.dec_pos = nn.Embedding(64 + 2, D), nn.Embedding(64 + 2, D)
        self.enc_ln_emb, self.dec_ln_emb = nn.LayerNorm(D), nn.LayerNorm(D)
        self.enc = nn.ModuleList([EncLayer() for _ in range(ENC_LAYERS)])
        self.dec = nn.ModuleList([DecLayer() for _ in range(DEC_LAYERS)])

    def encoder(self, input_ids, attention_mask):  # "encoder" engine
        pos = torch.arange(input_ids.shape[0]) + 2
        h = self.enc_ln_emb(self.shared(input_ids) + self.enc_pos(pos))
        for layer in self.enc:
            h = layer(h, attention_mask)
        return h

    def decoder(self, token_id, position, caches, cross, attention_mask, cross_attention_mask, max_enc_seq):  # "decoder" engine
        h = self.dec_ln_emb(self.shared(token_id) + self.dec_pos(torch.tensor([position + 2])))
        presents = []
        for i, layer in enumerate(self.dec):
            h, k, v = layer(h, caches[i][0], caches[i][1], cross[i][0], cross[i][1], attention_mask, cross_attention_mask, max_enc_seq)
            presents.append((k, v))
        return h @ self.shared.weight.T, presents


class BartPipeline:
    """src/runtime/models/bart/plugin.cpp, transcribed."""

    def __init__(self, model, max_source_length, max_cache_length=16):
        self.m, self.max_source_length_, self.max_cache_length = model, max_source_length, max_cache_length

    def tokenize(self, ids):
        ids = [BOS] + ids + [EOS]
        copy_len = min(len(ids), self.max_source_length_)
        padded = [PAD] * self.max_source_length_
        padded[:copy_len] = ids[:copy_len]
        return torch.tensor(padded), copy_len

    def run_encoder(self, padded_ids, actual_len):
        # Build attention mask: 0.0 for valid positions, -1e9 for padding
        self.encoder_attention_mask_ = torch.full((self.max_source_length_,), -1e9)
        self.encoder_attention_mask_[:actual_len] = 0.0
        self.encoder_output = self.m.encoder(padded_ids, self.encoder_attention_mask_)

    def setup_cross_attention(self):
        self.cross = [(self.encoder_output, self.encoder_output) for _ in range(DEC_LAYERS)]

    def run_decoder(self, forced_tokens=None, max_new_tokens=6):
        caches = [(torch.zeros(self.max_cache_length, D), torch.zeros(self.max_cache_length, D)) for _ in range(DEC_LAYERS)]
        step_logits, out_ids, current = [], [], DEC_START
        for step in range(max_new_tokens):
            mask = torch.full((self.max_cache_length + 1,), -1e9)  # self-attn: visible cache rows + current token
            mask[:step] = 0.0
            mask[-1] = 0.0
            logits, presents = self.m.decoder(torch.tensor([current]), step, caches, self.cross, mask,
                                              self.encoder_attention_mask_, self.max_source_length_)
            for i, (k, v) in enumerate(presents):
                caches[i][0][step] = k[0]
                caches[i][1][step] = v[0]
            step_logits.append(logits[0])
            nxt = int(logits[0].argmax()) if forced_tokens is None else forced_tokens[step]
            out_ids.append(nxt)
            current = nxt
        return torch.stack(step_logits), out_ids

    def generate(self, ids, forced_tokens=None):
        padded, n = self.tokenize(ids)
        self.run_encoder(padded, n)
        self.setup_cross_attention()
        return self.run_decoder(forced_tokens)


model = Bart().eval()
src = torch.randint(3, VOCAB, (7,)).tolist()
with torch.no_grad():
    padded_logits, toks = BartPipeline(model, max_source_length=24).generate(src)  # engine built for 24 source rows
    ref_logits, _ = BartPipeline(model, max_source_length=len(src) + 2).generate(src, forced_tokens=toks)  # no pad rows
print(f"max |decoder logits (source padded to 24) - logits (unpadded source)| = {(padded_logits - ref_logits).abs().max().item():.6f}")
