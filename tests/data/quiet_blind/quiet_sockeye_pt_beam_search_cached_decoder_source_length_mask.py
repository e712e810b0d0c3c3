"""Sockeye 3 (PyTorch) transformer NMT, shrunk: source length masks, cached
decoder states and beam search over a right-padded batch of sources.

Ported from awslabs/sockeye:
  sockeye/layers_pt.py @13d384358dd5ddeac4ed751342d289395c4b447a
      (prepare_source_length_mask, PyTorchDotAttentionCell, interleaved
       qk / valatt matmuls, PyTorchMultiHeadSelfAttention with previous_states,
       PyTorchMultiHeadAttention with projected_memory_kv)
  sockeye/decoder_pt.py, sockeye/transformer_pt.py
      @006f01b11b867463ad90e964684acb751c7b442b
      (init_state_from_encoder: source_mask kept as (batch, heads, src_len) in
       the state, encoder K/V projected once; forward: autoregressive mask only
       when not inference_only; decoder self-attention states grow along time)
  sockeye/beam_search_pt.py (repeat states per beam, sort states by
       best_hyp_indices; recalled, reduced to fixed-length search)

Masks: True = masked out (padding), filled with a finite -LARGE value before
softmax. The encoder's self-attention and the decoder's cross-attention use
the (batch*heads, 1, src_len) length mask; the decoder's training pass uses a
(1, T, T) triu(1) mask; cached inference steps use no target mask at all (one
query sees every cached key, which are all earlier steps).

Checks: (1) batched, padded beam search == each source searched alone without
padding; (2) step-wise cached decoding logits == teacher-forced training pass
with the autoregressive mask; (3) encoder outputs at real positions == alone.
"""
import torch as pt

pt.manual_seed(0)

LARGE_VALUES = {pt.float32: 99999999.0, pt.float16: 65504.0}

MODEL = 16
HEADS = 4
FF = 32
LAYERS = 2
VOCAB = 13
PAD = 0
BOS = 2
MAX_LEN = 32


# ---------------------------------------------------------------- layers_pt
def pytorch_interleaved_matmul_encdec_qk(q, kv, heads: int):
    qlen, batch, hidden = q.size()
    head_dim = hidden // heads
    q = q.contiguous().view(qlen, batch * heads, head_dim).transpose(0, 1)
    q = q * head_dim ** -0.5
    kvlen, batch, hidden2 = kv.size()
    tmp = kv.reshape(kvlen, batch, heads, 2, head_dim)
    k = tmp[:, :, :, 0, :]
    k = k.permute(1, 2, 3, 0)
    k = k.reshape(batch * heads, head_dim, kvlen)
    return pt.bmm(q, k)  # (batch * heads, qlen, klen)


def pytorch_interleaved_matmul_encdec_valatt(kv, att, heads: int):
    kvlen, batch, hidden2 = kv.size()
    batch_heads, qlen, kvlen_ = att.size()
    assert kvlen == kvlen_
    assert batch_heads // heads == batch
    hidden = hidden2 // 2
    head_dim = hidden // heads
    tmp = kv.reshape(kvlen, batch, heads, 2, -1)
    v = tmp[:, :, :, 1, :]
    v = v.permute(1, 2, 0, 3)
    v = v.reshape(-1, kvlen, head_dim)
    output = pt.bmm(att, v)
    output = output.transpose(0, 1).contiguous().view(qlen, batch, hidden)
    return output


class DotAttentionCell(pt.nn.Module):
    def __init__(self, heads):
        super().__init__()
        self.heads = heads

    def forward(self, queries, key_values, mask=None):
        logits = pytorch_interleaved_matmul_encdec_qk(queries, key_values, heads=self.heads)
        if mask is not None:
            logits = logits.masked_fill(mask, -LARGE_VALUES[logits.dtype])
        probs = pt.nn.functional.softmax(logits, dim=-1)
        return pytorch_interleaved_matmul_encdec_valatt(key_values, probs, heads=self.heads)


def prepare_source_length_mask(lengths, heads: int, max_length: int):
    lengths = lengths.repeat_interleave(heads, dim=0)  # (batch_size * heads)
    # (batch_size * heads, 1, max_len), True = padding
    return ~(pt.arange(max_length, device=lengths.device)[None, :] < lengths[:, None]).view(-1, 1, max_length)


class MultiHeadAttentionBase(pt.nn.Module):
    def __init__(self, depth_att, heads, depth_out):
        super().__init__()
        self.depth = depth_att
        self.heads = heads
        self.dot_att = DotAttentionCell(heads)
        self.ff_out = pt.nn.Linear(depth_att, depth_out, bias=False)

    def _attend(self, queries, key_values, mask=None):
        contexts = self.dot_att(queries=queries, key_values=key_values, mask=mask)
        return self.ff_out(contexts)


class MultiHeadSelfAttention(MultiHeadAttentionBase):
    def __init__(self, depth_att, heads, depth_out):
        super().__init__(depth_att, heads, depth_out)
        self.depth_att = depth_att
        self.ff_in = pt.nn.Linear(depth_att, depth_att * 3, bias=False)

    def get_state_shape(self, batch_size):
        return 0, batch_size, self.depth_att * 2

    def forward(self, inputs, previous_states=None, mask=None):
        proj = self.ff_in(inputs)
        queries, states = proj.split((self.depth_att, 2 * self.depth_att), dim=2)
        if previous_states is not None:
            states = pt.cat((previous_states, states), dim=0)
        return self._attend(queries=queries, key_values=states, mask=mask), states


class MultiHeadAttention(MultiHeadAttentionBase):
    def __init__(self, depth_att, heads, depth_out, depth_key_value):
        super().__init__(depth_att, heads, depth_out)
        self.ff_q = pt.nn.Linear(depth_out, depth_att, bias=False)
        self.ff_kv = pt.nn.Linear(depth_key_value, depth_att * 2, bias=False)

    def forward(self, queries, key_values, mask=None, projected_memory_kv=None):
        queries = self.ff_q(queries)
        key_values = projected_memory_kv if projected_memory_kv is not None else self.ff_kv(key_values)
        return self._attend(queries=queries, key_values=key_values, mask=mask)


def get_positional_embeddings(length, depth):
    channels = pt.arange(depth // 2).unsqueeze(0)
    positions = pt.arange(0, length).unsqueeze(1)
    scaled_positions = positions / pt.pow(10000, (2 * channels) / depth)
    return pt.hstack([pt.sin(scaled_positions), pt.cos(scaled_positions)])


class PositionalEmbeddings(pt.nn.Module):
    def __init__(self, num_embed, max_seq_len):
        super().__init__()
        self.num_embed = num_embed
        self.max_seq_len = max_seq_len
        self.register_buffer("weight", get_positional_embeddings(max_seq_len, num_embed).float())

    def forward(self, data, steps=None):
        if steps is None:
            pos_embedding = self.weight.unsqueeze(0)[:, :data.size()[1]]
        else:
            steps = pt.clip(steps, max=self.max_seq_len - 1)
            pos_embedding = pt.nn.functional.embedding(steps, self.weight)
        data = data * (self.num_embed ** 0.5)
        return data + pos_embedding


# ----------------------------------------------------------- transformer_pt
class ProcessBlock(pt.nn.Module):
    def __init__(self, sequence, num_hidden):
        super().__init__()
        self.sequence = sequence
        self.layer_norm = pt.nn.LayerNorm(num_hidden, eps=1e-06) if "n" in sequence else None

    def forward(self, data, prev=None):
        for step in self.sequence:
            if step == "r":
                data = data + prev
            elif step == "n":
                data = self.layer_norm(data)
        return data


class FeedForward(pt.nn.Module):
    def __init__(self, num_hidden, num_model):
        super().__init__()
        self.ff1 = pt.nn.Linear(num_model, num_hidden)
        self.ff2 = pt.nn.Linear(num_hidden, num_model)

    def forward(self, x):
        return self.ff2(pt.relu(self.ff1(x)))


class AutoRegressiveMask(pt.nn.Module):
    def forward(self, x):
        length = x.size()[1]
        mask = pt.full((length, length), fill_value=True, dtype=pt.bool, device=x.device)
        mask = pt.triu(mask, diagonal=1)
        return mask.unsqueeze(0)  # (1, length, length), True = future


class EncoderBlock(pt.nn.Module):
    def __init__(self):
        super().__init__()
        self.pre_self_attention = ProcessBlock("n", MODEL)
        self.self_attention = MultiHeadSelfAttention(MODEL, HEADS, MODEL)
        self.post_self_attention = ProcessBlock("r", MODEL)
        self.pre_ff = ProcessBlock("n", MODEL)
        self.ff = FeedForward(FF, MODEL)
        self.post_ff = ProcessBlock("r", MODEL)

    def forward(self, data, att_mask=None):
        data_self_att, _ = self.self_attention(inputs=self.pre_self_attention(data),
                                               previous_states=None, mask=att_mask)
        data = self.post_self_attention(data_self_att, data)
        data_ff = self.ff(self.pre_ff(data))
        return self.post_ff(data_ff, data)


class Encoder(pt.nn.Module):
    def __init__(self):
        super().__init__()
        self.embedding = pt.nn.Embedding(VOCAB, MODEL)
        self.pos_embedding = PositionalEmbeddings(MODEL, MAX_LEN)
        self.layers = pt.nn.ModuleList(EncoderBlock() for _ in range(LAYERS))
        self.final_process = ProcessBlock("n", MODEL)

    def forward(self, source, valid_length):
        data = self.pos_embedding(self.embedding(source))
        att_mask = prepare_source_length_mask(valid_length, HEADS, max_length=data.size()[1])
        data = data.transpose(1, 0)  # (seq_len, batch, model_size)
        for layer in self.layers:
            data = layer(data, att_mask=att_mask)
        data = self.final_process(data)
        return data.transpose(1, 0), valid_length


class DecoderBlock(pt.nn.Module):
    def __init__(self):
        super().__init__()
        self.autoregr_layer = MultiHeadSelfAttention(MODEL, HEADS, MODEL)
        self.pre_autoregr_layer = ProcessBlock("n", MODEL)
        self.post_autoregr_layer = ProcessBlock("r", MODEL)
        self.pre_enc_attention = ProcessBlock("n", MODEL)
        self.enc_attention = MultiHeadAttention(MODEL, HEADS, MODEL, MODEL)
        self.post_enc_attention = ProcessBlock("r", MODEL)
        self.pre_ff = ProcessBlock("n", MODEL)
        self.ff = FeedForward(FF, MODEL)
        self.post_ff = ProcessBlock("r", MODEL)

    def get_states_shape(self, batch_size):
        return self.autoregr_layer.get_state_shape(batch_size)

    def forward(self, target, target_mask, source, source_mask, autoregr_states, enc_att_kv=None):
        target_autoregr, new_state = self.autoregr_layer(inputs=self.pre_autoregr_layer(target),
                                                         previous_states=autoregr_states,
                                                         mask=target_mask)
        target = self.post_autoregr_layer(target_autoregr, target)
        target_enc_att = self.enc_attention(queries=self.pre_enc_attention(target), key_values=source,
                                            mask=source_mask, projected_memory_kv=enc_att_kv)
        target = self.post_enc_attention(target_enc_att, target)
        target_ff = self.ff(self.pre_ff(target))
        target = self.post_ff(target_ff, target)
        return target, new_state


class TransformerDecoder(pt.nn.Module):
    def __init__(self, inference_only):
        super().__init__()
        self.inference_only = inference_only
        self.pos_embedding = PositionalEmbeddings(MODEL, MAX_LEN)
        self.autoregressive_mask = AutoRegressiveMask()
        self.layers = pt.nn.ModuleList(DecoderBlock() for _ in range(LAYERS))
        self.final_process = ProcessBlock("n", MODEL)

    def state_structure(self):
        # s: step, b: source mask, e: encoder, d: decoder
        if self.inference_only:
            return "s" + "b" + "e" * LAYERS + "d" * LAYERS
        return "s" + "e" + "b" + "d" * LAYERS

    def init_state_from_encoder(self, encoder_outputs, encoder_valid_length, target_embed=None):
        if target_embed is None:
            steps = pt.zeros_like(encoder_valid_length).unsqueeze(1)
        else:
            steps = pt.arange(0, target_embed.size()[1]).unsqueeze(0)
        source_max_len = encoder_outputs.size()[1]
        source_mask = prepare_source_length_mask(encoder_valid_length, HEADS,
                                                 source_max_len).view(-1, HEADS, source_max_len)
        if self.inference_only:
            states = [steps, source_mask]
            for layer in self.layers:
                states.append(layer.enc_attention.ff_kv(encoder_outputs).transpose(1, 0))
        else:
            states = [steps, encoder_outputs.transpose(1, 0), source_mask]
        b = encoder_outputs.size()[0]
        states += [pt.zeros(layer.get_states_shape(b), dtype=encoder_outputs.dtype) for layer in self.layers]
        return states

    def forward(self, step_input, states):
        target_mask = None
        if self.inference_only:
            steps, source_mask, *other = states
            source_encoded = None
            enc_att_kv = other[:LAYERS]
            autoregr_states = other[LAYERS:]
        else:
            target_mask = self.autoregressive_mask(step_input)
            steps, source_encoded, source_mask, *autoregr_states = states
            enc_att_kv = [None] * LAYERS

        batch, heads, source_max_len = source_mask.size()
        source_mask_view = source_mask.view(batch * heads, 1, source_max_len)

        target = self.pos_embedding(step_input, steps)
        target = target.transpose(1, 0)

        new_autoregr_states = []
        for layer, layer_state, layer_kv in zip(self.layers, autoregr_states, enc_att_kv):
            target, new_state = layer(target=target, target_mask=target_mask, source=source_encoded,
                                      source_mask=source_mask_view, autoregr_states=layer_state,
                                      enc_att_kv=layer_kv)
            new_autoregr_states.append(new_state)
        target = self.final_process(target).transpose(1, 0)
        steps = steps + 1
        if self.inference_only:
            new_states = [steps, states[1]] + list(states[2:2 + LAYERS]) + new_autoregr_states
        else:
            new_states = [steps, states[1], states[2]] + new_autoregr_states
        return target, new_states


class Model(pt.nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = Encoder()
        self.target_embed = pt.nn.Embedding(VOCAB, MODEL)
        self.decoder = TransformerDecoder(inference_only=True)
        self.train_decoder = TransformerDecoder(inference_only=False)
        self.train_decoder.load_state_dict(self.decoder.state_dict())
        self.output_layer = pt.nn.Linear(MODEL, VOCAB)

    def decode_step(self, step_input, states):
        out, states = self.decoder(self.target_embed(step_input), states)
        return self.output_layer(out[:, -1]), states

    def teacher_forced_logits(self, source, source_length, target):
        enc, enc_len = self.encoder(source, source_length)
        tgt = self.target_embed(target)
        states = self.train_decoder.init_state_from_encoder(enc, enc_len, target_embed=tgt)
        out, _ = self.train_decoder(tgt, states)
        return self.output_layer(out)


# ------------------------------------------------------------ beam_search_pt
def repeat_states(states, beam_size, structure):
    out = []
    for state, fmt in zip(states, structure):
        if fmt in ("s", "b"):
            out.append(state.repeat_interleave(beam_size, dim=0))
        else:  # 'e' / 'd' are time-major: batch is dim 1
            out.append(state.repeat_interleave(beam_size, dim=1))
    return out


def sort_states(states, best_hyp_indices, structure):
    out = []
    for state, fmt in zip(states, structure):
        if fmt == "d":
            out.append(state.index_select(1, best_hyp_indices))
        elif fmt == "s":
            out.append(state.index_select(0, best_hyp_indices))
        else:  # source mask / encoder projections are identical across a sentence's beams
            out.append(state)
    return out


@pt.no_grad()
def beam_search(model, source, source_length, beam_size, steps):
    batch = source.size(0)
    enc, enc_len = model.encoder(source, source_length)
    states = model.decoder.init_state_from_encoder(enc, enc_len)
    structure = model.decoder.state_structure()
    states = repeat_states(states, beam_size, structure)

    offset = pt.arange(0, batch * beam_size, beam_size).repeat_interleave(beam_size)
    best_word_indices = pt.full((batch * beam_size,), BOS, dtype=pt.long)
    # negative log-prob scores; at step 0 only the first beam of each sentence is alive
    scores_accumulated = pt.zeros(batch * beam_size, 1)
    first_step_mask = pt.full((batch * beam_size, 1), float("inf"))
    first_step_mask[::beam_size] = 0.0
    history_words = []
    history_hyps = []
    for t in range(steps):
        logits, states = model.decode_step(best_word_indices.unsqueeze(1), states)
        nll = -pt.log_softmax(logits, dim=-1)
        scores = nll + scores_accumulated
        if t == 0:
            scores = scores + first_step_mask
        flat = scores.view(batch, beam_size * VOCAB)
        values, idx = pt.topk(flat, beam_size, dim=1, largest=False)
        best_hyp_indices = (idx // VOCAB).view(-1) + offset
        best_word_indices = (idx % VOCAB).view(-1)
        scores_accumulated = values.view(-1, 1)
        states = sort_states(states, best_hyp_indices, structure)
        history_words.append(best_word_indices)
        history_hyps.append(best_hyp_indices)

    # backtrack
    seqs = pt.zeros(batch * beam_size, steps, dtype=pt.long)
    cur = pt.arange(batch * beam_size)
    for t in range(steps - 1, -1, -1):
        seqs[:, t] = history_words[t][cur]
        cur = history_hyps[t][cur]
    seqs = seqs.view(batch, beam_size, steps)
    return seqs, scores_accumulated.view(batch, beam_size)


def main():
    model = Model().eval()
    with pt.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                pt.nn.init.normal_(p, std=0.5)
        # the training-mode decoder (autoregressive mask, no caching) shares the weights
        model.train_decoder.load_state_dict(model.decoder.state_dict())

    srcs = [[5, 7, 3, 9, 4, 11, 6], [8, 3, 10], [4, 12, 5, 6, 7], [9]]
    lengths = pt.tensor([len(s) for s in srcs])
    T = int(lengths.max())
    source = pt.full((len(srcs), T), PAD, dtype=pt.long)
    for i, s in enumerate(srcs):
        source[i, :len(s)] = pt.tensor(s)

    ok = True
    beam, steps = 3, 6

    # (3) encoder: padded batch vs each source alone
    with pt.no_grad():
        enc_b, _ = model.encoder(source, lengths)
        for i, s in enumerate(srcs):
            enc_1, _ = model.encoder(pt.tensor([s]), pt.tensor([len(s)]))
            d = (enc_b[i, :len(s)] - enc_1[0]).abs().max().item()
            ok &= d < 1e-4
    print(f"encoder padded vs alone: {'match' if ok else 'MISMATCH'}")

    # (1) beam search: batched padded vs alone
    seqs_b, scores_b = beam_search(model, source, lengths, beam, steps)
    bs_ok = True
    for i, s in enumerate(srcs):
        seqs_1, scores_1 = beam_search(model, pt.tensor([s]), pt.tensor([len(s)]), beam, steps)
        bs_ok &= bool(pt.equal(seqs_b[i], seqs_1[0]))
        bs_ok &= bool(pt.allclose(scores_b[i], scores_1[0], atol=1e-4))
    print(f"beam search padded batch vs alone: {'match' if bs_ok else 'MISMATCH'}")
    ok &= bs_ok

    # (2) cached step decoding == teacher-forced pass with the autoregressive mask
    with pt.no_grad():
        best = seqs_b[:, 0]  # (batch, steps)
        tgt_in = pt.cat([pt.full((len(srcs), 1), BOS, dtype=pt.long), best[:, :-1]], dim=1)
        tf_logits = model.teacher_forced_logits(source, lengths, tgt_in)
        enc, enc_len = model.encoder(source, lengths)
        states = model.decoder.init_state_from_encoder(enc, enc_len)
        step_logits = []
        for t in range(steps):
            lg, states = model.decode_step(tgt_in[:, t:t + 1], states)
            step_logits.append(lg)
        step_logits = pt.stack(step_logits, dim=1)
        tf_ok = (tf_logits - step_logits).abs().max().item() < 1e-4
    print(f"cached steps vs teacher-forced autoregressive mask: {'match' if tf_ok else 'MISMATCH'}")
    ok &= tf_ok

    print("ALL MATCH" if ok else "MISMATCH")
    assert ok


if __name__ == "__main__":
    main()
