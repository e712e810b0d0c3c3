# OpenNMT/OpenNMT-py#2532 (commit f01bea17): "Apply the attention mask in all decoding steps (LM inference)"
# TransformerLMDecoderLayer._forward built dec_mask (causal + the prompt's pad mask) only when layer_in.size(1) > 1,
# i.e. at step 0. At every later decoding step the self-attention got mask=None, so in a left-padded batch the
# new token attended the pad keys cached in the KV cache. The fix caches a "key_pad_mask" (tgt.eq(pad)) in
# layer_cache at _init_cache, extends it with a False column per step and passes it as the mask.
import sys
from math import sqrt
from typing import Optional

import torch
from torch import nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


def rotaryembeddings(dim: int, maxseqlen=8192, base=10000):
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))
    tmax = torch.arange(maxseqlen, device=inv_freq.device)
    rope = torch.outer(tmax, inv_freq).float()
    rope = torch.polar(torch.ones_like(rope), rope)
    return rope


def apply_rotary_emb(query, key, rope, interleave):
    # non-interleaved (HF Llama-style) variant
    query = query.transpose(1, 2)
    key = key.transpose(1, 2)
    cos, sin = rope.real, rope.imag
    cos = torch.cat((cos, cos), dim=-1).view(1, query.size(1), 1, query.size(3))
    sin = torch.cat((sin, sin), dim=-1).view(1, query.size(1), 1, query.size(3))

    def rotate_half(x):
        x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
        return torch.cat((-x2, x1), dim=-1)

    q_embed = (query * cos) + (rotate_half(query) * sin)
    k_embed = (key * cos) + (rotate_half(key) * sin)
    return q_embed.transpose(1, 2), k_embed.transpose(1, 2)


def shape(x: torch.Tensor, dim_per_head: int) -> torch.Tensor:
    """[batchsize x length x modeldim] -> [batchsize x heads x length x dimperhead]"""
    x_0, x_1, _ = x.size()
    return x.view(x_0, x_1, -1, dim_per_head).transpose(1, 2)


def unshape(x: torch.Tensor) -> torch.Tensor:
    x_0, x_1, _, x_3 = x.size()
    return x.transpose(1, 2).contiguous().view(x_0, -1, x_1 * x_3)


class MultiHeadedAttention(nn.Module):
    def __init__(self, head_count, model_dim, attn_type="self"):
        super().__init__()
        self.dim_per_head = model_dim // head_count
        self.head_count = head_count
        self.linear_keys = nn.Linear(model_dim, model_dim, bias=False)
        self.linear_values = nn.Linear(model_dim, model_dim, bias=False)
        self.linear_query = nn.Linear(model_dim, model_dim, bias=False)
        self.softmax = nn.Softmax(dim=-1)
        self.final_linear = nn.Linear(model_dim, model_dim, bias=False)
        self.attn_type = attn_type
        self.max_relative_positions = -1  # rotary
        self.rotary_interleave = False
        self.rope = rotaryembeddings(self.dim_per_head)
        self.layer_cache = (False, {"keys": torch.tensor([]), "values": torch.tensor([])})
        self.last_attn = None

    def forward(self, key, value, query, mask: Optional[torch.Tensor] = None, sliding_window: Optional[int] = 0,
                step: Optional[int] = 0, return_attn: Optional[bool] = False):
        if FIXED:
            key_pad_mask = self.layer_cache[1].get("key_pad_mask", None)
        if self.layer_cache[0]:
            # Retrieve keys and values from the KV cache (decoding mode only).
            query, key, value = self.linear_query(query), self.linear_keys(query), self.linear_values(query)
            query = shape(query, self.dim_per_head)
            key = shape(key, self.dim_per_head)
            value = shape(value, self.dim_per_head)
            start_pos = step
            seqlen = query.size(2)
            rope = self.rope[start_pos: start_pos + seqlen]
            query, key = apply_rotary_emb(query, key, rope, interleave=self.rotary_interleave)
            if self.layer_cache[1]["keys"].numel() != 0:
                key = torch.cat((self.layer_cache[1]["keys"], key), dim=2)
                value = torch.cat((self.layer_cache[1]["values"], value), dim=2)
            self.layer_cache[1]["keys"] = key
            self.layer_cache[1]["values"] = value

            if FIXED and key_pad_mask is not None:
                # Increase the cached key pad mask by concatenation.
                # For decoding only.
                if step > 0:
                    y = torch.zeros((key_pad_mask.size(0), key_pad_mask.size(1), 1), dtype=torch.bool,
                                    device=key_pad_mask.device)
                    self.layer_cache[1]["key_pad_mask"] = torch.cat((key_pad_mask, y), 2)
                    key_pad_mask = self.layer_cache[1]["key_pad_mask"]
                    mask = key_pad_mask.unsqueeze(1)
        else:
            raise NotImplementedError("training path not needed here")

        # CPU: the explicit scores path
        query /= sqrt(self.dim_per_head)
        scores = torch.matmul(query, key.transpose(2, 3))
        scores = scores.float()
        if mask is not None:
            # not 100% necessary but expand to nb of heads
            mask = mask.expand(-1, self.head_count, -1, -1)
            # now mask and scores have the same shape
            scores = scores.masked_fill(mask, -1e18)
        attn = self.softmax(scores).to(query.dtype)
        self.last_attn = attn
        attn_output = torch.matmul(attn, value)

        context = unshape(attn_output)
        if FIXED and key_pad_mask is not None:
            if key_pad_mask.size(0) > 1 and context.size(1) > 1:
                x = key_pad_mask.squeeze(1).unsqueeze(2).expand(-1, -1, context.size(2))
                context = context.masked_fill(x, 0)
        attn_output = self.final_linear(context)
        return attn_output, attn


class TransformerLMDecoderLayer(nn.Module):
    def __init__(self, d_model, heads, d_ff, sliding_window=0):
        super().__init__()
        self.self_attn = MultiHeadedAttention(heads, d_model, attn_type="self")
        self.layer_norm_1 = nn.LayerNorm(d_model, eps=1e-6)
        self.feed_forward = nn.Sequential(nn.LayerNorm(d_model, eps=1e-6), nn.Linear(d_model, d_ff), nn.SiLU(),
                                          nn.Linear(d_ff, d_model))
        self.sliding_window = sliding_window

    def _compute_dec_mask(self, tgt_pad_mask, future):
        tgt_len = tgt_pad_mask.size(-1)
        if not future:
            future_mask = torch.ones([tgt_len, tgt_len], device=tgt_pad_mask.device, dtype=torch.uint8)
            future_mask = future_mask.tril_(0)
            if self.sliding_window > 0:
                future_mask = future_mask.triu_(-self.sliding_window)
            future_mask = future_mask.bool()
            future_mask = ~future_mask.view(1, tgt_len, tgt_len)
            # Patch for scaled dot product attention.
            patch_mask = ~torch.all(tgt_pad_mask + future_mask, dim=2, keepdim=True).expand_as(
                tgt_pad_mask + future_mask)
            dec_mask = torch.gt(tgt_pad_mask + future_mask, 0)
            dec_mask = torch.logical_and(dec_mask, patch_mask)
        else:
            dec_mask = tgt_pad_mask
        return dec_mask

    def forward(self, layer_in, tgt_pad_mask, step=None, future=False, return_attn=False):
        dec_mask = None
        if layer_in.size(1) > 1:
            # Masking is necessary when sequence length is greater than one
            # The decoding has not started yet,
            # we compute the scores on the source tokens in one shot.
            dec_mask = self._compute_dec_mask(tgt_pad_mask, future)
            dec_mask = dec_mask.unsqueeze(1)
            dec_mask = dec_mask.expand(-1, -1, dec_mask.size(3), -1)
        norm_layer_in = self.layer_norm_1(layer_in)
        attn_output, attns = self.self_attn(norm_layer_in, norm_layer_in, norm_layer_in, mask=dec_mask,
                                            sliding_window=self.sliding_window, step=step,
                                            return_attn=return_attn)
        layer_out = attn_output + layer_in
        layer_out = layer_out + self.feed_forward(layer_out)
        return layer_out, attns


class Embeddings(nn.Module):
    def __init__(self, vocab, dim, word_padding_idx):
        super().__init__()
        self.word_padding_idx = word_padding_idx
        self.emb = nn.Embedding(vocab, dim, padding_idx=word_padding_idx)

    def forward(self, source, step=None):
        return self.emb(source[:, :, 0])


class TransformerLMDecoder(nn.Module):
    def __init__(self, num_layers, d_model, heads, d_ff, embeddings):
        super().__init__()
        self.embeddings = embeddings
        self.transformer_layers = nn.ModuleList(
            [TransformerLMDecoderLayer(d_model, heads, d_ff) for _ in range(num_layers)])
        self.layer_norm = nn.LayerNorm(d_model, eps=1e-6)

    def forward(self, tgt, enc_out=None, step=None, **kwargs):
        if step == 0:
            # decoding mode.
            # Initialize KV cache.
            self._init_cache(tgt)
        dec_out = self.embeddings(tgt, step=step)
        pad_idx = self.embeddings.word_padding_idx
        tgt_pad_mask = tgt[:, :, 0].eq(pad_idx).unsqueeze(1)  # [B, 1, T_tgt]
        for layer in self.transformer_layers:
            dec_out, attn = layer(dec_out, tgt_pad_mask, step=step)
        dec_out = self.layer_norm(dec_out)
        return dec_out, {"std": attn}

    def _init_cache(self, tgt=None):
        for layer in self.transformer_layers:
            cache = {"keys": torch.tensor([], device=tgt.device), "values": torch.tensor([], device=tgt.device)}
            if FIXED:
                cache["key_pad_mask"] = tgt[:, :, 0].eq(self.embeddings.word_padding_idx).unsqueeze(1)
            layer.self_attn.layer_cache = (True, cache)


# ---------------------------------------------------------------- batched LM inference, left-padded prompts
PAD = 1
VOCAB, D_MODEL, HEADS = 50, 32, 4
decoder = TransformerLMDecoder(2, D_MODEL, HEADS, 64, Embeddings(VOCAB, D_MODEL, PAD)).eval()
generator = nn.Linear(D_MODEL, VOCAB)

prompts = [[5, 17, 9], [11, 23, 7, 30, 4, 12]]
max_len = max(len(p) for p in prompts)
src = torch.tensor([[PAD] * (max_len - len(p)) + p for p in prompts]).unsqueeze(-1)  # (B, T, 1), left padded

with torch.no_grad():
    dec_out, attns = decoder(src, step=0)
    next_tok = generator(dec_out[:, -1]).argmax(-1)
    out = [next_tok.tolist()]
    for i in range(3):
        dec_in = next_tok.view(-1, 1, 1)
        dec_out, attns = decoder(dec_in, step=max_len + i)
        log_probs = torch.log_softmax(generator(dec_out[:, -1]), -1)
        next_tok = log_probs.argmax(-1)
        out.append(next_tok.tolist())

attn = decoder.transformer_layers[0].self_attn.last_attn  # (B, heads, 1, keys) at the last step
n_pad = max_len - len(prompts[0])
print("last decode step, row 0 (left-padded by %d): attention weight on pad keys (head 0) = %.4f"
      % (n_pad, attn[0, 0, 0, :n_pad].sum().item()))
print("generated:", out)
print("row 0 log-probs[:4]:", [round(x, 4) for x in log_probs[0, :4].tolist()])
