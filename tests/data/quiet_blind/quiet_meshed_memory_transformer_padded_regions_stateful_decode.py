"""Meshed-Memory Transformer (M2, image captioning), ported from
aimagelab/meshed-memory-transformer @5d0600917850756d8edba64dee38458a84b64907:
models/containers.py (Module's register_state / statefulness), models/transformer/
attention.py (ScaledDotProductAttention, ScaledDotProductAttentionMemory,
MultiHeadAttention with running_keys / running_values), encoders.py (MultiLevelEncoder,
MemoryAugmentedEncoder), decoders.py (MeshedDecoderLayer, MeshedDecoder),
transformer.py (Transformer.forward / step), utils.py (sinusoid table, PWFF).

Masks, all built by hand as the project builds them:
- encoder: detection regions zero-padded to the batch's widest image; the key mask
  (b_s, 1, 1, n_regions) is True where a region's features sum to padding_idx (0).
  The memory slots (m_k, m_v) are appended after the regions and never masked. The
  released encoder reads that sum after its fc + ReLU + LayerNorm, where a padded row
  is no longer zero; this port reads it from the raw detections before the projection
  (the mask the comment "input (b_s, seq_len, d_in)" describes) and hands it on.
- decoder: captions "<bos> words <eos>" right-padded with <pad> (id 1, as the
  torchtext field gives it); self-attention mask = triu(diagonal=1) OR key is <pad>;
  mask_queries zeroes padded rows after each sublayer; positions 1..L with 0 on pads.
  Every cross-attention to the three encoder levels uses the encoder's region mask.
- stateful decoding (what BeamSearch drives): one token per step, running_keys /
  running_values grow per self-attention, running_mask_self_attention is extended
  with each step's (b_s, 1, 1, 1) mask, running_seq counts the position.
  (The state's default mask is a bool tensor here; the original's uint8 state mask
  predates torch's bool-only masked_fill.)

Tiny sizes, random weights, CPU, no download.

Reference: every image run alone with only its real regions and its caption without
pads (teacher-forced log-probs compared at real positions, and the XE loss of the
padded batch against the per-caption NLL summed in a double loop), and each image
captioned by a greedy loop that reruns the whole prefix without state at every step.
"""
from contextlib import contextmanager

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

PAD_IDX, BOS_IDX, EOS_IDX = 1, 2, 3   # torchtext vocab: <unk>=0, <pad>=1, <bos>=2, <eos>=3


# ---- models/containers.py ------------------------------------------------------------
class Module(nn.Module):
    def __init__(self):
        super(Module, self).__init__()
        self._is_stateful = False
        self._state_names = []
        self._state_defaults = dict()

    def register_state(self, name, default):
        self._state_names.append(name)
        if default is None:
            self._state_defaults[name] = None
        else:
            self._state_defaults[name] = default.clone().detach()
        self.register_buffer(name, default)

    def _init_states(self, batch_size):
        for name in self._state_names:
            if self._state_defaults[name] is None:
                self._buffers[name] = None
            else:
                self._buffers[name] = self._state_defaults[name].clone().detach().to(self._buffers[name].device)
                self._buffers[name] = self._buffers[name].unsqueeze(0)
                self._buffers[name] = self._buffers[name].expand([batch_size, ] + list(self._buffers[name].shape[1:]))
                self._buffers[name] = self._buffers[name].contiguous()

    def _reset_states(self):
        for name in self._state_names:
            if self._state_defaults[name] is None:
                self._buffers[name] = None
            else:
                self._buffers[name] = self._state_defaults[name].clone().detach().to(self._buffers[name].device)

    def enable_statefulness(self, batch_size):
        for m in self.children():
            if isinstance(m, Module):
                m.enable_statefulness(batch_size)
        self._init_states(batch_size)
        self._is_stateful = True

    def disable_statefulness(self):
        for m in self.children():
            if isinstance(m, Module):
                m.disable_statefulness()
        self._reset_states()
        self._is_stateful = False

    @contextmanager
    def statefulness(self, batch_size):
        self.enable_statefulness(batch_size)
        try:
            yield
        finally:
            self.disable_statefulness()


class ModuleList(nn.ModuleList, Module):
    pass


# ---- models/transformer/utils.py -----------------------------------------------------
def position_embedding(input, d_model):
    input = input.view(-1, 1)
    dim = torch.arange(d_model // 2, dtype=torch.float32, device=input.device).view(1, -1)
    sin = torch.sin(input / 10000 ** (2 * dim / d_model))
    cos = torch.cos(input / 10000 ** (2 * dim / d_model))
    out = torch.zeros((input.shape[0], d_model), device=input.device)
    out[:, ::2] = sin
    out[:, 1::2] = cos
    return out


def sinusoid_encoding_table(max_len, d_model, padding_idx=None):
    pos = torch.arange(max_len, dtype=torch.float32)
    out = position_embedding(pos, d_model)
    if padding_idx is not None:
        out[padding_idx] = 0
    return out


class PositionWiseFeedForward(nn.Module):
    def __init__(self, d_model=512, d_ff=2048, dropout=.1):
        super(PositionWiseFeedForward, self).__init__()
        self.fc1 = nn.Linear(d_model, d_ff)
        self.fc2 = nn.Linear(d_ff, d_model)
        self.dropout = nn.Dropout(p=dropout)
        self.dropout_2 = nn.Dropout(p=dropout)
        self.layer_norm = nn.LayerNorm(d_model)

    def forward(self, input):
        out = self.fc2(self.dropout_2(F.relu(self.fc1(input))))
        out = self.dropout(out)
        out = self.layer_norm(input + out)
        return out


# ---- models/transformer/attention.py -------------------------------------------------
class ScaledDotProductAttention(nn.Module):
    def __init__(self, d_model, d_k, d_v, h):
        super(ScaledDotProductAttention, self).__init__()
        self.fc_q = nn.Linear(d_model, h * d_k)
        self.fc_k = nn.Linear(d_model, h * d_k)
        self.fc_v = nn.Linear(d_model, h * d_v)
        self.fc_o = nn.Linear(h * d_v, d_model)
        self.d_model, self.d_k, self.d_v, self.h = d_model, d_k, d_v, h

    def forward(self, queries, keys, values, attention_mask=None, attention_weights=None):
        # attention_mask: (b_s, h or 1, nq, nk), True indicates masking
        b_s, nq = queries.shape[:2]
        nk = keys.shape[1]
        q = self.fc_q(queries).view(b_s, nq, self.h, self.d_k).permute(0, 2, 1, 3)  # (b_s, h, nq, d_k)
        k = self.fc_k(keys).view(b_s, nk, self.h, self.d_k).permute(0, 2, 3, 1)  # (b_s, h, d_k, nk)
        v = self.fc_v(values).view(b_s, nk, self.h, self.d_v).permute(0, 2, 1, 3)  # (b_s, h, nk, d_v)

        att = torch.matmul(q, k) / np.sqrt(self.d_k)  # (b_s, h, nq, nk)
        if attention_weights is not None:
            att = att * attention_weights
        if attention_mask is not None:
            att = att.masked_fill(attention_mask, -np.inf)
        att = torch.softmax(att, -1)
        out = torch.matmul(att, v).permute(0, 2, 1, 3).contiguous().view(b_s, nq, self.h * self.d_v)
        return self.fc_o(out)


class ScaledDotProductAttentionMemory(nn.Module):
    def __init__(self, d_model, d_k, d_v, h, m):
        super(ScaledDotProductAttentionMemory, self).__init__()
        self.fc_q = nn.Linear(d_model, h * d_k)
        self.fc_k = nn.Linear(d_model, h * d_k)
        self.fc_v = nn.Linear(d_model, h * d_v)
        self.fc_o = nn.Linear(h * d_v, d_model)
        self.m_k = nn.Parameter(torch.FloatTensor(1, m, h * d_k))
        self.m_v = nn.Parameter(torch.FloatTensor(1, m, h * d_v))
        self.d_model, self.d_k, self.d_v, self.h, self.m = d_model, d_k, d_v, h, m
        nn.init.normal_(self.m_k, 0, 1 / self.d_k)
        nn.init.normal_(self.m_v, 0, 1 / self.m)

    def forward(self, queries, keys, values, attention_mask=None, attention_weights=None):
        b_s, nq = queries.shape[:2]
        nk = keys.shape[1]

        m_k = np.sqrt(self.d_k) * self.m_k.expand(b_s, self.m, self.h * self.d_k)
        m_v = np.sqrt(self.m) * self.m_v.expand(b_s, self.m, self.h * self.d_v)

        q = self.fc_q(queries).view(b_s, nq, self.h, self.d_k).permute(0, 2, 1, 3)
        k = torch.cat([self.fc_k(keys), m_k], 1).view(b_s, nk + self.m, self.h, self.d_k).permute(0, 2, 3, 1)
        v = torch.cat([self.fc_v(values), m_v], 1).view(b_s, nk + self.m, self.h, self.d_v).permute(0, 2, 1, 3)

        att = torch.matmul(q, k) / np.sqrt(self.d_k)  # (b_s, h, nq, nk + m)
        if attention_weights is not None:
            att = torch.cat([att[:, :, :, :nk] * attention_weights, att[:, :, :, nk:]], -1)
        if attention_mask is not None:
            att[:, :, :, :nk] = att[:, :, :, :nk].masked_fill(attention_mask, -np.inf)
        att = torch.softmax(att, -1)
        out = torch.matmul(att, v).permute(0, 2, 1, 3).contiguous().view(b_s, nq, self.h * self.d_v)
        return self.fc_o(out)


class MultiHeadAttention(Module):
    def __init__(self, d_model, d_k, d_v, h, dropout=.1, can_be_stateful=False,
                 attention_module=None, attention_module_kwargs=None):
        super(MultiHeadAttention, self).__init__()
        if attention_module is not None:
            kwargs = attention_module_kwargs or {}
            self.attention = attention_module(d_model=d_model, d_k=d_k, d_v=d_v, h=h, **kwargs)
        else:
            self.attention = ScaledDotProductAttention(d_model=d_model, d_k=d_k, d_v=d_v, h=h)
        self.dropout = nn.Dropout(p=dropout)
        self.layer_norm = nn.LayerNorm(d_model)

        self.can_be_stateful = can_be_stateful
        if self.can_be_stateful:
            self.register_state('running_keys', torch.zeros((0, d_model)))
            self.register_state('running_values', torch.zeros((0, d_model)))

    def forward(self, queries, keys, values, attention_mask=None, attention_weights=None):
        if self.can_be_stateful and self._is_stateful:
            self.running_keys = torch.cat([self.running_keys, keys], 1)
            keys = self.running_keys

            self.running_values = torch.cat([self.running_values, values], 1)
            values = self.running_values

        out = self.attention(queries, keys, values, attention_mask, attention_weights)
        out = self.dropout(out)
        out = self.layer_norm(queries + out)
        return out


# ---- models/transformer/encoders.py --------------------------------------------------
class EncoderLayer(nn.Module):
    def __init__(self, d_model=512, d_k=64, d_v=64, h=8, d_ff=2048, dropout=.1,
                 attention_module=None, attention_module_kwargs=None):
        super(EncoderLayer, self).__init__()
        self.mhatt = MultiHeadAttention(d_model, d_k, d_v, h, dropout,
                                        attention_module=attention_module,
                                        attention_module_kwargs=attention_module_kwargs)
        self.pwff = PositionWiseFeedForward(d_model, d_ff, dropout)

    def forward(self, queries, keys, values, attention_mask=None, attention_weights=None):
        att = self.mhatt(queries, keys, values, attention_mask, attention_weights)
        return self.pwff(att)


class MultiLevelEncoder(nn.Module):
    def __init__(self, N, padding_idx, d_model=512, d_k=64, d_v=64, h=8, d_ff=2048, dropout=.1,
                 attention_module=None, attention_module_kwargs=None):
        super(MultiLevelEncoder, self).__init__()
        self.d_model = d_model
        self.dropout = dropout
        self.layers = nn.ModuleList([EncoderLayer(d_model, d_k, d_v, h, d_ff, dropout,
                                                  attention_module=attention_module,
                                                  attention_module_kwargs=attention_module_kwargs)
                                     for _ in range(N)])
        self.padding_idx = padding_idx

    def forward(self, input, attention_mask, attention_weights=None):
        # input (b_s, seq_len, d_model); attention_mask (b_s, 1, 1, seq_len)
        outs = []
        out = input
        for l in self.layers:
            out = l(out, out, out, attention_mask, attention_weights)
            outs.append(out.unsqueeze(1))

        outs = torch.cat(outs, 1)
        return outs, attention_mask


class MemoryAugmentedEncoder(MultiLevelEncoder):
    def __init__(self, N, padding_idx, d_in=2048, **kwargs):
        super(MemoryAugmentedEncoder, self).__init__(N, padding_idx, **kwargs)
        self.fc = nn.Linear(d_in, self.d_model)
        self.dropout = nn.Dropout(p=self.dropout)
        self.layer_norm = nn.LayerNorm(self.d_model)

    def forward(self, input, attention_weights=None):
        # input (b_s, seq_len, d_in): detections, zero rows past each image's last region
        attention_mask = (torch.sum(input, -1) == self.padding_idx).unsqueeze(1).unsqueeze(1)  # (b_s, 1, 1, seq_len)
        out = F.relu(self.fc(input))
        out = self.dropout(out)
        out = self.layer_norm(out)
        return super(MemoryAugmentedEncoder, self).forward(out, attention_mask, attention_weights=attention_weights)


# ---- models/transformer/decoders.py --------------------------------------------------
class MeshedDecoderLayer(Module):
    def __init__(self, d_model=512, d_k=64, d_v=64, h=8, d_ff=2048, dropout=.1):
        super(MeshedDecoderLayer, self).__init__()
        self.self_att = MultiHeadAttention(d_model, d_k, d_v, h, dropout, can_be_stateful=True)
        self.enc_att = MultiHeadAttention(d_model, d_k, d_v, h, dropout, can_be_stateful=False)
        self.pwff = PositionWiseFeedForward(d_model, d_ff, dropout)

        self.fc_alpha1 = nn.Linear(d_model + d_model, d_model)
        self.fc_alpha2 = nn.Linear(d_model + d_model, d_model)
        self.fc_alpha3 = nn.Linear(d_model + d_model, d_model)

    def forward(self, input, enc_output, mask_pad, mask_self_att, mask_enc_att):
        self_att = self.self_att(input, input, input, mask_self_att)
        self_att = self_att * mask_pad

        enc_att1 = self.enc_att(self_att, enc_output[:, 0], enc_output[:, 0], mask_enc_att) * mask_pad
        enc_att2 = self.enc_att(self_att, enc_output[:, 1], enc_output[:, 1], mask_enc_att) * mask_pad
        enc_att3 = self.enc_att(self_att, enc_output[:, 2], enc_output[:, 2], mask_enc_att) * mask_pad

        alpha1 = torch.sigmoid(self.fc_alpha1(torch.cat([self_att, enc_att1], -1)))
        alpha2 = torch.sigmoid(self.fc_alpha2(torch.cat([self_att, enc_att2], -1)))
        alpha3 = torch.sigmoid(self.fc_alpha3(torch.cat([self_att, enc_att3], -1)))

        enc_att = (enc_att1 * alpha1 + enc_att2 * alpha2 + enc_att3 * alpha3) / np.sqrt(3)
        enc_att = enc_att * mask_pad

        ff = self.pwff(enc_att)
        ff = ff * mask_pad
        return ff


class MeshedDecoder(Module):
    def __init__(self, vocab_size, max_len, N_dec, padding_idx, d_model=512, d_k=64, d_v=64, h=8, d_ff=2048,
                 dropout=.1):
        super(MeshedDecoder, self).__init__()
        self.d_model = d_model
        self.word_emb = nn.Embedding(vocab_size, d_model, padding_idx=padding_idx)
        self.pos_emb = nn.Embedding.from_pretrained(sinusoid_encoding_table(max_len + 1, d_model, 0), freeze=True)
        self.layers = ModuleList([MeshedDecoderLayer(d_model, d_k, d_v, h, d_ff, dropout) for _ in range(N_dec)])
        self.fc = nn.Linear(d_model, vocab_size, bias=False)
        self.max_len = max_len
        self.padding_idx = padding_idx
        self.N = N_dec

        self.register_state('running_mask_self_attention', torch.zeros((1, 1, 0)).bool())
        self.register_state('running_seq', torch.zeros((1,)).long())

    def forward(self, input, encoder_output, mask_encoder):
        # input (b_s, seq_len)
        b_s, seq_len = input.shape[:2]
        mask_queries = (input != self.padding_idx).unsqueeze(-1).float()  # (b_s, seq_len, 1)
        mask_self_attention = torch.triu(torch.ones((seq_len, seq_len), dtype=torch.uint8, device=input.device),
                                         diagonal=1)
        mask_self_attention = mask_self_attention.unsqueeze(0).unsqueeze(0)  # (1, 1, seq_len, seq_len)
        mask_self_attention = mask_self_attention + (input == self.padding_idx).unsqueeze(1).unsqueeze(1).byte()
        mask_self_attention = mask_self_attention.gt(0)  # (b_s, 1, seq_len, seq_len)
        if self._is_stateful:
            self.running_mask_self_attention = torch.cat([self.running_mask_self_attention, mask_self_attention], -1)
            mask_self_attention = self.running_mask_self_attention

        seq = torch.arange(1, seq_len + 1).view(1, -1).expand(b_s, -1).to(input.device)  # (b_s, seq_len)
        seq = seq.masked_fill(mask_queries.squeeze(-1) == 0, 0)
        if self._is_stateful:
            self.running_seq.add_(1)
            seq = self.running_seq

        out = self.word_emb(input) + self.pos_emb(seq)
        for i, l in enumerate(self.layers):
            out = l(out, encoder_output, mask_queries, mask_self_attention, mask_encoder)

        out = self.fc(out)
        return F.log_softmax(out, dim=-1)


# ---- models/transformer/transformer.py -----------------------------------------------
class Transformer(Module):
    def __init__(self, bos_idx, encoder, decoder):
        super(Transformer, self).__init__()
        self.bos_idx = bos_idx
        self.encoder = encoder
        self.decoder = decoder
        self.register_state('enc_output', None)
        self.register_state('mask_enc', None)
        self.init_weights()

    def init_weights(self):
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.xavier_uniform_(p)

    def forward(self, images, seq, *args):
        enc_output, mask_enc = self.encoder(images)
        dec_output = self.decoder(seq, enc_output, mask_enc)
        return dec_output

    def step(self, t, prev_output, visual, seq, mode='feedback', **kwargs):
        if t == 0:
            self.enc_output, self.mask_enc = self.encoder(visual)
            it = visual.data.new_full((visual.shape[0], 1), self.bos_idx).long()
        else:
            it = prev_output
        return self.decoder(it, self.enc_output, self.mask_enc)


# ---- train.py / test.py (shrunk) -----------------------------------------------------
D_IN, VOCAB, MAX_LEN = 24, 40, 20


def build_model():
    torch.manual_seed(0)
    encoder = MemoryAugmentedEncoder(3, 0, d_in=D_IN, d_model=32, d_k=8, d_v=8, h=4, d_ff=64,
                                     attention_module=ScaledDotProductAttentionMemory,
                                     attention_module_kwargs={'m': 4})
    decoder = MeshedDecoder(VOCAB, MAX_LEN, 3, PAD_IDX, d_model=32, d_k=8, d_v=8, h=4, d_ff=64)
    return Transformer(BOS_IDX, encoder, decoder).eval()


def make_batch():
    g = torch.Generator().manual_seed(1)
    n_regions = [7, 4, 10]
    images = [torch.rand(n, D_IN, generator=g) + 0.1 for n in n_regions]
    lengths = [6, 9, 4]  # words between <bos> and <eos>
    words = [torch.randint(4, VOCAB, (n,), generator=g) for n in lengths]
    captions = [torch.cat([torch.tensor([BOS_IDX]), w, torch.tensor([EOS_IDX])]) for w in words]

    # data/field.py ImageDetectionsField pads detections with zero rows; TextField pads with <pad>
    max_r = max(n_regions)
    detections = torch.zeros(len(images), max_r, D_IN)
    for i, im in enumerate(images):
        detections[i, :im.shape[0]] = im
    max_c = max(c.numel() for c in captions)
    padded = torch.full((len(captions), max_c), PAD_IDX, dtype=torch.long)
    for i, c in enumerate(captions):
        padded[i, :c.numel()] = c
    return images, captions, detections, padded


def greedy_stateful(model, visual, max_len):
    # as BeamSearch drives Transformer.step (beam size 1): the state holds every past key
    b_s = visual.shape[0]
    tokens, logps = [], []
    with model.statefulness(b_s):
        prev = None
        for t in range(max_len):
            word_logprob = model.step(t, prev, visual, None, mode='feedback')  # (b_s, 1, vocab)
            lp, prev = word_logprob[:, -1].max(-1)
            prev = prev.unsqueeze(-1)
            tokens.append(prev)
            logps.append(lp)
    return torch.cat(tokens, 1), torch.stack(logps, 1)


def greedy_reference(model, image, max_len):
    # one image, its real regions only, the whole prefix rerun with no state
    seq = torch.tensor([[BOS_IDX]])
    logps = []
    for _ in range(max_len):
        out = model(image.unsqueeze(0), seq)[:, -1]
        lp, nxt = out.max(-1)
        logps.append(lp)
        seq = torch.cat([seq, nxt.view(1, 1)], 1)
    return seq[0, 1:], torch.cat(logps)


def main():
    model = build_model()
    images, captions, detections, padded = make_batch()
    atol = 1e-5

    with torch.no_grad():
        # teacher forcing, as train.py's XE step: out = model(detections, captions[:, :-1])
        dec_in, target = padded[:, :-1].contiguous(), padded[:, 1:].contiguous()
        out = model(detections, dec_in)
        loss_fn = nn.NLLLoss(ignore_index=PAD_IDX)
        loss = loss_fn(out.view(-1, VOCAB), target.view(-1))

        total, count = 0.0, 0
        for i, (im, cap) in enumerate(zip(images, captions)):
            alone = model(im.unsqueeze(0), cap[:-1].unsqueeze(0))[0]  # (len - 1, vocab)
            n = alone.shape[0]
            assert torch.allclose(out[i, :n], alone, atol=atol), f"caption {i}: log-probs differ from its run alone"
            for p in range(n):
                total += -alone[p, cap[p + 1]].item()
                count += 1
        ref_loss = total / count
        assert abs(loss.item() - ref_loss) < 1e-5, (loss.item(), ref_loss)
        print(f"teacher forcing: padded-batch XE {loss.item():.6f} == per-caption NLL {ref_loss:.6f}")

        # stateful greedy decoding over the padded detections
        steps = 8
        tokens, logps = greedy_stateful(model, detections, steps)
        for i, im in enumerate(images):
            ref_tokens, ref_logps = greedy_reference(model, im, steps)
            assert torch.equal(tokens[i], ref_tokens), (i, tokens[i].tolist(), ref_tokens.tolist())
            assert torch.allclose(logps[i], ref_logps, atol=atol), (i, logps[i], ref_logps)
            print(f"image {i} ({im.shape[0]} regions): {tokens[i].tolist()}")

    print("OK: padded regions, padded captions and the stateful decode match each image alone")


if __name__ == "__main__":
    main()
