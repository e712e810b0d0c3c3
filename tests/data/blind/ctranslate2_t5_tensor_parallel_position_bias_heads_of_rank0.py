# OpenNMT/CTranslate2#1714 (commit 5eb5d5a3, "fix position bias in tensor parallel"; report: OpenNMT/CTranslate2#1708,
# flan-t5 gives different answers with tensor_parallel=True).
#
# CTranslate2 runs T5 with tensor parallelism by giving each rank num_heads / nranks heads (its slice of the q/k/v
# projections, a row slice of the output projection, then a ReduceAll SUM). The T5 relative attention bias is not a
# linear weight, so every rank holds all of it and compute_relative_bias() returns a (num_heads, q, k) bias. In
# dot_product_attention() the bias was added with add_batch_broadcast(position_bias, output), a flat repeat of the
# bias over the rank's (batch, heads/nranks, q, k) scores: every rank got the bias of heads 0 .. heads/nranks - 1,
# so rank 1's heads were biased with rank 0's heads' buckets (encoder and decoder alike).
# Fix: on a rank other than 0, Slide the bias to the rank's own heads (num_head_per_gpu * rank, num_head_per_gpu)
# before add_batch_broadcast.
#
# This ports src/layers/attention.cc (compute_relative_bias, get_relative_position_bucket, dot_product_attention),
# the CUDA add_batch_broadcast (a flat repeat of `a` over `b`), src/layers/transformer.cc (the position_bias shared
# by the layers of one encoder pass / one decoding step) and the Translator's greedy search, in torch. The
# ranks, separate processes under mpirun in CTranslate2, run one after the other here and their attention outputs
# are summed as ReduceAll does. The weights come from a tiny transformers T5 model, converted as
# python/ctranslate2/converters/transformers.py does (every layer shares the first layer's relative_attention_bias).
import math
import sys

import torch
from transformers import T5Config, T5ForConditionalGeneration

FIXED = "--fixed" in sys.argv


class ScopedMPISetter:
    _cur_rank = 0
    _nranks = 1

    @classmethod
    def getCurRank(cls):
        return cls._cur_rank

    @classmethod
    def getNRanks(cls):
        return cls._nranks


def SAFE_DIVIDE(x, y):
    if x % y != 0:
        raise ValueError("%d is not divisible by %d" % (x, y))
    return x // y


# ---------------------------------------------------------------- primitives / ops


def add_batch_broadcast(a, b):
    # primitives<Device::CUDA>::add_batch_broadcast(a, b, c, a_size, b_size): c[i] = a[i % a_size] + b[i]
    a_flat = a.reshape(-1)
    b_flat = b.reshape(-1)
    index = torch.arange(b_flat.numel()) % a_flat.numel()
    return (b_flat + a_flat[index]).view_as(b)


def slide(x, axis, index, size):
    return x.narrow(axis, index, size).contiguous()


def rms_layer_norm(x, gamma, eps=1e-6):
    variance = x.pow(2).mean(-1, keepdim=True)
    return x * torch.rsqrt(variance + eps) * gamma


def softmax_with_lengths(x, lengths):
    # ops::SoftMax()(output, values_lengths, attn): keys at or after the length get no weight
    if lengths is not None:
        key_pos = torch.arange(x.shape[-1])
        invalid = key_pos[None, :] >= lengths[:, None]
        x = x.masked_fill(invalid[:, None, None, :], float("-inf"))
    return torch.softmax(x, dim=-1)


# ---------------------------------------------------------------- attention.cc


def get_relative_position_bucket(bidirectional, query_length, key_length, num_buckets, max_distance,
                                 query_offset=0):
    if bidirectional:
        num_buckets //= 2
    max_exact = num_buckets // 2
    log_max_distance_over_max_exact = math.log(float(max_distance) / float(max_exact))
    buckets = torch.empty(query_length, key_length, dtype=torch.long)
    for i in range(query_length):
        for j in range(key_length):
            relative_position = j - (i + query_offset)
            relative_bucket = 0
            if bidirectional:
                if relative_position > 0:
                    relative_bucket += num_buckets
                else:
                    relative_position = abs(relative_position)
            else:
                relative_position = -min(relative_position, 0)
            if not relative_position < max_exact:
                relative_position = min(
                    int(float(max_exact)
                        + math.log(float(relative_position) / float(max_exact))
                        / log_max_distance_over_max_exact
                        * float(num_buckets - max_exact)),
                    num_buckets - 1)
            buckets[i, j] = relative_bucket + relative_position
    return buckets


def compute_relative_bias(relative_attention_bias, query_length, key_length, max_distance, is_decoder,
                          query_offset=0):
    num_buckets = relative_attention_bias.shape[0]
    bucket = get_relative_position_bucket(not is_decoder, query_length, key_length, num_buckets, max_distance,
                                          query_offset)
    values = relative_attention_bias[bucket]          # (q, k, heads)
    return values.permute(2, 0, 1).contiguous()      # ops::Transpose({2, 0, 1}) -> (heads, q, k)


def dot_product_attention(queries, keys, values, values_lengths, relative_attention_bias,
                          maximum_relative_position, queries_scale, is_decoder, with_cache, position_bias):
    output = torch.matmul(queries, keys.transpose(-1, -2)) * queries_scale

    if relative_attention_bias is not None:
        if "value" not in position_bias:
            query_length = queries.shape[2]
            key_length = keys.shape[2]
            position_bias["value"] = compute_relative_bias(relative_attention_bias, query_length, key_length,
                                                           maximum_relative_position, is_decoder,
                                                           key_length - 1 if with_cache else 0)
        position_bias_per_gpu = position_bias["value"]
        if FIXED and ScopedMPISetter.getCurRank() != 0:
            num_head_per_gpu = SAFE_DIVIDE(position_bias_per_gpu.shape[0], ScopedMPISetter.getNRanks())
            position_bias_per_gpu = slide(position_bias["value"], 0,
                                          num_head_per_gpu * ScopedMPISetter.getCurRank(), num_head_per_gpu)
        output = add_batch_broadcast(position_bias_per_gpu, output)

    attn = softmax_with_lengths(output, values_lengths)
    return torch.matmul(attn, values)


class MultiHeadAttention:
    """One rank's share of a layers::MultiHeadAttention (tensor_parallel = True)."""

    def __init__(self, spec, num_heads, self_attention, is_decoder, max_distance):
        self.spec = spec
        self.self_attention = self_attention
        self.is_decoder = is_decoder
        self.tensor_parallel = ScopedMPISetter.getNRanks() > 1
        self.num_heads = SAFE_DIVIDE(num_heads, ScopedMPISetter.getNRanks()) if self.tensor_parallel else num_heads
        self.relative_attention_bias = spec.get("relative_attention_bias")
        self.maximum_relative_position = max_distance if self.relative_attention_bias is not None else 0
        self.queries_scale = 1.0  # T5 folds the scale into its weights

    def _rank_weights(self):
        rank = ScopedMPISetter.getCurRank()
        inner = self.spec["q"].shape[0]
        per_rank = inner // ScopedMPISetter.getNRanks()
        rows = slice(per_rank * rank, per_rank * (rank + 1))
        return (self.spec["q"][rows], self.spec["k"][rows], self.spec["v"][rows], self.spec["o"][:, rows])

    def split_heads(self, x):
        b, t, d = x.shape
        return x.view(b, t, self.num_heads, d // self.num_heads).transpose(1, 2)

    def __call__(self, queries, values, values_lengths, cached, position_bias):
        wq, wk, wv, wo = self._rank_weights()
        queries_proj = self.split_heads(queries @ wq.T)
        if self.self_attention:
            keys_proj = self.split_heads(queries @ wk.T)
            values_proj = self.split_heads(queries @ wv.T)
            if cached is not None:
                if "keys" in cached:
                    keys_proj = torch.cat([cached["keys"], keys_proj], dim=2)
                    values_proj = torch.cat([cached["values"], values_proj], dim=2)
                cached["keys"], cached["values"] = keys_proj, values_proj
        else:
            if cached is not None and "keys" in cached:
                keys_proj, values_proj = cached["keys"], cached["values"]
            else:
                keys_proj = self.split_heads(values @ wk.T)
                values_proj = self.split_heads(values @ wv.T)
                if cached is not None:
                    cached["keys"], cached["values"] = keys_proj, values_proj

        context = dot_product_attention(queries_proj, keys_proj, values_proj, values_lengths,
                                        self.relative_attention_bias, self.maximum_relative_position,
                                        self.queries_scale, self.is_decoder, cached is not None,
                                        position_bias)
        b, h, t, d = context.shape
        context = context.transpose(1, 2).reshape(b, t, h * d)
        return context @ wo.T


def tensor_parallel_attention(attention, queries, values, values_lengths, caches, position_biases):
    # every rank runs its heads; ops::ReduceAll(SUM) over the ranks' output projections
    output = None
    for rank in range(ScopedMPISetter.getNRanks()):
        ScopedMPISetter._cur_rank = rank
        part = attention(queries, values, values_lengths,
                         None if caches is None else caches[rank], position_biases[rank])
        output = part if output is None else output + part
    ScopedMPISetter._cur_rank = 0
    return output


def feed_forward(spec, x):
    h = rms_layer_norm(x, spec["ln"])
    return x + torch.relu(h @ spec["wi"].T) @ spec["wo"].T


# ---------------------------------------------------------------- converter (transformers.py, T5Loader)


def convert_t5(model):
    cfg = model.config
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}

    def attention_spec(prefix, first_prefix, with_bias):
        spec = {n: sd["%s.%s.weight" % (prefix, n)] for n in ("q", "k", "v", "o")}
        if with_bias:
            spec["relative_attention_bias"] = sd[first_prefix + ".relative_attention_bias.weight"]
        return spec

    encoder = []
    for i in range(cfg.num_layers):
        p = "encoder.block.%d.layer" % i
        encoder.append({
            "self_ln": sd[p + ".0.layer_norm.weight"],
            "self": attention_spec(p + ".0.SelfAttention", "encoder.block.0.layer.0.SelfAttention", True),
            "ffn": {"ln": sd[p + ".1.layer_norm.weight"], "wi": sd[p + ".1.DenseReluDense.wi.weight"],
                    "wo": sd[p + ".1.DenseReluDense.wo.weight"]},
        })
    decoder = []
    for i in range(cfg.num_decoder_layers):
        p = "decoder.block.%d.layer" % i
        decoder.append({
            "self_ln": sd[p + ".0.layer_norm.weight"],
            "self": attention_spec(p + ".0.SelfAttention", "decoder.block.0.layer.0.SelfAttention", True),
            "cross_ln": sd[p + ".1.layer_norm.weight"],
            "cross": attention_spec(p + ".1.EncDecAttention", None, False),
            "ffn": {"ln": sd[p + ".2.layer_norm.weight"], "wi": sd[p + ".2.DenseReluDense.wi.weight"],
                    "wo": sd[p + ".2.DenseReluDense.wo.weight"]},
        })
    return {
        "embeddings": sd["shared.weight"],
        "encoder": encoder, "encoder_norm": sd["encoder.final_layer_norm.weight"],
        "decoder": decoder, "decoder_norm": sd["decoder.final_layer_norm.weight"],
        "projection": sd["lm_head.weight"],
        "num_heads": cfg.num_heads, "max_distance": cfg.relative_attention_max_distance,
        "decoder_start_id": cfg.decoder_start_token_id, "eos_id": cfg.eos_token_id,
    }


# ---------------------------------------------------------------- transformer.cc


class TransformerEncoder:
    def __init__(self, spec):
        self.spec = spec
        self.layers = [(layer, MultiHeadAttention(layer["self"], spec["num_heads"], True, False,
                                                  spec["max_distance"])) for layer in spec["encoder"]]

    def __call__(self, ids, lengths):
        x = self.spec["embeddings"][ids]
        position_biases = [dict() for _ in range(ScopedMPISetter.getNRanks())]  # one per rank's process
        for layer, attention in self.layers:
            h = rms_layer_norm(x, layer["self_ln"])
            x = x + tensor_parallel_attention(attention, h, None, lengths, None, position_biases)
            x = feed_forward(layer["ffn"], x)
        return rms_layer_norm(x, self.spec["encoder_norm"])


class TransformerDecoder:
    def __init__(self, spec):
        self.spec = spec
        self.layers = []
        for layer in spec["decoder"]:
            self.layers.append((layer,
                                MultiHeadAttention(layer["self"], spec["num_heads"], True, True,
                                                   spec["max_distance"]),
                                MultiHeadAttention(layer["cross"], spec["num_heads"], False, True, 0)))

    def initial_state(self):
        nranks = ScopedMPISetter.getNRanks()
        return [{"self": [dict() for _ in range(nranks)], "cross": [dict() for _ in range(nranks)]}
                for _ in self.layers]

    def __call__(self, step, ids, state, memory, memory_lengths):
        x = self.spec["embeddings"][ids]
        position_biases = [dict() for _ in range(ScopedMPISetter.getNRanks())]  # StorageView position_bias
        for (layer, self_attention, cross_attention), layer_state in zip(self.layers, state):
            h = rms_layer_norm(x, layer["self_ln"])
            x = x + tensor_parallel_attention(self_attention, h, None, None, layer_state["self"],
                                              position_biases)
            h = rms_layer_norm(x, layer["cross_ln"])
            x = x + tensor_parallel_attention(cross_attention, h, memory, memory_lengths, layer_state["cross"],
                                              [dict() for _ in range(ScopedMPISetter.getNRanks())])
            x = feed_forward(layer["ffn"], x)
        x = rms_layer_norm(x, self.spec["decoder_norm"])
        return x @ self.spec["projection"].T


def translate_batch(spec, source_ids, max_decoding_length):
    # Translator::translate_batch with beam_size=1 (greedy search)
    lengths = torch.tensor([len(s) for s in source_ids])
    ids = torch.tensor(source_ids)
    memory = TransformerEncoder(spec)(ids, lengths)
    decoder = TransformerDecoder(spec)
    state = decoder.initial_state()
    batch = ids.shape[0]
    step_ids = torch.full((batch, 1), spec["decoder_start_id"], dtype=torch.long)
    hypotheses = [[] for _ in range(batch)]
    scores = torch.zeros(batch)
    finished = torch.zeros(batch, dtype=torch.bool)
    for step in range(max_decoding_length):
        logits = decoder(step, step_ids, state, memory, lengths)[:, -1]
        log_probs = torch.log_softmax(logits, dim=-1)
        best = log_probs.argmax(-1)
        for b in range(batch):
            if not finished[b]:
                scores[b] += log_probs[b, best[b]]
                if best[b].item() == spec["eos_id"]:
                    finished[b] = True
                else:
                    hypotheses[b].append(best[b].item())
        if bool(finished.all()):
            break
        step_ids = best[:, None]
    return hypotheses, scores


def main():
    torch.manual_seed(4)
    config = T5Config(vocab_size=48, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
                      num_heads=4, relative_attention_num_buckets=8, relative_attention_max_distance=16,
                      dropout_rate=0.0, feed_forward_proj="relu", tie_word_embeddings=False,
                      pad_token_id=0, eos_token_id=1, decoder_start_token_id=0, initializer_factor=4.0)
    model = T5ForConditionalGeneration(config).eval()
    with torch.no_grad():
        # a trained T5's bias table spans several logits; the random init's is near zero
        for block in (model.encoder.block[0], model.decoder.block[0]):
            block.layer[0].SelfAttention.relative_attention_bias.weight.normal_(0.0, 3.0)
    spec = convert_t5(model)

    # ctranslate2.Translator(model_dir, device="cuda", tensor_parallel=True) under `mpirun -n 2`
    ScopedMPISetter._nranks = 2
    source = [[7, 12, 5, 30, 22, 9, 41, 3, 17, 1]]
    with torch.no_grad():
        hypotheses, scores = translate_batch(spec, source, max_decoding_length=10)
    print("hypothesis:", hypotheses[0])
    print("score: %.4f" % scores[0].item())


if __name__ == "__main__":
    main()
