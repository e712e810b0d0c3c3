"""Chronos forecasting: NaN-left-padded contexts tokenized into bins, a T5 encoder-decoder sampling the horizon.

Follows amazon-science/chronos-forecasting src/chronos/chronos.py (left_pad_and_stack_1D pads with NaN;
MeanScaleUniformBins.context_input_transform: attention_mask = ~isnan(context), token_ids[~attention_mask] =
pad_token_id, EOS appended; ChronosModel.forward -> T5 generate with do_sample, top_k, num_return_sequences,
min_new_tokens = prediction_length; output_transform maps bins back) and the T5 attention of
huggingface/transformers models/t5/modeling_t5.py (relative position bias computed in the first layer and shared,
no 1/sqrt(d) scaling, extended masks added as finfo.min).  Encoder self-attention is bidirectional over the real
context tokens; the decoder is causal; cross-attention sees only real context tokens.  The EOS ban until
min_new_tokens and top-k are vocabulary masks, not attention.  Checked: each series alone (no left padding)
gives the same encoder states and the same decoder logits for a given decoder input.
"""
import math
from dataclasses import dataclass

import torch
import torch.nn as nn


@dataclass
class ChronosConfig:
    n_tokens: int = 64
    n_special_tokens: int = 2
    pad_token_id: int = 0
    eos_token_id: int = 1
    use_eos_token: bool = True
    prediction_length: int = 4
    num_samples: int = 3
    temperature: float = 1.0
    top_k: int = 20
    low_limit: float = -5.0
    high_limit: float = 5.0
    d_model: int = 32
    num_heads: int = 4
    num_layers: int = 2
    relative_attention_num_buckets: int = 16
    relative_attention_max_distance: int = 32


class MeanScaleUniformBins:
    def __init__(self, config):
        self.config = config
        self.centers = torch.linspace(config.low_limit, config.high_limit, config.n_tokens - config.n_special_tokens - 1)
        self.boundaries = torch.cat((torch.tensor([-1e20]), (self.centers[1:] + self.centers[:-1]) / 2, torch.tensor([1e20])))

    def context_input_transform(self, context):
        attention_mask = ~torch.isnan(context)
        scale = torch.nansum(torch.abs(context) * attention_mask, dim=-1) / torch.nansum(attention_mask, dim=-1)
        scale[~(scale > 0)] = 1.0
        scaled_context = context / scale.unsqueeze(-1)
        token_ids = torch.bucketize(scaled_context, self.boundaries, right=True) + self.config.n_special_tokens
        token_ids = token_ids.clamp(max=self.config.n_tokens - 1)
        token_ids[~attention_mask] = self.config.pad_token_id
        if self.config.use_eos_token:
            eos = torch.full((token_ids.size(0), 1), self.config.eos_token_id)
            token_ids = torch.cat([token_ids, eos], dim=1)
            attention_mask = torch.cat([attention_mask, torch.ones_like(eos, dtype=torch.bool)], dim=1)
        return token_ids, attention_mask, scale

    def output_transform(self, samples, scale):
        indices = torch.clamp(samples - self.config.n_special_tokens - 1, min=0, max=len(self.centers) - 1)
        return self.centers[indices] * scale[:, None, None]


def left_pad_and_stack_1D(tensors):
    max_len = max(len(c) for c in tensors)
    return torch.stack([torch.cat((torch.full((max_len - len(c),), torch.nan), c)) for c in tensors])


class T5Attention(nn.Module):
    def __init__(self, config, has_relative_attention_bias=False, is_decoder=False):
        super().__init__()
        self.is_decoder, self.h, self.d = is_decoder, config.num_heads, config.d_model
        self.q, self.k, self.v, self.o = (nn.Linear(config.d_model, config.d_model, bias=False) for _ in range(4))
        self.num_buckets = config.relative_attention_num_buckets
        self.max_distance = config.relative_attention_max_distance
        if has_relative_attention_bias:
            self.relative_attention_bias = nn.Embedding(self.num_buckets, self.h)

    @staticmethod
    def _relative_position_bucket(relative_position, bidirectional, num_buckets, max_distance):
        relative_buckets = 0
        if bidirectional:
            num_buckets //= 2
            relative_buckets += (relative_position > 0).to(torch.long) * num_buckets
            relative_position = torch.abs(relative_position)
        else:
            relative_position = -torch.min(relative_position, torch.zeros_like(relative_position))
        max_exact = num_buckets // 2
        is_small = relative_position < max_exact
        large = max_exact + (torch.log(relative_position.float() / max_exact) / math.log(max_distance / max_exact)
                             * (num_buckets - max_exact)).to(torch.long)
        large = torch.min(large, torch.full_like(large, num_buckets - 1))
        return relative_buckets + torch.where(is_small, relative_position, large)

    def compute_bias(self, query_length, key_length):
        relative_position = torch.arange(key_length)[None, :] - torch.arange(query_length)[:, None]
        buckets = self._relative_position_bucket(relative_position, not self.is_decoder, self.num_buckets, self.max_distance)
        return self.relative_attention_bias(buckets).permute(2, 0, 1).unsqueeze(0)

    def forward(self, hidden_states, mask, key_value_states=None, position_bias=None):
        b, t, _ = hidden_states.shape
        kv = hidden_states if key_value_states is None else key_value_states
        shape = lambda x: x.view(b, -1, self.h, self.d // self.h).transpose(1, 2)
        q, k, v = shape(self.q(hidden_states)), shape(self.k(kv)), shape(self.v(kv))
        scores = q @ k.transpose(-1, -2)  # T5: no 1/sqrt(d)
        if position_bias is None:
            position_bias = (self.compute_bias(t, k.size(2)) if hasattr(self, "relative_attention_bias")
                             else torch.zeros(1, self.h, t, k.size(2)))
            position_bias = position_bias + mask
        attn = (scores + position_bias).softmax(-1)
        return self.o((attn @ v).transpose(1, 2).reshape(b, t, -1)), position_bias


class T5Stack(nn.Module):
    def __init__(self, config, embed_tokens, is_decoder):
        super().__init__()
        self.is_decoder, self.embed_tokens = is_decoder, embed_tokens
        self.self_attn = nn.ModuleList(T5Attention(config, i == 0, is_decoder) for i in range(config.num_layers))
        self.cross_attn = nn.ModuleList(T5Attention(config, False, True) for _ in range(config.num_layers) if is_decoder)
        self.ffn = nn.ModuleList(nn.Sequential(nn.RMSNorm(config.d_model), nn.Linear(config.d_model, 64, bias=False),
                                               nn.ReLU(), nn.Linear(64, config.d_model, bias=False)) for _ in range(config.num_layers))
        self.ln = nn.ModuleList(nn.RMSNorm(config.d_model) for _ in range(2 * config.num_layers))
        self.final_layer_norm = nn.RMSNorm(config.d_model)

    def forward(self, input_ids, attention_mask, encoder_hidden_states=None, encoder_attention_mask=None):
        h = self.embed_tokens(input_ids)
        t, min_value = input_ids.size(1), torch.finfo(h.dtype).min
        ext = attention_mask[:, None, None, :].float()
        if self.is_decoder:
            ext = ext * torch.ones(t, t).tril()[None, None]
        ext = (1.0 - ext) * min_value
        enc_ext = None if encoder_hidden_states is None else (1.0 - encoder_attention_mask[:, None, None, :].float()) * min_value
        position_bias, cross_bias = None, None
        for i in range(len(self.self_attn)):
            out, position_bias = self.self_attn[i](self.ln[2 * i](h), ext, position_bias=position_bias)
            h = h + out
            if self.is_decoder:
                out, cross_bias = self.cross_attn[i](self.ln[2 * i + 1](h), enc_ext, encoder_hidden_states, cross_bias)
                h = h + out
            h = h + self.ffn[i](h)
        return self.final_layer_norm(h)


class T5ForConditionalGeneration(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.shared = nn.Embedding(config.n_tokens, config.d_model)
        self.encoder = T5Stack(config, self.shared, is_decoder=False)
        self.decoder = T5Stack(config, self.shared, is_decoder=True)
        self.lm_head = nn.Linear(config.d_model, config.n_tokens, bias=False)

    def decode(self, decoder_input_ids, encoder_hidden_states, attention_mask):
        dec = self.decoder(decoder_input_ids, torch.ones_like(decoder_input_ids), encoder_hidden_states, attention_mask)
        return self.lm_head(dec * self.config.d_model ** -0.5)

    @torch.no_grad()
    def generate(self, input_ids, attention_mask, generator):
        c = self.config
        enc = self.encoder(input_ids, attention_mask).repeat_interleave(c.num_samples, 0)
        mask = attention_mask.repeat_interleave(c.num_samples, 0)
        seq = torch.full((enc.size(0), 1), c.pad_token_id)  # decoder_start_token_id is the pad id in T5
        for _ in range(c.prediction_length):  # max_new_tokens = min_new_tokens = prediction_length
            logits = self.decode(seq, enc, mask)[:, -1] / c.temperature
            if seq.size(1) - 1 < c.prediction_length:  # MinNewTokensLengthLogitsProcessor: no EOS before the horizon
                logits[:, c.eos_token_id] = float("-inf")
            kth = torch.topk(logits, c.top_k).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))  # TopKLogitsWarper
            nxt = torch.multinomial(logits.softmax(-1), 1, generator=generator)
            seq = torch.cat([seq, nxt], 1)
        return seq[:, 1:].view(input_ids.size(0), c.num_samples, -1)


def main():
    torch.manual_seed(0)
    config = ChronosConfig()
    tokenizer, model = MeanScaleUniformBins(config), T5ForConditionalGeneration(config).eval()
    t = torch.arange(24, dtype=torch.float32)
    context = [torch.sin(t[:24] / 3) * 5 + 10, torch.cos(t[:9]) + 2, torch.randn(15).cumsum(0)]
    context[1][4] = torch.nan  # a missing observation inside the series is masked like padding
    token_ids, attention_mask, scale = tokenizer.context_input_transform(left_pad_and_stack_1D(context))
    samples = model.generate(token_ids, attention_mask, torch.Generator().manual_seed(0))
    forecast = tokenizer.output_transform(samples, scale)

    with torch.no_grad():
        enc = model.encoder(token_ids, attention_mask)
        dec_in = torch.cat([torch.zeros(len(context), 1, dtype=torch.long), samples[:, 0, :-1]], 1)
        logits = model.decode(dec_in, enc, attention_mask)
        for i, c in enumerate(context):
            ids, am, _ = tokenizer.context_input_transform(c[None])
            enc_i = model.encoder(ids, am)
            torch.testing.assert_close(enc[i, -ids.size(1):][am[0]], enc_i[0][am[0]], rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(logits[i], model.decode(dec_in[i:i + 1], enc_i, am)[0], rtol=1e-4, atol=1e-4)
    print("forecast", tuple(forecast.shape), "median of series 0", [round(x, 2) for x in forecast[0].median(0).values.tolist()])


if __name__ == "__main__":
    main()
