"""CTranslate2-style beam search over right-padded sources (tiny, CPU, torch only).

Ported from OpenNMT/CTranslate2 @0d8bcd362ac75ef860ef161d6f0efad0ae439ff0:
  src/layers/attention_layer.cc + src/cpu/primitives.cc  (prepare_length_mask: an int32 mask of
      shape [batch, heads, num_queries] holding, per softmax row, how many keys are valid;
      mask_future -> min(length, query_index + 1))
  src/cpu/kernels.cc  (softmax with lengths: entries past the length are set to 0; a row of
      length 0 is left all zero)
  src/layers/transformer.cc  (TransformerEncoder: lengths mask, num_queries = max_time;
      TransformerDecoder::decode: memory_lengths kept per batch, NOT per beam:
      beam_size = batch_size / memory_lengths.dim(0) and the mask is built with
      num_queries = beam_size > 1 ? beam_size : max_time;  replicate_state: memory K/V are
      not replicated for each beam)
  src/layers/attention.cc  (process_cross_attention: beam_size = queries.dim(0) / cached_keys.dim(0),
      split_heads(queries, heads, padder, beam_size) folds the beams into the query-time axis,
      so one [batch, heads, beam, src] score block is masked by the [batch, heads, beam] lengths)
  src/decoding.cc  (BeamSearch: first step unexpanded, then state expanded to beam and gathered
      by beam origins each step)
Reference: each source translated alone (batch 1, no padding) with the same beam search.
"""
import math
import torch

torch.manual_seed(0)

D, H = 16, 4
DH = D // H
V = 20
BEAM = 3
MAX_LEN = 5
BOS = 1
PAD = 0


def prepare_length_mask(lengths, num_heads, num_queries, mask_future=False):
    b = lengths.numel()
    mask = torch.empty(b, num_heads, num_queries, dtype=torch.int32)
    i = torch.arange(num_heads * num_queries) % num_queries
    for bb in range(b):
        length = int(lengths[bb])
        row = torch.clamp(i + 1, max=length) if mask_future else torch.full_like(i, length)
        mask[bb] = row.view(num_heads, num_queries).to(torch.int32)
    return mask


def softmax_with_lengths(x, lengths):
    """x [..., depth]; lengths has x.shape[:-1] (flattened row order)."""
    depth = x.shape[-1]
    flat = x.reshape(-1, depth)
    lens = lengths.reshape(-1)
    assert lens.numel() == flat.shape[0]
    y = torch.zeros_like(flat)
    for r in range(flat.shape[0]):
        size = int(lens[r])
        if size == 0:
            continue
        y[r, :size] = torch.softmax(flat[r, :size], dim=-1)
    return y.view_as(x)


def split_heads(x, beam_size=1):
    # x [batch*beam, time, H*DH] -> [batch, H, beam*time, DH]
    bb, t, _ = x.shape
    if beam_size > 1:
        x = x.view(bb // beam_size, beam_size * t, H, DH)
    else:
        x = x.view(bb, t, H, DH)
    return x.transpose(1, 2)


def combine_heads(x, beam_size=1):
    b, _, bt, _ = x.shape
    x = x.transpose(1, 2).reshape(b, bt, H * DH)
    if beam_size > 1:
        x = x.reshape(b * beam_size, bt // beam_size, H * DH)
    return x


class MHA(torch.nn.Module):
    def __init__(self, self_attention):
        super().__init__()
        self.self_attention = self_attention
        self.q = torch.nn.Linear(D, D)
        self.kv = torch.nn.Linear(D, 2 * D)
        self.o = torch.nn.Linear(D, D)

    def forward(self, queries, values, values_lengths, cache=None, key=None):
        beam_size = 1
        qp = self.q(queries)
        if self.self_attention:
            k, v = self.kv(queries).chunk(2, dim=-1)
            k, v = split_heads(k), split_heads(v)
            if cache is not None:
                if key + "_k" in cache:
                    k = torch.cat([cache[key + "_k"], k], dim=2)
                    v = torch.cat([cache[key + "_v"], v], dim=2)
                cache[key + "_k"], cache[key + "_v"] = k, v
            q = split_heads(qp)
        else:
            if cache is None or key + "_k" not in cache:
                k, v = self.kv(values).chunk(2, dim=-1)
                k, v = split_heads(k), split_heads(v)
                if cache is not None:
                    cache[key + "_k"], cache[key + "_v"] = k, v
            else:
                k, v = cache[key + "_k"], cache[key + "_v"]
            if qp.shape[1] == 1 and cache is not None:
                beam_size = qp.shape[0] // k.shape[0]
            q = split_heads(qp, beam_size)
        scores = q @ k.transpose(-1, -2) / math.sqrt(DH)
        if values_lengths is not None:
            attn = softmax_with_lengths(scores, values_lengths)
        else:
            attn = torch.softmax(scores, dim=-1)
        return self.o(combine_heads(attn @ v, beam_size))


class Encoder(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(V, D)
        self.pos = torch.nn.Embedding(16, D)
        self.att = MHA(True)
        self.ff = torch.nn.Linear(D, D)

    def forward(self, ids, lengths):
        x = self.emb(ids) + self.pos(torch.arange(ids.shape[1]))[None]
        mask = prepare_length_mask(lengths, H, ids.shape[1])  # mask_future=False
        x = x + self.att(x, x, mask)
        return x + torch.tanh(self.ff(x))


class Decoder(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(V, D)
        self.pos = torch.nn.Embedding(16, D)
        self.self_att = MHA(True)
        self.cross = MHA(False)
        self.ff = torch.nn.Linear(D, D)
        self.out = torch.nn.Linear(D, V)

    def forward(self, step, ids, state):
        # ids is rank 1 (one token per row): no self-attention lengths, the cache is the history
        x = (self.emb(ids) + self.pos(torch.tensor([step]))).unsqueeze(1)
        batch_size = x.shape[0]
        memory_lengths = state["memory_lengths"]
        beam_size = batch_size // memory_lengths.shape[0]
        memory_lengths_mask = prepare_length_mask(memory_lengths, H,
                                                  beam_size if beam_size > 1 else x.shape[1])
        x = x + self.self_att(x, x, None, cache=state, key="self")
        x = x + self.cross(x, state["memory"], memory_lengths_mask, cache=state, key="memory")
        x = x + torch.tanh(self.ff(x))
        return torch.log_softmax(self.out(x[:, 0]), dim=-1)


def replicate_state(name):
    return not name.startswith("memory")  # memory, memory_lengths, memory_k/v stay per batch


@torch.no_grad()
def translate(encoder, decoder, src_ids, src_lengths):
    B = src_ids.shape[0]
    state = {"memory": encoder(src_ids, src_lengths), "memory_lengths": src_lengths}
    # step 0: unexpanded batch
    logp = decoder(0, torch.full((B,), BOS), state)                 # [B, V]
    scores, ids = logp.topk(BEAM, dim=-1)                           # [B, BEAM]
    for name in list(state):
        if replicate_state(name):
            state[name] = state[name].repeat_interleave(BEAM, dim=0)
    hyps = ids.unsqueeze(-1)
    for step in range(1, MAX_LEN):
        logp = decoder(step, hyps[:, :, -1].reshape(-1), state).view(B, BEAM, V)
        total = (scores.unsqueeze(-1) + logp).view(B, BEAM * V)
        scores, flat = total.topk(BEAM, dim=-1)
        origin, word = flat // V, flat % V
        gather_idx = (origin + torch.arange(B)[:, None] * BEAM).view(-1)
        for name in list(state):
            if replicate_state(name):
                state[name] = state[name].index_select(0, gather_idx)
        hyps = torch.cat([hyps.gather(1, origin.unsqueeze(-1).expand(-1, -1, hyps.shape[-1])),
                          word.unsqueeze(-1)], dim=-1)
    return hyps, scores


encoder, decoder = Encoder(), Decoder()
sources = [torch.randint(2, V, (n,)) for n in (3, 7, 5, 1)]
lengths = torch.tensor([len(s) for s in sources], dtype=torch.int32)
S = int(lengths.max())
src = torch.full((len(sources), S), PAD)
for i, s in enumerate(sources):
    src[i, :len(s)] = s   # right padding, as make_sequence_inputs does

hyps, scores = translate(encoder, decoder, src, lengths)

ok = True
for i, s in enumerate(sources):
    ref_h, ref_s = translate(encoder, decoder, s[None], torch.tensor([len(s)], dtype=torch.int32))
    same = torch.equal(ref_h[0], hyps[i]) and torch.allclose(ref_s[0], scores[i], atol=1e-5)
    print(f"source {i} (len {len(s)}): best={hyps[i, 0].tolist()} score={scores[i, 0]:.4f} "
          f"alone={ref_h[0, 0].tolist()} {ref_s[0, 0]:.4f} same={same}")
    ok &= same
print("matches reference:", ok)
assert ok
