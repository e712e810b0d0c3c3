# Citation: massquantity/LibRecommender commit 6b235c0 ("[Fix] Modify attention dynamic shapes", PR #359),
#   bug state read at 6b235c0^ (libreco/layers/attention.py, libreco/layers/transformer.py,
#   libreco/layers/normalization.py, libreco/layers/activation.py), fix read at 6b235c0.
# Upstream: libreco/layers/attention.py multi_head_attention(), compute_seq_mask(), compute_causal_mask();
#   libreco/layers/transformer.py transformer_encoder_layer(), transformer_decoder_layer().
# Bug: on the TF >= 2.10 path multi_head_attention() built tf.keras.layers.MultiHeadAttention and called
#   `att_layer(queries, keys)`: the `attention_mask` that transformer_encoder_layer / transformer_decoder_layer
#   built from the behaviour sequences' lengths (sequence mask, and sequence & causal mask in the decoder) was
#   never handed to the layer, so every user history attended its padding slots and (in the decoder) the
#   items after each position.
# Fix: `att_layer(queries, keys, attention_mask=mask)` (the same commit also made the projections bias-free;
#   Keras initialises biases to zero, so that part does not change an untrained forward).
# Ported from TF1-graph / Keras to plain torch at tiny sizes: tf.get_variable -> a small variable store,
#   tf.keras.layers.MultiHeadAttention -> KerasMultiHeadAttention (EinsumDense kernels (E, H, D), query scaled
#   by 1/sqrt(D), Keras Softmax with mask: scores += (1 - mask) * -1e9).
import math
import sys

import numpy as np
import torch

FIXED = "--fixed" in sys.argv
TF_VERSION = "2.12.0"

torch.manual_seed(0)


class VariableStore:
    """Stands in for tf.get_variable under tf.variable_scope: variables are created in call order."""

    def __init__(self):
        self.vars = {}
        self.scopes = []

    def get(self, name, shape, init):
        full = "/".join(self.scopes + [name])
        if full not in self.vars:
            self.vars[full] = init(shape)
        return self.vars[full]


VS = VariableStore()
_LAYER_COUNT = [0]


def glorot_uniform(shape, fan_in, fan_out):
    limit = math.sqrt(6.0 / (fan_in + fan_out))
    return (torch.rand(shape) * 2 - 1) * limit


class variable_scope:
    def __init__(self, name):
        self.name = name

    def __enter__(self):
        VS.scopes.append(self.name)

    def __exit__(self, *a):
        VS.scopes.pop()


def _unique(name):
    _LAYER_COUNT[0] += 1
    return f"{name}_{_LAYER_COUNT[0]}"


def gelu(x):
    return 0.5 * x * (1.0 + torch.erf(x / 1.4142135623730951))


class tf_dense:
    def __init__(self, units, activation=None, use_bias=True, name=None):
        self.units = units
        self.activation = activation
        self.use_bias = use_bias
        self.name = _unique(name or "dense")

    def __call__(self, x):
        d = x.shape[-1]
        kernel = VS.get(self.name + "/kernel", (d, self.units),
                        lambda s: glorot_uniform(s, d, self.units))
        out = x @ kernel
        if self.use_bias:
            out = out + VS.get(self.name + "/bias", (self.units,), torch.zeros)
        if self.activation is not None:
            out = self.activation(out)
        return out


def layer_normalization(inputs, reuse_layer=False, scope_name="layer_norm"):
    with variable_scope(scope_name):
        dim = inputs.shape[-1]
        scale = VS.get("scale", (dim,), torch.ones)
        bias = VS.get("bias", (dim,), torch.zeros)
        mean = inputs.mean(dim=-1, keepdim=True)
        variance = ((inputs - mean) ** 2).mean(dim=-1, keepdim=True)
        outputs = (inputs - mean) * torch.rsqrt(variance + 1e-8)
        return outputs * scale + bias


class KerasMultiHeadAttention:
    """tf.keras.layers.MultiHeadAttention(num_heads, key_dim, use_bias, output_shape), self/cross attention."""

    def __init__(self, num_heads, key_dim, use_bias=True, output_shape=None):
        self.num_heads = num_heads
        self.key_dim = key_dim
        self.use_bias = use_bias
        self.output_shape = output_shape
        self.name = _unique("multi_head_attention")

    def _proj(self, x, which):
        e = x.shape[-1]
        h, d = self.num_heads, self.key_dim
        kernel = VS.get(f"{self.name}/{which}/kernel", (e, h, d),
                        lambda s: glorot_uniform(s, e, h * d))
        out = torch.einsum("abc,cde->abde", x, kernel)
        if self.use_bias:
            out = out + VS.get(f"{self.name}/{which}/bias", (h, d), torch.zeros)
        return out

    def _masked_softmax(self, scores, attention_mask=None):
        # keras.layers.Softmax: inputs += (1.0 - cast(mask)) * _large_compatible_negative(float32) (= -1e9)
        if attention_mask is not None:
            mask = attention_mask
            for _ in range(scores.dim() - mask.dim()):
                mask = mask.unsqueeze(-3)
            scores = scores + (1.0 - mask.to(scores.dtype)) * -1e9
        return torch.softmax(scores, dim=-1)

    def __call__(self, query, value, key=None, attention_mask=None):
        if key is None:
            key = value
        q = self._proj(query, "query")
        k = self._proj(key, "key")
        v = self._proj(value, "value")
        q = q * (1.0 / math.sqrt(float(self.key_dim)))
        scores = torch.einsum("aecd,abcd->acbe", k, q)  # (B, H, Tq, Tk)
        probs = self._masked_softmax(scores, attention_mask)
        ctx = torch.einsum("acbe,aecd->abcd", probs, v)  # (B, Tq, H, D)
        out_dim = self.output_shape or query.shape[-1]
        kernel = VS.get(f"{self.name}/attention_output/kernel", (self.num_heads, self.key_dim, out_dim),
                        lambda s: glorot_uniform(s, self.num_heads * self.key_dim, out_dim))
        out = torch.einsum("abcd,cde->abe", ctx, kernel)
        if self.use_bias:
            out = out + VS.get(f"{self.name}/attention_output/bias", (out_dim,), torch.zeros)
        return out


def multi_head_attention(queries, keys, num_heads, head_dim, mask=None, output_dim=None, version=None):
    tf_version = version or TF_VERSION
    if FIXED:
        if output_dim is None:
            output_dim = queries.shape[-1]
        if tf_version >= "2.10.0":
            att_layer = KerasMultiHeadAttention(num_heads, head_dim, use_bias=False, output_shape=output_dim)
            return att_layer(queries, keys, attention_mask=mask)
    else:
        if tf_version >= "2.10.0":
            att_layer = KerasMultiHeadAttention(num_heads, head_dim)
            return att_layer(queries, keys)

    # TF < 2.10 path (not taken here)
    raise RuntimeError("tf < 2.10 path")


def sequence_mask(lengths, maxlen):
    return torch.arange(maxlen)[None, :] < lengths[:, None]


def compute_seq_mask(key_lens, max_key_len, num_heads, query_len=None):
    if query_len is None:
        query_len = max_key_len
    # B * 1 * 1 * Tk
    seq_mask = sequence_mask(key_lens, max_key_len)[:, None, None, :]
    return seq_mask.repeat(1, num_heads, query_len, 1)


def compute_causal_mask(batch_size, seq_len, num_heads):
    inputs = torch.ones((seq_len, seq_len), dtype=torch.bool)
    causal_mask = torch.tril(inputs)[None, None, :, :]  # tf.linalg.band_part(inputs, -1, 0)
    return causal_mask.repeat(batch_size, num_heads, 1, 1)


def positional_encoding(seq_len, d_model, trainable=False, scope_name="transformer"):
    pos = np.arange(seq_len)[:, np.newaxis]
    dim = np.arange(d_model) / d_model
    dim[1::2] = dim[0::2] if d_model % 2 == 0 else dim[0::2][:-1]
    dim = dim[np.newaxis, :]
    pe = pos / (10000 ** dim)
    pe[:, 0::2] = np.sin(pe[:, 0::2])
    pe[:, 1::2] = np.cos(pe[:, 1::2])
    with variable_scope(scope_name):
        return VS.get("positional_encoding", (seq_len, d_model),
                      lambda s: torch.tensor(pe, dtype=torch.float32))


def ffn(inputs, output_dim):
    use_bias = not FIXED
    outputs = tf_dense(output_dim * 4, activation=gelu, use_bias=use_bias, name="ffn_1")(inputs)
    outputs = tf_dense(output_dim, use_bias=use_bias, name="ffn_2")(outputs)
    return outputs


def transformer_encoder_layer(seqs, seq_lens, max_seq_len, num_heads, head_dim, embed_size):
    with variable_scope("transformer_encoder"):
        att_mask = compute_seq_mask(seq_lens, max_seq_len, num_heads)

        pe = positional_encoding(max_seq_len, embed_size)[None, :, :]
        scaling_factor = math.sqrt(float(embed_size))
        att_inputs = seqs * scaling_factor + pe
        att_outputs = multi_head_attention(att_inputs, att_inputs, num_heads, head_dim, att_mask)
        att_outputs = att_inputs + att_outputs
        att_outputs = layer_normalization(att_outputs, scope_name="ln_att")

        ffn_inputs = att_outputs
        ffn_outputs = ffn(ffn_inputs, embed_size)
        ffn_outputs = ffn_inputs + ffn_outputs
        ffn_outputs = layer_normalization(ffn_outputs, scope_name="ln_ffn")
        return ffn_outputs


def transformer_decoder_layer(encoder_out, seqs, seq_lens, max_seq_len, num_heads, head_dim, embed_size):
    with variable_scope("transformer_decoder"):
        seq_mask = compute_seq_mask(seq_lens, max_seq_len, num_heads)
        causal_mask = compute_causal_mask(seqs.shape[0], max_seq_len, num_heads)
        att_mask = seq_mask & causal_mask

        pe = positional_encoding(max_seq_len, embed_size)[None, :, :]
        scaling_factor = math.sqrt(float(embed_size))
        cau_att_inputs = seqs * scaling_factor + pe
        cau_att_outputs = multi_head_attention(cau_att_inputs, cau_att_inputs, num_heads, head_dim, att_mask)
        cau_att_outputs = cau_att_inputs + cau_att_outputs
        cau_att_outputs = layer_normalization(cau_att_outputs, scope_name="ln_cau_att")

        enc_att_inputs = cau_att_outputs
        enc_att_outputs = multi_head_attention(enc_att_inputs, encoder_out, num_heads, head_dim, seq_mask)
        enc_att_outputs = enc_att_inputs + enc_att_outputs
        enc_att_outputs = layer_normalization(enc_att_outputs, scope_name="ln_enc_att")

        ffn_inputs = enc_att_outputs
        ffn_outputs = ffn(ffn_inputs, embed_size)
        ffn_outputs = ffn_inputs + ffn_outputs
        ffn_outputs = layer_normalization(ffn_outputs, scope_name="ln_ffn")
        return ffn_outputs


def main():
    n_items, embed_size, num_heads, max_seq_len = 30, 16, 2, 6
    head_dim = embed_size // num_heads
    item_embeds = glorot_uniform((n_items + 1, embed_size), n_items + 1, embed_size)

    # user behaviour sequences, right-padded with the pad index n_items (LibRecommender's get_recent_seqs
    # fills the sequence from the left and pads the rest)
    histories = [[3, 7, 12, 5, 9, 21], [4, 18, 2], [11, 6, 25, 14], [8]]
    pad_index = n_items
    seqs_ids = torch.full((len(histories), max_seq_len), pad_index, dtype=torch.long)
    for i, h in enumerate(histories):
        seqs_ids[i, : len(h)] = torch.tensor(h)
    seq_lens = torch.tensor([len(h) for h in histories], dtype=torch.int32)
    item_embeds[pad_index] = 0.0  # padding row

    seqs = item_embeds[seqs_ids]
    enc_out = transformer_encoder_layer(seqs, seq_lens, max_seq_len, num_heads, head_dim, embed_size)
    dec_out = transformer_decoder_layer(enc_out, seqs, seq_lens, max_seq_len, num_heads, head_dim, embed_size)

    # next-item scores from each user's last real position
    last = dec_out[torch.arange(len(histories)), seq_lens.long() - 1]
    targets = torch.tensor([17, 1, 29, 13])
    logits = last @ item_embeds[:n_items].T
    loss = torch.nn.functional.cross_entropy(logits, targets)
    print("fixed" if FIXED else "buggy", "| tf path", TF_VERSION)
    print("decoder out[:, last] norms:", [round(v, 4) for v in last.norm(dim=-1).tolist()])
    print("target scores:", [round(v, 4) for v in logits[torch.arange(4), targets].tolist()])
    print("top-1 items:", logits.argmax(-1).tolist())
    print("next-item CE loss: %.6f" % loss.item())


if __name__ == "__main__":
    main()
