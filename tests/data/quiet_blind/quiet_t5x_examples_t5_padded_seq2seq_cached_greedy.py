"""Correct program: t5x's example T5.1.1 encoder-decoder (t5x/examples/t5), ported from
Flax to torch and shrunk, trained on right-padded source/target batches and decoded
greedily with its autoregressive self-attention cache.

Project: google-research/t5x @247d329f4da9506c515a564a52ef385146784fb1
  t5x/examples/t5/layers.py: dot_product_attention, MultiHeadDotProductAttention (decode
    cache laid [batch, heads, head_dim, length], one-hot scatter at cache_index, the
    `arange(length) <= cur_index` mask, the relative bias sliced at cur_index, boolean mask
    turned into a 0 / -1e10 bias), MlpBlock, Embed, RelativePositionBiases, LayerNorm,
    make_attention_mask, make_causal_mask, combine_masks, combine_biases, make_decoder_mask;
  t5x/examples/t5/network.py @0ef03325e9aa58d5cb6aad92fdbdc02c44b23543: T5Config,
    EncoderLayer, DecoderLayer, Encoder, Decoder, Transformer.encode / decode / __call__;
  t5x/models.py EncoderDecoderModel (loss weighted by decoder_target_tokens > 0, cache made
    by a decode=True call over max_decode_length, _compute_logits_from_slice) and
    t5x/decoding.py temperature_sample (greedy here: argmax; ended rows emit 0).

Masks as the project builds them (0 is the pad id and also the decoder start token):
  encoder:   make_attention_mask(enc > 0, enc > 0);
  decoder:   make_decoder_mask(decoder_target_tokens) = causal AND target > 0 both sides;
  cross:     make_attention_mask(decoder_target_tokens > 0, enc > 0) when training, and
             make_attention_mask(ones_like(step tokens), enc > 0) when decoding;
  decoding:  no decoder_mask; the cache adds `arange(max_decode_length) <= cur_index`.
The cross-attention is not cached (t5x recomputes its key/value from `encoded` each step).

Checks (float64): the padded batch's loss and its logits at real target positions equal each
pair run alone without padding; the cached greedy decode of the padded batch equals, row by
row, an uncached greedy loop that reruns the whole decoder (decode=False) on one unpadded
source.
"""
import dataclasses
import functools
import math
import operator
from typing import Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.set_default_dtype(torch.float64)

PAD_ID = 0
EOS_ID = 1


@dataclasses.dataclass
class T5Config:
    """Global hyperparameters used to minimize obnoxious kwarg plumbing."""
    vocab_size: int
    emb_dim: int = 512
    num_heads: int = 8
    num_encoder_layers: int = 6
    num_decoder_layers: int = 6
    head_dim: int = 64
    mlp_dim: int = 2048
    mlp_activations: Sequence[str] = ('relu',)
    dropout_rate: float = 0.1
    logits_via_embedding: bool = False
    num_buckets: int = 32
    max_distance: int = 128


# ------------------------------------------------------------------------------
# layers.py
# ------------------------------------------------------------------------------
def dot_product_attention(query, key, value, bias=None):
    """query/key/value: [batch, length, num_heads, head_dim]."""
    attn_weights = torch.einsum('bqhd,bkhd->bhqk', query, key)
    if bias is not None:
        attn_weights = attn_weights + bias.to(attn_weights.dtype)
    attn_weights = torch.softmax(attn_weights, dim=-1)
    return torch.einsum('bhqk,bkhd->bqhd', attn_weights, value)


def make_attention_mask(query_input, key_input, pairwise_fn=torch.mul):
    # [batch, len_q, len_kv] -> [batch, 1, len_q, len_kv]
    mask = pairwise_fn(query_input.unsqueeze(-1), key_input.unsqueeze(-2))
    return mask.unsqueeze(-3).to(torch.get_default_dtype())


def make_causal_mask(x):
    idxs = torch.arange(x.shape[-1]).expand(x.shape)
    return make_attention_mask(idxs, idxs, torch.ge)


def combine_masks(*masks):
    masks = [m for m in masks if m is not None]
    if not masks:
        return None
    assert all(m.ndim == masks[0].ndim for m in masks)
    mask, *other_masks = masks
    for other_mask in other_masks:
        mask = torch.logical_and(mask, other_mask)
    return mask.to(torch.get_default_dtype())


def combine_biases(*masks):
    masks = [m for m in masks if m is not None]
    if not masks:
        return None
    mask, *other_masks = masks
    for other_mask in other_masks:
        mask = mask + other_mask
    return mask


def make_decoder_mask(decoder_target_tokens, decoder_segment_ids=None):
    masks = [make_causal_mask(decoder_target_tokens)]
    masks.append(make_attention_mask(decoder_target_tokens > 0, decoder_target_tokens > 0))
    if decoder_segment_ids is not None:
        masks.append(make_attention_mask(decoder_segment_ids, decoder_segment_ids, torch.eq))
    return combine_masks(*masks)


class LayerNorm(nn.Module):
    """T5 Layer normalization: no subtraction of mean, no bias."""

    def __init__(self, features, epsilon=1e-6):
        super().__init__()
        self.epsilon = epsilon
        self.scale = nn.Parameter(torch.ones(features))

    def forward(self, x):
        mean2 = x.pow(2).mean(-1, keepdim=True)
        return x * torch.rsqrt(mean2 + self.epsilon) * self.scale


class MlpBlock(nn.Module):
    def __init__(self, emb_dim, intermediate_dim, activations, dropout_rate):
        super().__init__()
        self.activations = activations
        names = ['wi'] if len(activations) == 1 else [f'wi_{i}' for i in range(len(activations))]
        self.wi = nn.ModuleDict({n: nn.Linear(emb_dim, intermediate_dim, bias=False) for n in names})
        self.dropout = nn.Dropout(dropout_rate)
        self.wo = nn.Linear(intermediate_dim, emb_dim, bias=False)

    def forward(self, inputs):
        acts = []
        for name, act_fn in zip(self.wi, self.activations):
            x = self.wi[name](inputs)
            acts.append(x if act_fn == 'linear' else getattr(F, act_fn)(x))
        x = functools.reduce(operator.mul, acts)
        return self.wo(self.dropout(x))


class RelativePositionBiases(nn.Module):
    def __init__(self, num_buckets, max_distance, num_heads):
        super().__init__()
        self.num_buckets = num_buckets
        self.max_distance = max_distance
        self.rel_embedding = nn.Parameter(torch.randn(num_heads, num_buckets) * 0.5)

    @staticmethod
    def _relative_position_bucket(relative_position, bidirectional=True, num_buckets=32,
                                  max_distance=128):
        ret = 0
        n = -relative_position
        if bidirectional:
            num_buckets //= 2
            ret += (n < 0).long() * num_buckets
            n = n.abs()
        else:
            n = n.clamp(min=0)
        max_exact = num_buckets // 2
        is_small = n < max_exact
        val_if_large = max_exact + (
            torch.log(n.float() / max_exact + torch.finfo(torch.float32).eps)
            / math.log(max_distance / max_exact) * (num_buckets - max_exact)).long()
        val_if_large = val_if_large.clamp(max=num_buckets - 1)
        return ret + torch.where(is_small, n, val_if_large)

    def forward(self, qlen, klen, bidirectional=True):
        context_position = torch.arange(qlen)[:, None]
        memory_position = torch.arange(klen)[None, :]
        relative_position = memory_position - context_position  # (qlen, klen)
        rp_bucket = self._relative_position_bucket(
            relative_position, bidirectional=bidirectional,
            num_buckets=self.num_buckets, max_distance=self.max_distance)
        values = self.rel_embedding[:, rp_bucket]  # (num_heads, qlen, klen)
        return values.unsqueeze(0)  # (1, num_heads, qlen, klen)


class MultiHeadDotProductAttention(nn.Module):
    def __init__(self, emb_dim, num_heads, head_dim):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, head_dim
        inner = num_heads * head_dim
        self.query = nn.Linear(emb_dim, inner, bias=False)
        self.key = nn.Linear(emb_dim, inner, bias=False)
        self.value = nn.Linear(emb_dim, inner, bias=False)
        self.out = nn.Linear(inner, emb_dim, bias=False)
        # T5 folds 1/sqrt(head_dim) into the query initializer.
        with torch.no_grad():
            self.query.weight.div_(math.sqrt(head_dim))

    def forward(self, inputs_q, inputs_kv, mask=None, bias=None, *, decode=False, cache=None):
        b = inputs_q.shape[0]
        query = self.query(inputs_q).view(b, -1, self.num_heads, self.head_dim)
        key = self.key(inputs_kv).view(b, -1, self.num_heads, self.head_dim)
        value = self.value(inputs_kv).view(b, -1, self.num_heads, self.head_dim)

        if decode:
            # cache: {'cached_key', 'cached_value': [batch, heads, head_dim, length],
            #         'cache_index': int}
            batch, num_heads, head_dim, length = cache['cached_key'].shape
            expected_shape = (batch, 1, num_heads, head_dim)
            if expected_shape != tuple(query.shape):
                raise ValueError('Autoregressive cache shape error, expected query shape '
                                 f'{expected_shape} instead got {tuple(query.shape)}.')
            cur_index = cache['cache_index']
            one_hot_indices = F.one_hot(torch.tensor(cur_index), length).to(key.dtype)
            one_token_key = torch.movedim(key, -3, -1)
            one_token_value = torch.movedim(value, -3, -1)
            key = cache['cached_key'] + one_token_key * one_hot_indices
            value = cache['cached_value'] + one_token_value * one_hot_indices
            cache['cached_key'] = key
            cache['cached_value'] = value
            cache['cache_index'] = cur_index + 1
            key = torch.movedim(key, -1, -3)
            value = torch.movedim(value, -1, -3)

            # Our single query position attends only to key positions already cached.
            mask = combine_masks(
                mask,
                (torch.arange(length) <= cur_index).expand(batch, 1, 1, length))

            if bias is not None:
                # bias[..., cur_index:cur_index+1, :]
                bias = bias[:, :, cur_index:cur_index + 1, :]

        if mask is not None:
            attention_bias = torch.where(mask > 0, torch.tensor(0.), torch.tensor(-1e10))
        else:
            attention_bias = None
        if bias is not None:
            attention_bias = combine_biases(attention_bias, bias)

        x = dot_product_attention(query, key, value, bias=attention_bias)
        return self.out(x.reshape(b, -1, self.num_heads * self.head_dim))


# ------------------------------------------------------------------------------
# network.py
# ------------------------------------------------------------------------------
class EncoderLayer(nn.Module):
    def __init__(self, cfg, relative_embedding):
        super().__init__()
        self.relative_embedding = [relative_embedding]  # shared, owned by Encoder
        self.pre_attention_layer_norm = LayerNorm(cfg.emb_dim)
        self.attention = MultiHeadDotProductAttention(cfg.emb_dim, cfg.num_heads, cfg.head_dim)
        self.pre_mlp_layer_norm = LayerNorm(cfg.emb_dim)
        self.mlp = MlpBlock(cfg.emb_dim, cfg.mlp_dim, cfg.mlp_activations, cfg.dropout_rate)
        self.dropout = nn.Dropout(cfg.dropout_rate)

    def forward(self, inputs, encoder_mask=None):
        encoder_bias = self.relative_embedding[0](inputs.shape[-2], inputs.shape[-2], True)
        x = self.pre_attention_layer_norm(inputs)
        x = self.attention(x, x, encoder_mask, encoder_bias)
        x = self.dropout(x) + inputs
        y = self.pre_mlp_layer_norm(x)
        y = self.mlp(y)
        return self.dropout(y) + x


class DecoderLayer(nn.Module):
    def __init__(self, cfg, relative_embedding):
        super().__init__()
        self.relative_embedding = [relative_embedding]
        self.pre_self_attention_layer_norm = LayerNorm(cfg.emb_dim)
        self.self_attention = MultiHeadDotProductAttention(cfg.emb_dim, cfg.num_heads, cfg.head_dim)
        self.pre_cross_attention_layer_norm = LayerNorm(cfg.emb_dim)
        self.encoder_decoder_attention = MultiHeadDotProductAttention(
            cfg.emb_dim, cfg.num_heads, cfg.head_dim)
        self.pre_mlp_layer_norm = LayerNorm(cfg.emb_dim)
        self.mlp = MlpBlock(cfg.emb_dim, cfg.mlp_dim, cfg.mlp_activations, cfg.dropout_rate)
        self.dropout = nn.Dropout(cfg.dropout_rate)

    def forward(self, inputs, encoded, decoder_mask=None, encoder_decoder_mask=None,
                decode=False, max_decode_length=None, cache=None):
        l = max_decode_length if decode and max_decode_length else inputs.shape[-2]
        decoder_bias = self.relative_embedding[0](l, l, False)

        x = self.pre_self_attention_layer_norm(inputs)
        x = self.self_attention(x, x, decoder_mask, decoder_bias, decode=decode, cache=cache)
        x = self.dropout(x) + inputs

        y = self.pre_cross_attention_layer_norm(x)
        y = self.encoder_decoder_attention(y, encoded, encoder_decoder_mask)
        y = self.dropout(y) + x

        z = self.pre_mlp_layer_norm(y)
        z = self.mlp(z)
        return self.dropout(z) + y


class Encoder(nn.Module):
    def __init__(self, cfg, shared_embedding):
        super().__init__()
        self.shared_embedding = [shared_embedding]
        self.relpos_bias = RelativePositionBiases(cfg.num_buckets, cfg.max_distance, cfg.num_heads)
        self.layers = nn.ModuleList(
            EncoderLayer(cfg, self.relpos_bias) for _ in range(cfg.num_encoder_layers))
        self.encoder_norm = LayerNorm(cfg.emb_dim)
        self.dropout = nn.Dropout(cfg.dropout_rate)

    def forward(self, encoder_input_tokens, encoder_mask=None):
        assert encoder_input_tokens.ndim == 2
        x = self.dropout(self.shared_embedding[0](encoder_input_tokens))
        for lyr in self.layers:
            x = lyr(x, encoder_mask)
        return self.dropout(self.encoder_norm(x))


class Decoder(nn.Module):
    def __init__(self, cfg, shared_embedding):
        super().__init__()
        self.cfg = cfg
        self.shared_embedding = [shared_embedding]
        self.relpos_bias = RelativePositionBiases(cfg.num_buckets, cfg.max_distance, cfg.num_heads)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, self.relpos_bias) for _ in range(cfg.num_decoder_layers))
        self.decoder_norm = LayerNorm(cfg.emb_dim)
        self.dropout = nn.Dropout(cfg.dropout_rate)
        self.logits_dense = nn.Linear(cfg.emb_dim, cfg.vocab_size, bias=False)

    def forward(self, encoded, decoder_input_tokens, decoder_mask=None,
                encoder_decoder_mask=None, decode=False, max_decode_length=None, cache=None):
        assert decoder_input_tokens.ndim == 2
        y = self.dropout(self.shared_embedding[0](decoder_input_tokens))
        for i, lyr in enumerate(self.layers):
            y = lyr(y, encoded, decoder_mask=decoder_mask,
                    encoder_decoder_mask=encoder_decoder_mask, decode=decode,
                    max_decode_length=max_decode_length,
                    cache=cache[f'layers_{i}'] if decode else None)
        y = self.dropout(self.decoder_norm(y))
        if self.cfg.logits_via_embedding:
            logits = y @ self.shared_embedding[0].weight.T
            return logits / math.sqrt(y.shape[-1])
        return self.logits_dense(y)


class Transformer(nn.Module):
    """An encoder-decoder Transformer model."""

    def __init__(self, cfg):
        super().__init__()
        self.config = cfg
        self.token_embedder = nn.Embedding(cfg.vocab_size, cfg.emb_dim)
        self.encoder = Encoder(cfg, self.token_embedder)
        self.decoder = Decoder(cfg, self.token_embedder)

    def encode(self, encoder_input_tokens, encoder_segment_ids=None):
        encoder_mask = make_attention_mask(encoder_input_tokens > 0, encoder_input_tokens > 0)
        if encoder_segment_ids is not None:
            encoder_mask = combine_masks(
                encoder_mask,
                make_attention_mask(encoder_segment_ids, encoder_segment_ids, torch.eq))
        return self.encoder(encoder_input_tokens, encoder_mask)

    def decode(self, encoded, encoder_input_tokens, decoder_input_tokens,
               decoder_target_tokens, encoder_segment_ids=None, decoder_segment_ids=None,
               decode=False, max_decode_length=None, cache=None):
        if decode:
            # Do not mask decoder attention based on targets padding at decoding time.
            decoder_mask = None
            encoder_decoder_mask = make_attention_mask(
                torch.ones_like(decoder_target_tokens), encoder_input_tokens > 0)
        else:
            decoder_mask = make_decoder_mask(decoder_target_tokens,
                                             decoder_segment_ids=decoder_segment_ids)
            encoder_decoder_mask = make_attention_mask(
                decoder_target_tokens > 0, encoder_input_tokens > 0)
        if encoder_segment_ids is not None:
            if decode:
                raise ValueError('During decoding, packing should not be used.')
            encoder_decoder_mask = combine_masks(
                encoder_decoder_mask,
                make_attention_mask(decoder_segment_ids, encoder_segment_ids, torch.eq))
        return self.decoder(encoded, decoder_input_tokens, decoder_mask=decoder_mask,
                            encoder_decoder_mask=encoder_decoder_mask, decode=decode,
                            max_decode_length=max_decode_length, cache=cache)

    def forward(self, encoder_input_tokens, decoder_input_tokens, decoder_target_tokens):
        encoded = self.encode(encoder_input_tokens)
        return self.decode(encoded, encoder_input_tokens, decoder_input_tokens,
                           decoder_target_tokens)

    def init_cache(self, batch, max_decode_length):
        """What t5x's decode=True init call leaves in the 'cache' collection: zeros."""
        cfg = self.config
        shape = (batch, cfg.num_heads, cfg.head_dim, max_decode_length)
        return {f'layers_{i}': {'cached_key': torch.zeros(shape),
                                'cached_value': torch.zeros(shape),
                                'cache_index': 0}
                for i in range(cfg.num_decoder_layers)}


# ------------------------------------------------------------------------------
# models.py / decoding.py
# ------------------------------------------------------------------------------
def shift_right(x):
    """t5x's default: targets shifted right, 0 (the pad id) as the start token."""
    return F.pad(x, (1, 0))[:, :-1]


def loss_fn(model, batch):
    logits = model(batch['encoder_input_tokens'], batch['decoder_input_tokens'],
                   batch['decoder_target_tokens'])
    weights = batch['decoder_loss_weights']
    token_loss = F.cross_entropy(logits.transpose(1, 2), batch['decoder_target_tokens'],
                                 reduction='none')
    return (token_loss * weights).sum() / weights.sum(), logits


@torch.no_grad()
def predict_batch(model, encoder_input_tokens, max_decode_length):
    """EncoderDecoderModel.predict_batch_with_aux with temperature_sample at topk=1."""
    encoded_inputs = model.encode(encoder_input_tokens)
    batch = encoder_input_tokens.shape[0]
    cache = model.init_cache(batch, max_decode_length)

    def tokens_ids_to_logits(flat_ids, flat_cache):
        flat_logits = model.decode(encoded_inputs, encoder_input_tokens, flat_ids, flat_ids,
                                   decode=True, max_decode_length=max_decode_length,
                                   cache=flat_cache)
        return flat_logits.squeeze(1), flat_cache

    sequences = torch.zeros(batch, max_decode_length + 1, dtype=torch.long)
    ended = torch.zeros(batch, 1, dtype=torch.bool)
    for i in range(max_decode_length):
        if bool(ended.all()):
            break
        cur_token = sequences[:, i:i + 1]
        logits, cache = tokens_ids_to_logits(cur_token, cache)
        next_token = logits.argmax(-1, keepdim=True)
        # If end-marker reached for batch item, only emit padding tokens.
        next_token_or_endpad = next_token * ~ended
        ended |= next_token_or_endpad == EOS_ID
        sequences[:, i + 1:i + 2] = next_token_or_endpad
    return sequences[:, 1:]


@torch.no_grad()
def greedy_uncached(model, src, max_decode_length):
    """Reference: one unpadded source, the whole decoder rerun on the prefix each step."""
    encoder_input_tokens = torch.tensor([src])
    encoded = model.encode(encoder_input_tokens)
    out = [PAD_ID]
    for _ in range(max_decode_length):
        dec_in = torch.tensor([out])
        # Every position of the prefix is a real token: targets all nonzero.
        logits = model.decode(encoded, encoder_input_tokens, dec_in, torch.ones_like(dec_in))
        tok = int(logits[0, -1].argmax())
        out.append(tok)
        if tok == EOS_ID:
            break
    seq = out[1:]
    return seq + [PAD_ID] * (max_decode_length - len(seq))


def pad_batch(seqs):
    width = max(len(s) for s in seqs)
    return torch.tensor([s + [PAD_ID] * (width - len(s)) for s in seqs])


def make_examples(gen, n):
    """Reverse the source tokens (ids 2..vocab-1), then EOS."""
    pairs = []
    for _ in range(n):
        length = int(torch.randint(2, 8, (1,), generator=gen))
        src = torch.randint(2, VOCAB, (length,), generator=gen).tolist()
        pairs.append((src + [EOS_ID], src[::-1] + [EOS_ID]))
    return pairs


def collate(pairs):
    enc = pad_batch([s for s, _ in pairs])
    tgt = pad_batch([t for _, t in pairs])
    return {'encoder_input_tokens': enc,
            'decoder_input_tokens': shift_right(tgt),
            'decoder_target_tokens': tgt,
            'decoder_loss_weights': (tgt > 0).to(torch.get_default_dtype())}


VOCAB = 12


def main():
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    cfg = T5Config(vocab_size=VOCAB, emb_dim=32, num_heads=4, num_encoder_layers=2,
                   num_decoder_layers=2, head_dim=8, mlp_dim=64,
                   mlp_activations=('gelu', 'linear'), dropout_rate=0.0,
                   num_buckets=8, max_distance=16)
    model = Transformer(cfg)
    opt = torch.optim.Adam(model.parameters(), lr=5e-3)
    for step in range(60):
        loss, _ = loss_fn(model, collate(make_examples(gen, 16)))
        opt.zero_grad()
        loss.backward()
        opt.step()
    print(f'train loss after 60 steps: {loss.item():.4f}')
    model.eval()

    # 1. Teacher forcing: padded batch == each pair alone, unpadded.
    pairs = make_examples(gen, 6)
    batch = collate(pairs)
    with torch.no_grad():
        loss, logits = loss_fn(model, batch)
        ref_losses, worst = [], 0.0
        for i, (src, tgt) in enumerate(pairs):
            one = collate([(src, tgt)])
            l1, lg1 = loss_fn(model, one)
            ref_losses.append(l1 * len(tgt))
            worst = max(worst, (logits[i, :len(tgt)] - lg1[0]).abs().max().item())
        ref_loss = sum(ref_losses) / sum(len(t) for _, t in pairs)
    assert worst < 1e-9, worst
    assert abs(loss.item() - ref_loss.item()) < 1e-10, (loss.item(), ref_loss.item())
    print(f'teacher-forced: loss {loss.item():.6f} == per-pair {ref_loss.item():.6f}, '
          f'max logit diff {worst:.2e}')

    # 2. Cached greedy decode of the padded batch == uncached per-source greedy.
    max_decode_length = 10
    decodes = predict_batch(model, batch['encoder_input_tokens'], max_decode_length)
    n_exact = 0
    for i, (src, tgt) in enumerate(pairs):
        ref = greedy_uncached(model, src, max_decode_length)
        got = decodes[i].tolist()
        assert got == ref, (i, got, ref)
        n_exact += got[:len(tgt)] == tgt
        print(f'  src {src} -> {got}')
    print(f'cached greedy == uncached per-source greedy for {len(pairs)} rows '
          f'({n_exact} exact reversals)')


if __name__ == '__main__':
    main()
