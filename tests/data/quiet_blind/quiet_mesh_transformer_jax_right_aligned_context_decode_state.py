"""Correct program (quiet batch quiet-r78a).

Ported from kingoflolz/mesh-transformer-jax @f8315e3003033b23f21d78361b288953064e0e76:
mesh_transformer/layers.py (fixed_pos_embedding, rotate_every_two, apply_rotary_pos_emb, EmbeddingShard,
TransformerLayerShard.self_attn / __call__ / decode_once / get_init_decode_state, ProjectionShard),
mesh_transformer/transformer_shard.py (CausalTransformerShard.generate_initial / generate_once,
CausalTransformer.generate's generate_sample scan) and device_serve.py (each context left-padded with 0 to
config["seq"], `length = len(tokens)`).  JAX / haiku ported to torch: the xmap batch axis is a leading batch dim,
the one shard does no psum, jax.lax.scan is a Python loop, the sampler is greedy.

The GPT-J style decoder takes right-aligned contexts: `get_init_decode_state` masks the causal future and the
`full_length - given_length` pad columns before the context starts (-1e10 biases), keeps the raw (unrotated) k / v
of the whole buffer, and `decode_once` appends one k / v, drops the oldest slot (`[1:]`) and masks the
`length - tokens_decoded` leftmost slots.  Rotary (on the first pe_rotary_dims dims) is applied to the buffer's
slot numbers at each call, so only distances matter.

Self-check: greedy generation for three left-padded contexts equals, token by token and logit by logit, an
unmasked, uncached per-context run (plain causal forward over the context and the tokens generated so far).
"""
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)

config = {
    "layers": 2,
    "d_model": 32,
    "n_heads": 4,
    "n_vocab": 64,
    "norm": "layernorm",
    "pe": "rotary",
    "pe_rotary_dims": 4,
    "seq": 16,
    "cores_per_replica": 1,
}


def fixed_pos_embedding(x, seq_dim=1):
    dim = x.shape[-1]
    inv_freq = 1. / (10000 ** (np.arange(0, dim, 2) / dim))

    sinusoid_inp = np.einsum('i , j -> i j', np.arange(x.shape[seq_dim]), inv_freq)

    return (torch.tensor(np.sin(sinusoid_inp), dtype=x.dtype),
            torch.tensor(np.cos(sinusoid_inp), dtype=x.dtype))


def rotate_every_two(x):
    x1 = x[..., ::2]
    x2 = x[..., 1::2]

    x = torch.stack((-x2, x1), dim=-1)

    return x.flatten(-2)  # '... d j -> ... (d j)'


def apply_rotary_pos_emb(x, sincos):
    # x: (batch, t, heads, rot); 'b n -> b (n j)', j=2, then the last t rows
    sin, cos = map(lambda t: t.repeat_interleave(2, dim=-1)[-x.shape[1]:, None, :], sincos)
    return (x * cos) + (rotate_every_two(x) * sin)


def getnorm(type):
    if type == "layernorm":
        return nn.LayerNorm(config["d_model"])
    raise Exception("Not implemented")


class EmbeddingShard(nn.Module):
    def __init__(self, config):
        super().__init__()
        in_dim = config["n_vocab"]
        out_dim = config["d_model"]
        shards = config["cores_per_replica"]

        assert in_dim % shards == 0

        self.in_dim = in_dim
        self.out_dim = out_dim
        self.in_dim_per_shard = in_dim // shards
        self.out_dim_per_shard = out_dim // shards

        # config["pe"] == "rotary": no learned positional embeddings
        self.positional_embeddings = None

        self.proj = nn.Linear(self.in_dim_per_shard, self.out_dim)
        nn.init.trunc_normal_(self.proj.weight, std=1 / np.sqrt(in_dim))

    def forward(self, x):
        shard_start_index = 0
        input_onehot = F.one_hot(x - shard_start_index, self.in_dim_per_shard).float()
        proj_out = self.proj(input_onehot)
        return proj_out


# We actually combine the FF and dense in one layer (i.e. compute in parallel) to minimize all reduces
class TransformerLayerShard(nn.Module):
    def __init__(self, config, init_scale=1.):
        super().__init__()
        heads = config["n_heads"]
        dim = config["d_model"]
        shards = config["cores_per_replica"]
        self.is_rotary = config["pe"] == "rotary"

        assert dim % heads == 0
        assert heads % shards == 0

        self.dim = dim
        self.dim_per_head = dim // heads
        self.heads_per_shard = heads // shards
        self.dim_per_shard = dim // shards
        self.pe_rotary_dims = config.get("pe_rotary_dims", self.dim_per_head)

        self.norm = getnorm(config["norm"])

        self.q = nn.Linear(dim, self.dim_per_shard, bias=False)
        self.v = nn.Linear(dim, self.dim_per_shard, bias=False)
        self.k = nn.Linear(dim, self.dim_per_shard, bias=False)

        self.o = nn.Linear(self.dim_per_shard, self.dim, bias=False)
        nn.init.trunc_normal_(self.o.weight, std=init_scale / np.sqrt(self.dim))

        self.dense_proj = nn.Linear(dim, self.dim_per_shard * 4)
        self.dense_proj_o = nn.Linear(self.dim_per_shard * 4, self.dim)
        nn.init.trunc_normal_(self.dense_proj_o.weight, std=init_scale / np.sqrt(self.dim))

    def self_attn(self, q, v, k, attn_bias):
        if self.is_rotary:
            k_rot = k[..., :self.pe_rotary_dims]
            k_pass = k[..., self.pe_rotary_dims:]

            q_rot = q[..., :self.pe_rotary_dims]
            q_pass = q[..., self.pe_rotary_dims:]

            sincos = fixed_pos_embedding(k_rot)
            q_rot = apply_rotary_pos_emb(q_rot, sincos)
            k_rot = apply_rotary_pos_emb(k_rot, sincos)

            k = torch.cat([k_rot, k_pass], dim=-1)
            q = torch.cat([q_rot, q_pass], dim=-1)

        attention_logits = torch.einsum("bthd,bThd->bhtT", q, k)

        sqrt_key_size = np.sqrt(self.dim_per_head).astype(np.float32)
        attention_logits = attention_logits / float(sqrt_key_size)

        attention_logits = attention_logits + attn_bias

        attention_weights = torch.softmax(attention_logits, dim=-1)
        attention_vec = torch.einsum("bhtT,bThd->bthd", attention_weights, v)
        attention_vec = attention_vec.reshape(attention_vec.shape[0], -1, self.dim_per_shard)

        return self.o(attention_vec)

    def ff(self, x):
        dense_proj = self.dense_proj(x)
        dense_proj = F.gelu(dense_proj)
        return self.dense_proj_o(dense_proj)

    def qvk_proj(self, x):
        shape = x.shape[:-1] + (self.heads_per_shard, self.dim_per_head)
        q = self.q(x).reshape(shape)
        v = self.v(x).reshape(shape)
        k = self.k(x).reshape(shape)

        return q, v, k

    def forward(self, x, attn_bias):
        x = self.norm(x)

        q, v, k = self.qvk_proj(x)

        seq_len = x.shape[1]
        causal_mask = torch.tril(torch.ones((seq_len, seq_len)))
        bias = -1e10 * (1. - causal_mask)
        bias = bias + attn_bias

        attn_out = self.self_attn(q, v, k, bias)
        dense_out = self.ff(x)

        return attn_out + dense_out

    # iterate the decoding process by a single token
    def decode_once(self, decode_state, x, attn_bias):
        x = self.norm(x)

        assert x.shape[1] == 1

        q, v, k = self.qvk_proj(x)

        # add new kv to end
        v = torch.cat((decode_state["v"], v), dim=1)[:, 1:]
        k = torch.cat((decode_state["k"], k), dim=1)[:, 1:]

        tokens_decoded = decode_state["tokens_decoded"] + 1
        length = v.shape[1]

        masked_tokens = length - tokens_decoded

        attention_mask = torch.arange(0, length)[None, :] < masked_tokens[:, None]
        bias = (-1e10 * attention_mask.float())[:, None, None, :]
        bias = bias + attn_bias

        attn_out = self.self_attn(q, v, k, bias)
        dense_out = self.ff(x)

        return attn_out + dense_out, {
            "tokens_decoded": tokens_decoded,
            "k": k,
            "v": v
        }

    # take in right aligned context tokens and generate an initial state
    def get_init_decode_state(self, x, given_length, attn_bias):
        x = self.norm(x)

        q, v, k = self.qvk_proj(x)

        full_length = x.shape[1]
        masked_tokens = full_length - given_length

        seq_len = x.shape[1]
        causal_mask = torch.tril(torch.ones((seq_len, seq_len)))

        bias = -1e10 * (1. - causal_mask)  # regular AR masking
        # mask out zero tokens before context starts
        bias = bias - 1e10 * (torch.arange(0, full_length)[None, :] < masked_tokens[:, None]).float()[:, None, None, :]
        bias = bias + attn_bias  # finally add attn bias for rpe

        attn_out = self.self_attn(q, v, k, bias)
        dense_out = self.ff(x)

        return attn_out + dense_out, {"k": k, "v": v, "tokens_decoded": given_length.long()}


class ProjectionShard(nn.Module):
    def __init__(self, config):
        super().__init__()
        out_dim = config["n_vocab"]
        shards = config["cores_per_replica"]

        assert out_dim % shards == 0

        self.dim = out_dim
        self.dim_per_shard = out_dim // shards

        self.norm = getnorm(config["norm"])

        self.proj = nn.Linear(config["d_model"], self.dim_per_shard)

    def forward(self, x):
        x = self.norm(x)
        return self.proj(x)


class CausalTransformerShard(nn.Module):
    def __init__(self, config):
        super().__init__()
        heads = config["n_heads"]
        shards = config["cores_per_replica"]
        layer_count = config["layers"]

        self.heads = heads
        self.heads_per_shard = heads // shards

        self.embed = EmbeddingShard(config)

        init_scale = 2. / layer_count

        self.transformer_layers = nn.ModuleList(
            [TransformerLayerShard(config, init_scale=init_scale) for i in range(layer_count)])

        self.proj = ProjectionShard(config)

        # config["pe"] == "rotary": no t5 relative position bias
        self.rpe = None

    def eval_logits(self, context):
        # the training / eval forward (CausalTransformerShard.eval) up to the logits, mask = 0
        attn_bias = 0

        x = self.embed(context)

        for l in self.transformer_layers:
            x = x + l(x, attn_bias)

        return self.proj(x)

    def generate_initial(self, context, length):
        # slice last token off the context (we use that in generate_once to generate the first new token)
        last = context[:, -1:]
        context = context[:, :-1]

        attn_bias = 0

        x = self.embed(context)

        states = []

        for l in self.transformer_layers:
            res, layer_state = l.get_init_decode_state(x, length - 1, attn_bias)
            x = x + res
            states.append(layer_state)

        return self.proj(x), (last, states)

    def generate_once(self, new_tok, state):
        attn_bias = 0

        x = self.embed(new_tok)

        new_states = []

        for l, s in zip(self.transformer_layers, state):
            res, layer_state = l.decode_once(s, x, attn_bias)
            x = x + res
            new_states.append(layer_state)

        return self.proj(x), new_states


def greedy_sampler(logits):
    return logits.argmax(-1)


class CausalTransformer:
    def __init__(self, config):
        self.config = config
        self.transformer = CausalTransformerShard(config).eval()
        self.sampler = greedy_sampler

    @torch.no_grad()
    def generate(self, ctx, ctx_length, gen_length):
        transformer = self.transformer
        _, initial_state = transformer.generate_initial(ctx, ctx_length)

        next_token, decode_state = initial_state
        tokens, all_logits = [], []
        for _ in range(gen_length):  # jax.lax.scan(generate_scan_fn, initial_state, xs=aux, length=gen_length)
            logits, new_state = transformer.generate_once(next_token, decode_state)
            logits = logits[:, -1]
            next_token = self.sampler(logits)[:, None]
            tokens.append(next_token)
            all_logits.append(logits)
            decode_state = new_state

        return torch.cat(tokens, dim=1), torch.stack(all_logits, dim=1)


def pad_contexts(contexts, seq):
    # device_serve.py: np.pad(tokens, ((pad_amount, 0),))[-seq:], length = len(tokens)
    all_tokenized = []
    all_length = []
    for tokens in contexts:
        provided_ctx = len(tokens)
        pad_amount = seq - provided_ctx
        pad_amount = max(pad_amount, 0)
        padded_tokens = np.pad(np.array(tokens), ((pad_amount, 0),)).astype(np.int64)[-seq:]
        all_tokenized.append(padded_tokens)
        all_length.append(len(tokens))
    return torch.tensor(np.array(all_tokenized)), torch.tensor(all_length)


def main():
    network = CausalTransformer(config)
    gen_length = 5

    contexts = [
        [5, 17, 3],
        [9, 41, 22, 7, 30, 11, 2],
        [12, 8, 60, 33, 1, 14, 27, 45, 19, 6],
    ]
    ctx, ctx_length = pad_contexts(contexts, config["seq"])
    assert (ctx_length - 1 + gen_length <= config["seq"] - 1).all()

    out_tokens, out_logits = network.generate(ctx, ctx_length, gen_length)

    # reference: each context alone, no padding, no cache, plain causal forward each step
    with torch.no_grad():
        for b, tokens in enumerate(contexts):
            seq = list(tokens)
            for step in range(gen_length):
                logits = network.transformer.eval_logits(torch.tensor([seq]))[0, -1]
                torch.testing.assert_close(out_logits[b, step], logits, atol=1e-4, rtol=1e-4)
                nxt = int(logits.argmax())
                assert nxt == int(out_tokens[b, step]), (b, step, nxt, out_tokens[b].tolist())
                seq.append(nxt)
            print(f"context {b} (length {len(tokens)}): generated {out_tokens[b].tolist()} matches the lone run")

    print("ok")


if __name__ == "__main__":
    main()
