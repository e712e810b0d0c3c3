# Citation: huggingface/candle#899 ("Fix T5 kv cache", merge commit 8696f64ba, branch commit 49f89062e),
#   candle-transformers/src/models/t5.rs, read at 8696f64ba^ and 8696f64ba; Rust/candle ported to torch.
# Where: T5Attention::forward, the relative_attention_bias branch that builds `relative_position`
#   (bucket ids) for the first block's self-attention; decoding loop of candle-examples/examples/t5/main.rs.
# Bug: with the decoder KV cache on, the bucket table is built for query rows 0..q_len and key columns
#   0..kv_len where kv_len is the length of the *new* input (1 per cached step), so every cached step adds
#   one (1 x 1) bias, broadcast over all cached keys: the relative-position bias is lost for cached decoding
#   (and the query is placed at position 0 rather than at its position in the sequence).
# Fix: kv_len = k.dim(2) (after the cache concat) and query rows q_start..q_end = (kv_len - q_len)..kv_len
#   when use_cache, else 0..kv_len.
import math
import sys
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


@dataclass
class Config:
    vocab_size: int = 48
    d_model: int = 32
    d_kv: int = 8
    d_ff: int = 64
    num_layers: int = 2
    num_decoder_layers: int = None
    num_heads: int = 4
    relative_attention_num_buckets: int = 32
    relative_attention_max_distance: int = 128
    dropout_rate: float = 0.1
    layer_norm_epsilon: float = 1e-6
    feed_forward_proj: str = "relu"
    is_decoder: bool = False
    is_encoder_decoder: bool = True
    use_cache: bool = True
    pad_token_id: int = 0
    eos_token_id: int = 1


def get_mask(size):
    # u8::from(j > i)
    i = torch.arange(size)[:, None]
    j = torch.arange(size)[None, :]
    return j > i


def masked_fill(on_false, mask, on_true):
    return torch.where(mask, torch.full_like(on_false, on_true), on_false)


class T5LayerNorm(nn.Module):
    def __init__(self, h, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(h))
        self.variance_epsilon = eps

    def forward(self, xs):
        variance = xs.float().pow(2).mean(-1, keepdim=True)
        xs = xs / (variance + self.variance_epsilon).sqrt()
        return xs * self.weight


class T5DenseActDense(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.wi = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.wo = nn.Linear(cfg.d_ff, cfg.d_model, bias=False)

    def forward(self, xs):
        return self.wo(F.relu(self.wi(xs)))


class T5LayerFF(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.layer_norm = T5LayerNorm(cfg.d_model, cfg.layer_norm_epsilon)
        self.dense_act = T5DenseActDense(cfg)

    def forward(self, xs):
        ys = self.layer_norm(xs)
        ys = self.dense_act(ys)
        return xs + ys


class T5Attention(nn.Module):
    def __init__(self, has_relative_attention_bias, decoder, cfg):
        super().__init__()
        inner_dim = cfg.num_heads * cfg.d_kv
        self.q = nn.Linear(cfg.d_model, inner_dim, bias=False)
        self.k = nn.Linear(cfg.d_model, inner_dim, bias=False)
        self.v = nn.Linear(cfg.d_model, inner_dim, bias=False)
        self.o = nn.Linear(inner_dim, cfg.d_model, bias=False)
        self.n_heads = cfg.num_heads
        self.d_kv = cfg.d_kv
        self.relative_attention_bias = (
            nn.Embedding(cfg.relative_attention_num_buckets, cfg.num_heads) if has_relative_attention_bias else None
        )
        self.relative_attention_num_buckets = cfg.relative_attention_num_buckets
        self.relative_attention_max_distance = cfg.relative_attention_max_distance
        self.inner_dim = inner_dim
        self.use_cache = cfg.use_cache and decoder
        self.kv_cache = None

    def _bucket(self, i, j):
        # This only handles the bidirectional case.
        num_buckets = self.relative_attention_num_buckets // 2
        max_exact = num_buckets // 2
        if i < j:
            if j - i < max_exact:
                return j - i + num_buckets
            b = math.log((j - i) / max_exact, self.relative_attention_max_distance / max_exact) * (
                num_buckets - max_exact
            )
            return min(max_exact + num_buckets + int(b), self.relative_attention_num_buckets - 1)
        elif i - j < max_exact:
            return i - j
        else:
            b = math.log((i - j) / max_exact, self.relative_attention_max_distance / max_exact) * (
                num_buckets - max_exact
            )
            return max_exact + int(b)

    def forward(self, xs, position_bias, key_value_states, mask):
        kv_input = xs if key_value_states is None else key_value_states
        b_sz, q_len = xs.shape[0], xs.shape[1]
        kv_len = kv_input.shape[1]
        q = self.q(xs).reshape(b_sz, q_len, self.n_heads, self.d_kv).transpose(1, 2).contiguous()
        k = self.k(kv_input).reshape(b_sz, kv_len, self.n_heads, self.d_kv).transpose(1, 2).contiguous()
        v = self.v(kv_input).reshape(b_sz, kv_len, self.n_heads, self.d_kv).transpose(1, 2).contiguous()

        if self.use_cache:
            if self.kv_cache is not None:
                kv_cache_k, kv_cache_v = self.kv_cache
                k = torch.cat([kv_cache_k, k], 2).contiguous()
                v = torch.cat([kv_cache_v, v], 2).contiguous()
            self.kv_cache = (k, v)

        scores = q @ k.transpose(-1, -2)
        if mask is not None:
            scores = masked_fill(
                scores, mask.unsqueeze(0).unsqueeze(0).repeat(b_sz, self.n_heads, 1, 1), float("-inf")
            )

        if position_bias is not None:
            scores = scores + position_bias
        elif self.relative_attention_bias is None:
            position_bias = None
        else:
            if FIXED:
                kv_len = k.shape[2]
                if self.use_cache:
                    q_start, q_end = kv_len - q_len, kv_len
                else:
                    q_start, q_end = 0, kv_len
            else:
                q_start, q_end = 0, q_len
            relative_position = [[self._bucket(i, j) for j in range(kv_len)] for i in range(q_start, q_end)]
            relative_buckets = torch.tensor(relative_position, dtype=torch.long)
            position_bias = self.relative_attention_bias(relative_buckets).permute(2, 0, 1).unsqueeze(0)
            scores = scores + position_bias

        attn_weights = torch.softmax(scores, dim=-1)
        attn_output = attn_weights @ v
        attn_output = attn_output.transpose(1, 2).reshape(b_sz, q_len, self.inner_dim)
        return self.o(attn_output), position_bias


class T5LayerSelfAttention(nn.Module):
    def __init__(self, h, d, cfg):
        super().__init__()
        self.self_attention = T5Attention(h, d, cfg)
        self.layer_norm = T5LayerNorm(cfg.d_model, cfg.layer_norm_epsilon)

    def forward(self, xs, position_bias, mask):
        normed_xs = self.layer_norm(xs)
        ys, position_bias = self.self_attention(normed_xs, position_bias, None, mask)
        return xs + ys, position_bias


class T5LayerCrossAttention(nn.Module):
    def __init__(self, decoder, cfg):
        super().__init__()
        self.cross_attention = T5Attention(False, decoder, cfg)
        self.layer_norm = T5LayerNorm(cfg.d_model, cfg.layer_norm_epsilon)

    def forward(self, hidden_states, position_bias, key_value_states):
        normed = self.layer_norm(hidden_states)
        ys, position_bias = self.cross_attention(normed, position_bias, key_value_states, None)
        return hidden_states + ys, position_bias


class T5Block(nn.Module):
    def __init__(self, has_relative_attention_bias, decoder, cfg):
        super().__init__()
        self.self_attn = T5LayerSelfAttention(has_relative_attention_bias, decoder, cfg)
        self.cross_attn = T5LayerCrossAttention(decoder, cfg) if cfg.is_decoder else None
        self.ff = T5LayerFF(cfg)

    def forward(self, xs, position_bias, encoder_hidden_states):
        if self.cross_attn is not None:
            mask_len = xs.shape[1]
            # If the input seq length is 1, no need for a mask (KV cache in the decoder).
            mask = None if mask_len <= 1 else get_mask(mask_len)
        else:
            mask = None
        xs, position_bias = self.self_attn(xs, position_bias, mask)
        if self.cross_attn is not None:
            xs, _ = self.cross_attn(xs, None, encoder_hidden_states)
        xs = self.ff(xs)
        return xs, position_bias


class T5Stack(nn.Module):
    def __init__(self, decoder, shared, cfg):
        super().__init__()
        self.block = nn.ModuleList([T5Block(i == 0, decoder, cfg) for i in range(cfg.num_layers)])
        self.shared = shared
        self.final_layer_norm = T5LayerNorm(cfg.d_model, cfg.layer_norm_epsilon)

    def forward(self, input_ids, encoder_hidden_states):
        hidden_states = self.shared(input_ids)
        position_bias = None
        for block in self.block:
            hidden_states, position_bias = block(hidden_states, position_bias, encoder_hidden_states)
        return self.final_layer_norm(hidden_states)


class T5ForConditionalGeneration(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        assert cfg.is_encoder_decoder
        self.shared = nn.Embedding(cfg.vocab_size, cfg.d_model)
        enc_cfg = Config(**{**cfg.__dict__, "is_decoder": False, "use_cache": False, "is_encoder_decoder": False})
        self.encoder = T5Stack(False, self.shared, enc_cfg)
        dec_cfg = Config(
            **{
                **cfg.__dict__,
                "is_decoder": True,
                "is_encoder_decoder": False,
                "num_layers": cfg.num_decoder_layers or cfg.num_layers,
            }
        )
        self.decoder = T5Stack(True, self.shared, dec_cfg)

    def encode(self, input_ids):
        return self.encoder(input_ids, None)

    def decode(self, decoder_input_ids, encoder_output):
        decoder_output = self.decoder(decoder_input_ids, encoder_output)
        sequence_output = decoder_output[:, -1, :]
        return sequence_output @ self.shared.weight.t()


def main():
    cfg = Config()
    model = T5ForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "relative_attention_bias" in name:
                p.normal_(0.0, 2.0)
            elif "layer_norm" not in name:
                p.normal_(0.0, 0.3)

    # one source sentence, as the candle t5 example encodes its --prompt
    tokens = [7, 23, 11, 35, 4, 19, 42, 30, 9, 1]
    input_token_ids = torch.tensor(tokens).unsqueeze(0)
    output_token_ids = [cfg.pad_token_id]
    step_logits = []
    with torch.no_grad():
        encoder_output = model.encode(input_token_ids)
        for index in range(12):
            if index == 0 or not cfg.use_cache:
                decoder_token_ids = torch.tensor(output_token_ids).unsqueeze(0)
            else:
                decoder_token_ids = torch.tensor([output_token_ids[-1]]).unsqueeze(0)
            logits = model.decode(decoder_token_ids, encoder_output).squeeze(0)
            step_logits.append(logits)
            next_token_id = int(torch.argmax(logits))
            if next_token_id == cfg.eos_token_id:
                break
            output_token_ids.append(next_token_id)

    print("fixed" if FIXED else "before fix")
    print("generated ids:", output_token_ids)
    print("last-step logits[:6]:", [round(x, 4) for x in step_logits[-1][:6].tolist()])
    print("sum of max logit over steps: %.4f" % sum(float(l.max()) for l in step_logits))


if __name__ == "__main__":
    main()
