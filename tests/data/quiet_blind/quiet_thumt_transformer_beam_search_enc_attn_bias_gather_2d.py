# Citation: THUNLP-MT/THUMT @4893578278c08f436fbaaf799257cea15b0c9b56 (PyTorch branch):
#   thumt/models/transformer.py (Transformer.encode / decode / empty_state / masking_bias / causal_bias,
#   AttentionSubLayer with its "k"/"v" state), thumt/modules/attention.py (MultiHeadAttention.forward with kv),
#   thumt/modules/embedding.py (PositionalEmbedding), thumt/utils/inference.py (beam_search, _beam_search_step,
#   _get_inference_fn, _tile_to_beam_size, _merge_first_two_dims, _split_first_two_dims, _gather_2d).
# THUMT translating a right-padded batch of sources with beam search: encode turns source_mask (1 = a real token)
# into an additive bias (1 - mask) * -1e9 of shape (B, 1, 1, L) kept in the state as "enc_attn_bias" beside
# "encoder_output"; beam_search tiles every state tensor to (B, beam, ...), merges the first two dims for each step,
# and after top-k gathers the whole state (encoder output, its bias and every layer's self-attention k/v) with
# _gather_2d by the surviving beams' parents. The decoder's self-attention bias in infer mode is the causal row of
# the newest position. Checked against each source alone, unpadded (finished sequences and scores), and each
# finished translation's score against a full, uncached teacher-forced decode of that source alone.
import math

import torch
import torch.nn as nn

torch.manual_seed(2)


class HParams(dict):
    __getattr__ = dict.__getitem__


def map_structure(func, structure):
    if isinstance(structure, dict):
        return {k: map_structure(func, v) for k, v in structure.items()}
    if isinstance(structure, (list, tuple)):
        return type(structure)(map_structure(func, v) for v in structure)
    return func(structure)


class PositionalEmbedding(nn.Module):
    def forward(self, inputs):
        length = inputs.shape[1]
        channels = inputs.shape[2]
        half_dim = channels // 2
        positions = torch.arange(length, dtype=inputs.dtype, device=inputs.device)
        dimensions = torch.arange(half_dim, dtype=inputs.dtype, device=inputs.device)
        scale = math.log(10000.0) / float(half_dim - 1)
        dimensions.mul_(-scale).exp_()
        scaled_time = positions.unsqueeze(1) * dimensions.unsqueeze(0)
        signal = torch.cat([torch.sin(scaled_time), torch.cos(scaled_time)], dim=1)
        return inputs + torch.reshape(signal, [1, -1, channels]).to(inputs)


class MultiHeadAttention(nn.Module):
    def __init__(self, hidden_size, num_heads, dropout=0.0):
        super().__init__()
        self.num_heads = num_heads
        self.hidden_size = hidden_size
        self.dropout = dropout
        self.q_transform = nn.Linear(hidden_size, hidden_size)
        self.k_transform = nn.Linear(hidden_size, hidden_size)
        self.v_transform = nn.Linear(hidden_size, hidden_size)
        self.o_transform = nn.Linear(hidden_size, hidden_size)

    @staticmethod
    def split_heads(x, heads):
        batch, length, channels = x.shape
        y = torch.reshape(x, [batch, length, heads, channels // heads])
        return torch.transpose(y, 2, 1)

    @staticmethod
    def combine_heads(x):
        batch, heads, length, channels = x.shape
        y = torch.transpose(x, 2, 1)
        return torch.reshape(y, [batch, length, heads * channels])

    def forward(self, query, bias, memory=None, kv=None):
        q = self.q_transform(query)
        if memory is not None:
            if kv is not None:
                k, v = kv
            else:
                k, v = None, None
            # encoder-decoder attention
            k = k or self.k_transform(memory)
            v = v or self.v_transform(memory)
        else:
            # self-attention
            k = self.k_transform(query)
            v = self.v_transform(query)
            if kv is not None:
                k = torch.cat([kv[0], k], dim=1)
                v = torch.cat([kv[1], v], dim=1)
        qh = self.split_heads(q, self.num_heads)
        kh = self.split_heads(k, self.num_heads)
        vh = self.split_heads(v, self.num_heads)
        qh = qh * (self.hidden_size // self.num_heads) ** -0.5
        kh = torch.transpose(kh, -2, -1)
        logits = torch.matmul(qh, kh)
        if bias is not None:
            logits = logits + bias
        weights = torch.nn.functional.dropout(torch.softmax(logits, dim=-1), p=self.dropout, training=self.training)
        x = torch.matmul(weights, vh)
        output = self.o_transform(self.combine_heads(x))
        if kv is not None:
            return output, k, v
        return output


class AttentionSubLayer(nn.Module):
    def __init__(self, params):
        super().__init__()
        self.dropout = params.residual_dropout
        self.normalization = params.normalization
        self.attention = MultiHeadAttention(params.hidden_size, params.num_heads, params.attention_dropout)
        self.layer_norm = nn.LayerNorm(params.hidden_size)

    def forward(self, x, bias, memory=None, state=None):
        if self.normalization == "before":
            y = self.layer_norm(x)
        else:
            y = x
        if self.training or state is None:
            y = self.attention(y, bias, memory, None)
        else:
            kv = [state["k"], state["v"]]
            y, k, v = self.attention(y, bias, memory, kv)
            state["k"], state["v"] = k, v
        y = nn.functional.dropout(y, self.dropout, self.training)
        if self.normalization == "before":
            return x + y
        return self.layer_norm(x + y)


class FFNSubLayer(nn.Module):
    def __init__(self, params):
        super().__init__()
        self.dropout = params.residual_dropout
        self.normalization = params.normalization
        self.input_transform = nn.Linear(params.hidden_size, params.filter_size)
        self.output_transform = nn.Linear(params.filter_size, params.hidden_size)
        self.layer_norm = nn.LayerNorm(params.hidden_size)

    def forward(self, x):
        y = self.layer_norm(x) if self.normalization == "before" else x
        y = self.output_transform(nn.functional.relu(self.input_transform(y)))
        y = nn.functional.dropout(y, self.dropout, self.training)
        if self.normalization == "before":
            return x + y
        return self.layer_norm(x + y)


class TransformerEncoderLayer(nn.Module):
    def __init__(self, params):
        super().__init__()
        self.self_attention = AttentionSubLayer(params)
        self.feed_forward = FFNSubLayer(params)

    def forward(self, x, bias):
        x = self.self_attention(x, bias)
        x = self.feed_forward(x)
        return x


class TransformerDecoderLayer(nn.Module):
    def __init__(self, params):
        super().__init__()
        self.self_attention = AttentionSubLayer(params)
        self.encdec_attention = AttentionSubLayer(params)
        self.feed_forward = FFNSubLayer(params)

    def forward(self, x, attn_bias, encdec_bias, memory, state=None):
        x = self.self_attention(x, attn_bias, state=state)
        x = self.encdec_attention(x, encdec_bias, memory)
        x = self.feed_forward(x)
        return x


class TransformerEncoder(nn.Module):
    def __init__(self, params):
        super().__init__()
        self.layers = nn.ModuleList([TransformerEncoderLayer(params) for _ in range(params.num_encoder_layers)])

    def forward(self, x, bias):
        for layer in self.layers:
            x = layer(x, bias)
        return x


class TransformerDecoder(nn.Module):
    def __init__(self, params):
        super().__init__()
        self.layers = nn.ModuleList([TransformerDecoderLayer(params) for _ in range(params.num_decoder_layers)])

    def forward(self, x, attn_bias, encdec_bias, memory, state=None):
        for i, layer in enumerate(self.layers):
            if state is not None:
                x = layer(x, attn_bias, encdec_bias, memory, state["decoder"]["layer_%d" % i])
            else:
                x = layer(x, attn_bias, encdec_bias, memory, None)
        return x


class Transformer(nn.Module):
    def __init__(self, params):
        super().__init__()
        self.params = params
        svoc_size = len(params.vocabulary["source"])
        tvoc_size = len(params.vocabulary["target"])
        self.source_embedding = nn.Parameter(torch.empty([svoc_size, params.hidden_size]))
        self.target_embedding = nn.Parameter(torch.empty([tvoc_size, params.hidden_size]))
        self.softmax_weights = nn.Parameter(torch.empty([tvoc_size, params.hidden_size]))
        self.bias = nn.Parameter(torch.zeros([params.hidden_size]))
        self.encoding = PositionalEmbedding()
        self.encoder = TransformerEncoder(params)
        self.decoder = TransformerDecoder(params)
        self.dropout = params.residual_dropout
        self.hidden_size = params.hidden_size
        self.num_decoder_layers = params.num_decoder_layers
        for w in (self.source_embedding, self.target_embedding, self.softmax_weights):
            nn.init.normal_(w, mean=0.0, std=params.hidden_size ** -0.5)

    def encode(self, features, state):
        src_seq = features["source"]
        src_mask = features["source_mask"]
        enc_attn_bias = self.masking_bias(src_mask)
        inputs = torch.nn.functional.embedding(src_seq, self.source_embedding)
        inputs = inputs * (self.hidden_size ** 0.5)
        inputs = inputs + self.bias
        inputs = nn.functional.dropout(self.encoding(inputs), self.dropout, self.training)
        enc_attn_bias = enc_attn_bias.to(inputs)
        encoder_output = self.encoder(inputs, enc_attn_bias)
        state["encoder_output"] = encoder_output
        state["enc_attn_bias"] = enc_attn_bias
        return state

    def decode(self, features, state, mode="infer"):
        tgt_seq = features["target"]
        enc_attn_bias = state["enc_attn_bias"]
        dec_attn_bias = self.causal_bias(tgt_seq.shape[1])
        targets = torch.nn.functional.embedding(tgt_seq, self.target_embedding)
        targets = targets * (self.hidden_size ** 0.5)
        decoder_input = torch.cat([targets.new_zeros([targets.shape[0], 1, targets.shape[-1]]), targets[:, 1:, :]],
                                  dim=1)
        decoder_input = nn.functional.dropout(self.encoding(decoder_input), self.dropout, self.training)
        encoder_output = state["encoder_output"]
        dec_attn_bias = dec_attn_bias.to(targets)
        if mode == "infer":
            decoder_input = decoder_input[:, -1:, :]
            dec_attn_bias = dec_attn_bias[:, :, -1:, :]
        decoder_output = self.decoder(decoder_input, dec_attn_bias, enc_attn_bias, encoder_output, state)
        decoder_output = torch.reshape(decoder_output, [-1, self.hidden_size])
        decoder_output = torch.transpose(decoder_output, -1, -2)
        logits = torch.matmul(self.softmax_weights, decoder_output)
        logits = torch.transpose(logits, 0, 1)
        return logits, state

    def empty_state(self, batch_size, device):
        return {
            "decoder": {
                "layer_%d" % i: {
                    "k": torch.zeros([batch_size, 0, self.hidden_size], device=device),
                    "v": torch.zeros([batch_size, 0, self.hidden_size], device=device),
                } for i in range(self.num_decoder_layers)
            }
        }

    @staticmethod
    def masking_bias(mask, inf=-1e9):
        ret = (1.0 - mask) * inf
        return torch.unsqueeze(torch.unsqueeze(ret, 1), 1)

    @staticmethod
    def causal_bias(length, inf=-1e9):
        ret = torch.ones([length, length]) * inf
        ret = torch.triu(ret, diagonal=1)
        return torch.reshape(ret, [1, 1, length, length])


# ---- thumt/utils/inference.py ----
def _merge_first_two_dims(tensor):
    shape = list(tensor.shape)
    shape[1] *= shape[0]
    return torch.reshape(tensor, shape[1:])


def _split_first_two_dims(tensor, dim_0, dim_1):
    shape = [dim_0, dim_1] + list(tensor.shape)[1:]
    return torch.reshape(tensor, shape)


def _tile_to_beam_size(tensor, beam_size):
    tensor = torch.unsqueeze(tensor, 1)
    tile_dims = [1] * int(tensor.dim())
    tile_dims[1] = beam_size
    return tensor.repeat(tile_dims)


def _gather_2d(params, indices):
    batch_size = params.shape[0]
    range_size = indices.shape[1]
    batch_pos = torch.arange(batch_size * range_size, device=params.device)
    batch_pos = batch_pos // range_size
    batch_pos = torch.reshape(batch_pos, [batch_size, range_size])
    output = params[batch_pos, indices]
    return output


def _get_inference_fn(model_fns, features):
    def inference_fn(inputs, state):
        local_features = {
            "source": features["source"],
            "source_mask": features["source_mask"],
            "target": inputs,
            "target_mask": torch.ones(*inputs.shape).to(inputs).float(),
        }
        outputs = []
        next_state = []
        for (model_fn, model_state) in zip(model_fns, state):
            logits, new_state = model_fn(local_features, model_state)
            outputs.append(torch.nn.functional.log_softmax(logits, dim=-1))
            next_state.append(new_state)
        log_prob = sum(outputs) / float(len(outputs))
        return log_prob.float(), next_state
    return inference_fn


def _beam_search_step(time, func, state, batch_size, beam_size, alpha, pad_id, eos_id, min_length, max_length,
                      inf=-1e9):
    seqs, log_probs = state[0][:2]
    flat_seqs = _merge_first_two_dims(seqs)
    flat_state = map_structure(lambda x: _merge_first_two_dims(x), state[1])
    step_log_probs, next_state = func(flat_seqs, flat_state)
    step_log_probs = _split_first_two_dims(step_log_probs, batch_size, beam_size)
    next_state = map_structure(lambda x: _split_first_two_dims(x, batch_size, beam_size), next_state)
    curr_log_probs = torch.unsqueeze(log_probs, 2) + step_log_probs
    length_penalty = ((5.0 + float(time + 1)) / 6.0) ** alpha
    curr_scores = curr_log_probs / length_penalty
    vocab_size = curr_scores.shape[-1]
    min_length_flags = torch.ge(min_length, time + 1).float().mul_(inf)
    curr_scores[:, :, eos_id].add_(min_length_flags)
    curr_scores = torch.reshape(curr_scores, [-1, beam_size * vocab_size])
    top_scores, top_indices = torch.topk(curr_scores, k=2 * beam_size)
    beam_indices = top_indices // vocab_size
    symbol_indices = top_indices % vocab_size
    candidate_seqs = _gather_2d(seqs, beam_indices)
    candidate_seqs = torch.cat([candidate_seqs, torch.unsqueeze(symbol_indices, 2)], 2)
    flags = torch.eq(symbol_indices, eos_id).to(torch.bool)
    alive_scores = top_scores + flags.to(torch.float32) * inf
    alive_scores, alive_indices = torch.topk(alive_scores, beam_size)
    alive_symbols = _gather_2d(symbol_indices, alive_indices)
    alive_indices = _gather_2d(beam_indices, alive_indices)
    alive_seqs = _gather_2d(seqs, alive_indices)
    alive_seqs = torch.cat([alive_seqs, torch.unsqueeze(alive_symbols, 2)], 2)
    alive_state = map_structure(lambda x: _gather_2d(x, alive_indices), next_state)
    alive_log_probs = alive_scores * length_penalty
    length_flags = torch.le(max_length, time + 1).float()
    alive_log_probs = alive_log_probs + length_flags * inf
    alive_scores = alive_scores + length_flags * inf
    prev_fin_flags, prev_fin_seqs, prev_fin_scores = state[2]
    step_fin_scores = top_scores + (1.0 - flags.to(torch.float32)) * inf
    fin_flags = torch.cat([prev_fin_flags, flags], dim=1)
    fin_scores = torch.cat([prev_fin_scores, step_fin_scores], dim=1)
    fin_scores, fin_indices = torch.topk(fin_scores, beam_size)
    fin_flags = _gather_2d(fin_flags, fin_indices)
    pad_seqs = prev_fin_seqs.new_full([batch_size, beam_size, 1], pad_id)
    prev_fin_seqs = torch.cat([prev_fin_seqs, pad_seqs], dim=2)
    fin_seqs = torch.cat([prev_fin_seqs, candidate_seqs], dim=1)
    fin_seqs = _gather_2d(fin_seqs, fin_indices)
    return ((alive_seqs, alive_log_probs, alive_scores), alive_state, (fin_flags, fin_seqs, fin_scores))


def beam_search(models, features, params):
    beam_size = params.beam_size
    top_beams = params.top_beams
    alpha = params.decode_alpha
    pad_id = params.vocabulary["target"][params.pad]
    bos_id = params.vocabulary["target"][params.bos]
    eos_id = params.vocabulary["target"][params.eos]
    min_val = -1e9
    shape = features["source"].shape
    device = features["source"].device
    batch_size, seq_length = shape[0], shape[1]
    states, funcs = [], []
    for model in models:
        state = model.empty_state(batch_size, device)
        states.append(model.encode(features, state))
        funcs.append(model.decode)
    max_length = features["source_mask"].sum(1) * params.decode_ratio
    max_length = max_length.long() + params.decode_length
    max_step = max_length.max()
    max_length = torch.unsqueeze(max_length, 1).repeat([1, beam_size])
    min_length = torch.ones_like(max_length)
    features["source"] = torch.unsqueeze(features["source"], 1).repeat([1, beam_size, 1])
    features["source"] = torch.reshape(features["source"], [batch_size * beam_size, seq_length])
    features["source_mask"] = torch.unsqueeze(features["source_mask"], 1).repeat([1, beam_size, 1])
    features["source_mask"] = torch.reshape(features["source_mask"], [batch_size * beam_size, seq_length])
    decoding_fn = _get_inference_fn(funcs, features)
    states = map_structure(lambda x: _tile_to_beam_size(x, beam_size), states)
    init_seqs = torch.full([batch_size, beam_size, 1], bos_id, device=device).long()
    init_log_probs = init_seqs.new_tensor([[0.] + [min_val] * (beam_size - 1)], dtype=torch.float32)
    init_log_probs = init_log_probs.repeat([batch_size, 1])
    init_scores = torch.zeros_like(init_log_probs)
    fin_seqs = torch.zeros([batch_size, beam_size, 1], dtype=torch.int64, device=device)
    fin_scores = torch.full([batch_size, beam_size], min_val, dtype=torch.float32, device=device)
    fin_flags = torch.zeros([batch_size, beam_size], dtype=torch.bool, device=device)
    state = ((init_seqs, init_log_probs, init_scores), states, (fin_flags, fin_seqs, fin_scores))
    for time in range(max_step):
        state = _beam_search_step(time, decoding_fn, state, batch_size, beam_size, alpha, pad_id, eos_id,
                                  min_length, max_length)
        max_penalty = ((5.0 + max_step) / 6.0) ** alpha
        best_alive_score = torch.max(state[0][1][:, 0] / max_penalty)
        worst_finished_score = torch.min(state[2][2])
        if bool(torch.gt(worst_finished_score, best_alive_score)):
            break
    alive_seqs, alive_scores = state[0][0], state[0][2]
    final_flags, final_seqs, final_scores = state[2]
    final_seqs = torch.where(final_flags[:, :, None], final_seqs, alive_seqs)
    final_scores = torch.where(final_flags, final_scores, alive_scores)
    final_seqs = torch.nn.functional.pad(final_seqs, (0, 1, 0, 0, 0, 0), value=eos_id)
    return final_seqs[:, :top_beams, 1:], final_scores[:, :top_beams], final_flags[:, :top_beams]


vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2}
for i in range(3, 20):
    vocab["w%d" % i] = i
params = HParams(pad="<pad>", bos="<eos>", eos="<eos>", unk="<unk>", hidden_size=16, filter_size=32, num_heads=2,
                 num_encoder_layers=2, num_decoder_layers=2, attention_dropout=0.0, residual_dropout=0.0,
                 relu_dropout=0.0, normalization="after", vocabulary={"source": vocab, "target": vocab},
                 beam_size=3, top_beams=3, decode_alpha=0.6, decode_ratio=0.0, decode_length=8)
model = Transformer(params).eval()
with torch.no_grad():
    model.softmax_weights.mul_(3.0)
    model.softmax_weights[vocab["<eos>"]].mul_(2.0)  # so that most beams finish within decode_length


def lookup(sentences):
    """THUMT's input pipeline: ids + <eos>, padded on the right with <pad>, source_mask = ids != pad."""
    ids = [s + [vocab["<eos>"]] for s in sentences]
    L = max(len(s) for s in ids)
    source = torch.full((len(ids), L), vocab["<pad>"], dtype=torch.long)
    for i, s in enumerate(ids):
        source[i, :len(s)] = torch.tensor(s)
    return {"source": source, "source_mask": (source != vocab["<pad>"]).float()}


sentences = [[4, 9, 13, 7, 11, 18], [6, 17], [8, 5, 19, 15]]
with torch.no_grad():
    seqs, scores, flags = beam_search([model], lookup(sentences), params)
    n_finished = 0
    for i, s in enumerate(sentences):
        a_seqs, a_scores, a_flags = beam_search([model], lookup([s]), params)
        assert torch.equal(flags[i], a_flags[0]), (i, flags[i], a_flags[0])
        # the batch may run more steps than the source alone (its loop stops on the batch's scores): compare each
        # finished translation up to its <eos>
        for k in range(params.beam_size):
            if flags[i, k]:
                got, want = seqs[i, k].tolist(), a_seqs[0, k].tolist()
                eos = vocab["<eos>"]
                assert got[:got.index(eos) + 1] == want[:want.index(eos) + 1], (i, k, got, want)
        assert torch.allclose(scores[i][flags[i]], a_scores[0][a_flags[0]], atol=1e-5), (i, scores[i], a_scores[0])
        # reference: rescore each finished translation with a full teacher-forced decode of the source alone
        feats = lookup([s])
        for k in range(params.beam_size):
            if not flags[i, k]:
                continue
            n_finished += 1
            hyp = seqs[i, k].tolist()
            hyp = hyp[:hyp.index(vocab["<eos>"]) + 1]
            state = model.encode(feats, model.empty_state(1, "cpu"))
            target = torch.tensor([[vocab["<eos>"]] + hyp[:-1]])
            logits, _ = model.decode({"target": target}, state, mode="eval")
            logp = torch.log_softmax(logits, -1).gather(1, torch.tensor(hyp)[:, None]).sum()
            lp = ((5.0 + len(hyp)) / 6.0) ** params.decode_alpha
            assert torch.allclose(logp / lp, scores[i, k], atol=1e-4), (i, k, logp / lp, scores[i, k])
    assert n_finished >= 3, n_finished
print("ok: THUMT beam search over right-padded sources matches each source alone; %d finished rescored" % n_finished)
