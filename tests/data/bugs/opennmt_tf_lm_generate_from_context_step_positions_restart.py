"""OpenNMT-tf language model: generating from a context numbers the generated tokens from position 1.

Citation: OpenNMT/OpenNMT-tf#498 (commit f9929de6, "Add offset to step when generating from context with
language model"), opennmt/models/language_model.py LanguageModel._call, with the decoder of
opennmt/decoders/self_attention_decoder.py (SelfAttentionDecoderV2._run: position_encoder(inputs,
position=step + 1), keys / values cached per layer) and opennmt/layers/position.py (SinusoidalPositionEncoder).
Ported from TensorFlow to torch, names and layout kept.

The model runs the decoder once over the context (positions 1..C, future mask) to fill the cache, then calls
decoding.dynamic_decode(self._decode, start_ids, initial_state=state), whose step counter starts at 0, so the
start token is encoded at position 1 and each generated token C positions too early, while the cached keys of
the context sit at 1..C. The fix decodes with `step + context_length[0]`.
"""
import math
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


class SinusoidalPositionEncoder(nn.Module):
    def forward(self, inputs, position=None):
        batch_size, timesteps, depth = inputs.shape
        if position is None:
            positions = torch.arange(timesteps) + 1
        else:
            positions = torch.full((timesteps,), position) + torch.arange(timesteps)
        log_timescale_increment = math.log(10000) / (depth / 2 - 1)
        inv_timescales = torch.exp(torch.arange(depth // 2).float() * -log_timescale_increment)
        scaled_time = positions.float().unsqueeze(1) * inv_timescales.unsqueeze(0)
        encoding = torch.cat([torch.sin(scaled_time), torch.cos(scaled_time)], dim=1)
        inputs = inputs * depth ** 0.5
        return inputs + encoding.unsqueeze(0)


def build_future_mask(sequence_length, maximum_length=None):
    # opennmt/layers/transformer.py: 1.0 = may attend.
    maximum_length = maximum_length or int(sequence_length.max())
    sequence_mask = (torch.arange(maximum_length)[None, :] < sequence_length[:, None]).float()
    mask = torch.tril(torch.ones(maximum_length, maximum_length))
    mask = mask.unsqueeze(0) * sequence_mask.unsqueeze(1)
    return mask


class MultiHeadAttention(nn.Module):
    def __init__(self, num_heads, num_units):
        super().__init__()
        self.num_heads = num_heads
        self.linear_queries = nn.Linear(num_units, num_units)
        self.linear_keys = nn.Linear(num_units, num_units)
        self.linear_values = nn.Linear(num_units, num_units)
        self.linear_output = nn.Linear(num_units, num_units)

    def split_heads(self, x):
        b, t, d = x.shape
        return x.view(b, t, self.num_heads, d // self.num_heads).transpose(1, 2)

    def forward(self, inputs, mask=None, cache=None):
        queries = self.split_heads(self.linear_queries(inputs))
        keys = self.split_heads(self.linear_keys(inputs))
        values = self.split_heads(self.linear_values(inputs))
        if cache is not None:
            if cache["keys"] is not None:
                keys = torch.cat([cache["keys"], keys], dim=2)
                values = torch.cat([cache["values"], values], dim=2)
            cache = dict(keys=keys, values=values)
        queries = queries * (queries.shape[-1] ** -0.5)
        dot = torch.matmul(queries, keys.transpose(2, 3))
        if mask is not None:
            mask = mask.unsqueeze(1)
            dot = dot * mask + ((1.0 - mask) * torch.finfo(dot.dtype).min)
        attn = F.softmax(dot, dim=-1)
        heads = torch.matmul(attn, values)
        b, h, t, d = heads.shape
        combined = heads.transpose(1, 2).reshape(b, t, h * d)
        return self.linear_output(combined), cache


class SelfAttentionDecoderLayer(nn.Module):
    def __init__(self, num_units, num_heads, ffn_inner_dim):
        super().__init__()
        self.self_attention_norm = nn.LayerNorm(num_units)
        self.self_attention = MultiHeadAttention(num_heads, num_units)
        self.ffn_norm = nn.LayerNorm(num_units)
        self.ffn = nn.Sequential(nn.Linear(num_units, ffn_inner_dim), nn.ReLU(), nn.Linear(ffn_inner_dim, num_units))

    def forward(self, inputs, mask=None, cache=None):
        y, cache = self.self_attention(self.self_attention_norm(inputs), mask=mask, cache=cache)
        x = inputs + y
        x = x + self.ffn(self.ffn_norm(x))
        return x, cache


class SelfAttentionDecoderV2(nn.Module):
    def __init__(self, num_layers, num_units=32, num_heads=4, ffn_inner_dim=64, vocab_size=50):
        super().__init__()
        self.position_encoder = SinusoidalPositionEncoder()
        self.layers = nn.ModuleList(
            [SelfAttentionDecoderLayer(num_units, num_heads, ffn_inner_dim) for _ in range(num_layers)])
        self.layer_norm = nn.LayerNorm(num_units)
        self.output_layer = nn.Linear(num_units, vocab_size)

    def get_initial_state(self, batch_size):
        return [dict(keys=None, values=None) for _ in self.layers]

    def _run(self, inputs, sequence_length=None, cache=None, step=None):
        if self.position_encoder is not None:
            inputs = self.position_encoder(inputs, position=step + 1 if step is not None else None)
        mask = None
        if sequence_length is not None:
            mask = build_future_mask(sequence_length, maximum_length=inputs.shape[1])
        new_cache = []
        for i, layer in enumerate(self.layers):
            inputs, layer_cache = layer(inputs, mask=mask, cache=cache[i] if cache is not None else None)
            new_cache.append(layer_cache)
        outputs = self.layer_norm(inputs)
        return outputs, new_cache

    def forward(self, inputs, length_or_step=None, state=None):
        if isinstance(length_or_step, int):
            # Single step decoding.
            outputs, state = self._run(inputs, cache=state, step=length_or_step)
        else:
            # Full sequence (the context): start from an empty cache so it is filled.
            cache = state if state is not None else self.get_initial_state(inputs.shape[0])
            outputs, state = self._run(inputs, sequence_length=length_or_step, cache=cache)
        return self.output_layer(outputs), state


def dynamic_decode(symbols_to_logits_fn, start_ids, initial_state, maximum_iterations):
    # opennmt/utils/decoding.py with BestSampler: the step counter starts at 0.
    ids = start_ids
    state = initial_state
    sampled = []
    for step in range(maximum_iterations):
        logits, state = symbols_to_logits_fn(ids.unsqueeze(1), step, state)
        ids = logits[:, -1].argmax(-1)
        sampled.append(ids)
    return torch.stack(sampled, dim=1)


class LanguageModel(nn.Module):
    def __init__(self, decoder, vocab_size=50, embedding_size=32):
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, embedding_size)
        self.decoder = decoder

    def _decode(self, ids, length_or_step, state=None):
        inputs = self.embedding(ids)
        logits, state = self.decoder(inputs, length_or_step, state=state)
        return logits, state

    def generate(self, ids, length, maximum_iterations=6):
        # Run decoder on the context, if any.
        context_ids, start_ids = ids[:, :-1], ids[:, -1:]
        context_length = length - 1
        batch_size = context_length.shape[0]
        if int(context_length.sum()) == 0:
            state = self.decoder.get_initial_state(batch_size)
        else:
            state = self._decode(context_ids, context_length)[1]

        if FIXED:
            def _decode_with_step_offset(ids, step, state):
                return self._decode(ids, step + int(context_length[0]), state)
            decode_fn = _decode_with_step_offset
        else:
            decode_fn = self._decode

        # Iteratively decode from the last decoder state.
        sampled_ids = dynamic_decode(decode_fn, start_ids.squeeze(1), state, maximum_iterations)
        return torch.cat([ids, sampled_ids], 1)


def main():
    torch.manual_seed(0)
    vocab_size = 50
    model = LanguageModel(SelfAttentionDecoderV2(num_layers=2, vocab_size=vocab_size), vocab_size=vocab_size)
    model.eval()
    # Fixed-length contexts (bucket_width=1 in auto_config), last token is the start token.
    ids = torch.randint(4, vocab_size, (2, 9))
    length = torch.full((2,), 9)
    with torch.no_grad():
        full_ids = model.generate(ids, length)
        # Next-token logits at the start token, from the cached decode.
        context_ids, start_ids = ids[:, :-1], ids[:, -1:]
        state = model._decode(context_ids, length - 1)[1]
        offset = int(length[0] - 1) if FIXED else 0
        step_logits, _ = model._decode(start_ids, 0 + offset, state)
    print("generated:", full_ids[:, ids.shape[1]:].tolist())
    print("start-token logits[0, :5]:", [round(v, 4) for v in step_logits[0, -1, :5].tolist()])


if __name__ == "__main__":
    main()
