# nntile/nntile#377: the T5 greedy generation example re-ran the whole decoder each step with
# model.forward(encoder_ids, decoder_ids), i.e. decoder_attention_mask=nullptr, so the decoder
# self-attention was bidirectional; the fix binds a causal decoder_attn_mask at every step.
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


def sdpa_causal_mask_bool_fill(n):
    return torch.ones(n, n, dtype=torch.bool).tril()


class T5Attention(nn.Module):
    def __init__(self, d_model, n_heads, has_relative_attention_bias, num_buckets=16):
        super().__init__()
        self.n_heads, self.d_kv = n_heads, d_model // n_heads
        self.q = nn.Linear(d_model, d_model, bias=False)
        self.k = nn.Linear(d_model, d_model, bias=False)
        self.v = nn.Linear(d_model, d_model, bias=False)
        self.o = nn.Linear(d_model, d_model, bias=False)
        self.num_buckets = num_buckets
        self.relative_attention_bias = nn.Embedding(num_buckets, n_heads) if has_relative_attention_bias else None

    def position_bias(self, q_len, k_len):
        rel = torch.arange(k_len)[None, :] - torch.arange(q_len)[:, None]
        bucket = rel.clamp(-(self.num_buckets // 2), self.num_buckets // 2 - 1) + self.num_buckets // 2
        return self.relative_attention_bias(bucket).permute(2, 0, 1)[None]

    def forward(self, x, kv=None, mask=None):
        kv = x if kv is None else kv
        b, s, _ = x.shape
        q = self.q(x).view(b, s, self.n_heads, self.d_kv).transpose(1, 2)
        k = self.k(kv).view(b, -1, self.n_heads, self.d_kv).transpose(1, 2)
        v = self.v(kv).view(b, -1, self.n_heads, self.d_kv).transpose(1, 2)
        bias = self.position_bias(s, k.shape[2]) if self.relative_attention_bias is not None else 0.0
        if mask is not None:
            bias = bias + torch.zeros(mask.shape).masked_fill(~mask, float("-inf"))
        attn_mask = bias if torch.is_tensor(bias) else None
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=1.0)  # T5: no scaling
        return self.o(out.transpose(1, 2).reshape(b, s, -1))


class T5Block(nn.Module):
    def __init__(self, d_model, n_heads, is_decoder, first):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.self_attn = T5Attention(d_model, n_heads, has_relative_attention_bias=first)
        self.is_decoder = is_decoder
        if is_decoder:
            self.ln2 = nn.LayerNorm(d_model)
            self.cross_attn = T5Attention(d_model, n_heads, has_relative_attention_bias=False)
        self.ln3 = nn.LayerNorm(d_model)
        self.ff = nn.Sequential(nn.Linear(d_model, 2 * d_model, bias=False), nn.ReLU(),
                                nn.Linear(2 * d_model, d_model, bias=False))

    def forward(self, x, mask=None, enc=None, enc_mask=None):
        x = x + self.self_attn(self.ln1(x), mask=mask)
        if self.is_decoder:
            x = x + self.cross_attn(self.ln2(x), kv=enc, mask=enc_mask)
        return x + self.ff(self.ln3(x))


class T5ForConditionalGeneration(nn.Module):
    def __init__(self, vocab_size=64, d_model=32, num_heads=4, num_layers=2, num_decoder_layers=2):
        super().__init__()
        self.shared = nn.Embedding(vocab_size, d_model)
        self.encoder = nn.ModuleList(T5Block(d_model, num_heads, False, i == 0) for i in range(num_layers))
        self.decoder = nn.ModuleList(T5Block(d_model, num_heads, True, i == 0) for i in range(num_decoder_layers))
        self.enc_norm = nn.LayerNorm(d_model)
        self.dec_norm = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)

    def forward(self, encoder_ids, decoder_ids, encoder_attn_mask=None, decoder_attn_mask=None,
                cross_attn_mask=None):
        h = self.shared(encoder_ids)
        for blk in self.encoder:
            h = blk(h, mask=encoder_attn_mask)
        enc = self.enc_norm(h)
        d = self.shared(decoder_ids)
        for blk in self.decoder:
            d = blk(d, mask=decoder_attn_mask, enc=enc, enc_mask=cross_attn_mask)
        return self.lm_head(self.dec_norm(d))


model = T5ForConditionalGeneration().eval()
encoder_tokens = torch.randint(2, 64, (1, 9))
eos_token_id, max_tokens = 1, 6


def generate(use_causal_mask):
    decoder_tokens = torch.zeros(1, 1, dtype=torch.long)  # decoder_start_token_id = 0
    last_logits = []
    for step in range(max_tokens):
        dec_seq = decoder_tokens.shape[1]
        if use_causal_mask:
            decoder_attn_mask = sdpa_causal_mask_bool_fill(dec_seq)
            logits = model(encoder_tokens, decoder_tokens, None, decoder_attn_mask, None)
        else:
            logits = model(encoder_tokens, decoder_tokens)
        last_logits.append(logits[0, -1])
        next_id = logits[0, -1].argmax()
        decoder_tokens = torch.cat([decoder_tokens, next_id.view(1, 1)], dim=1)
        if next_id.item() == eos_token_id:
            break
    return decoder_tokens, torch.stack(last_logits)


with torch.no_grad():
    tokens, logits = generate(use_causal_mask=FIXED)
    # reference: what the model computes with a causal decoder, step by step on the same prefixes
    ref = torch.stack([model(encoder_tokens, tokens[:, :i + 1], None, sdpa_causal_mask_bool_fill(i + 1), None)[0, -1]
                       for i in range(logits.shape[0])])

print(f"fixed={FIXED} generated={tokens.tolist()[0]} max |step logits - causal reference| = {(logits - ref).abs().max():.4e}")
