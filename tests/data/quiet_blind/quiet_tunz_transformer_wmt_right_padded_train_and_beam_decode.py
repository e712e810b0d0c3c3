# Citation: tunz/transformer-pytorch @e7266679f0b32fd99135ea617213f986ceede056: utils/utils.py (create_pad_mask,
#   create_trg_self_mask, get_loss), model/transformer.py (MultiHeadAttention with its 'encdec_k'/'encdec_v' cache,
#   EncoderLayer, DecoderLayer, Encoder, Decoder, Transformer.forward / encode / decode / get_position_encoding),
#   train.py (train step) and decoder.py (main()'s beam search loop, encode_inputs, update_targets,
#   get_result_sentence); dataset/translation.py (torchtext Field batch_first=True, pad_token '<pad>', eos_token
#   '<eos>', specials unk/pad/eos -> ids 0/1/2), so sources and targets are right-padded with id 1 after '<eos>'.
# A WMT de->en Transformer: i_mask = (src == pad).unsqueeze(-2) [B,1,S] (True = pad) masks encoder self-attention
# and decoder cross-attention; t_self_mask = triu(ones, 1).unsqueeze(0) [1,T,T] masks the decoder's future;
# masked_fill_(mask.unsqueeze(1), -1e9) on the scores. The target's pad embeddings are zeroed, shifted right by one
# (a zero vector in front), and the loss keeps ans != pad only. Two changes for torch 2: create_trg_self_mask makes a
# bool tensor (masked_fill_ rejects uint8 now) and update_targets floors its division.
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)

UNK, PAD, EOS = 0, 1, 2


# ---------------------------------------------------------------- utils/utils.py
def get_loss(pred, ans, vocab_size, label_smoothing, pad):
    # took this "normalizing" from tensor2tensor. We subtract it for
    # readability. This makes no difference on learning.
    confidence = 1.0 - label_smoothing
    low_confidence = (1.0 - confidence) / float(vocab_size - 1)
    normalizing = -(
        confidence * math.log(confidence) + float(vocab_size - 1) *
        low_confidence * math.log(low_confidence + 1e-20))

    one_hot = torch.zeros_like(pred).scatter_(1, ans.unsqueeze(1), 1)
    one_hot = one_hot * confidence + (1 - one_hot) * low_confidence
    log_prob = F.log_softmax(pred, dim=1)

    xent = -(one_hot * log_prob).sum(dim=1)
    xent = xent.masked_select(ans != pad)
    loss = (xent - normalizing).mean()
    return loss


def create_pad_mask(t, pad):
    mask = (t == pad).unsqueeze(-2)
    return mask


def create_trg_self_mask(target_len, device=None):
    # Prevent leftward information flow in self-attention.
    ones = torch.ones(target_len, target_len, dtype=torch.bool,
                      device=device)
    t_self_mask = torch.triu(ones, diagonal=1).unsqueeze(0)

    return t_self_mask


# ---------------------------------------------------------------- model/transformer.py
def initialize_weight(x):
    nn.init.xavier_uniform_(x.weight)
    if x.bias is not None:
        nn.init.constant_(x.bias, 0)


class FeedForwardNetwork(nn.Module):
    def __init__(self, hidden_size, filter_size, dropout_rate):
        super(FeedForwardNetwork, self).__init__()

        self.layer1 = nn.Linear(hidden_size, filter_size)
        self.relu = nn.ReLU()
        self.dropout = nn.Dropout(dropout_rate)
        self.layer2 = nn.Linear(filter_size, hidden_size)

        initialize_weight(self.layer1)
        initialize_weight(self.layer2)

    def forward(self, x):
        x = self.layer1(x)
        x = self.relu(x)
        x = self.dropout(x)
        x = self.layer2(x)
        return x


class MultiHeadAttention(nn.Module):
    def __init__(self, hidden_size, dropout_rate, head_size=8):
        super(MultiHeadAttention, self).__init__()

        self.head_size = head_size

        self.att_size = att_size = hidden_size // head_size
        self.scale = att_size ** -0.5

        self.linear_q = nn.Linear(hidden_size, head_size * att_size, bias=False)
        self.linear_k = nn.Linear(hidden_size, head_size * att_size, bias=False)
        self.linear_v = nn.Linear(hidden_size, head_size * att_size, bias=False)
        initialize_weight(self.linear_q)
        initialize_weight(self.linear_k)
        initialize_weight(self.linear_v)

        self.att_dropout = nn.Dropout(dropout_rate)

        self.output_layer = nn.Linear(head_size * att_size, hidden_size,
                                      bias=False)
        initialize_weight(self.output_layer)

    def forward(self, q, k, v, mask, cache=None):
        orig_q_size = q.size()

        d_k = self.att_size
        d_v = self.att_size
        batch_size = q.size(0)

        # head_i = Attention(Q(W^Q)_i, K(W^K)_i, V(W^V)_i)
        q = self.linear_q(q).view(batch_size, -1, self.head_size, d_k)
        if cache is not None and 'encdec_k' in cache:
            k, v = cache['encdec_k'], cache['encdec_v']
        else:
            k = self.linear_k(k).view(batch_size, -1, self.head_size, d_k)
            v = self.linear_v(v).view(batch_size, -1, self.head_size, d_v)

            if cache is not None:
                cache['encdec_k'], cache['encdec_v'] = k, v

        q = q.transpose(1, 2)                  # [b, h, q_len, d_k]
        v = v.transpose(1, 2)                  # [b, h, v_len, d_v]
        k = k.transpose(1, 2).transpose(2, 3)  # [b, h, d_k, k_len]

        # Scaled Dot-Product Attention.
        # Attention(Q, K, V) = softmax((QK^T)/sqrt(d_k))V
        q.mul_(self.scale)
        x = torch.matmul(q, k)  # [b, h, q_len, k_len]
        x.masked_fill_(mask.unsqueeze(1), -1e9)
        x = torch.softmax(x, dim=3)
        x = self.att_dropout(x)
        x = x.matmul(v)  # [b, h, q_len, attn]

        x = x.transpose(1, 2).contiguous()  # [b, q_len, h, attn]
        x = x.view(batch_size, -1, self.head_size * d_v)

        x = self.output_layer(x)

        assert x.size() == orig_q_size
        return x


class EncoderLayer(nn.Module):
    def __init__(self, hidden_size, filter_size, dropout_rate):
        super(EncoderLayer, self).__init__()

        self.self_attention_norm = nn.LayerNorm(hidden_size, eps=1e-6)
        self.self_attention = MultiHeadAttention(hidden_size, dropout_rate)
        self.self_attention_dropout = nn.Dropout(dropout_rate)

        self.ffn_norm = nn.LayerNorm(hidden_size, eps=1e-6)
        self.ffn = FeedForwardNetwork(hidden_size, filter_size, dropout_rate)
        self.ffn_dropout = nn.Dropout(dropout_rate)

    def forward(self, x, mask):  # pylint: disable=arguments-differ
        y = self.self_attention_norm(x)
        y = self.self_attention(y, y, y, mask)
        y = self.self_attention_dropout(y)
        x = x + y

        y = self.ffn_norm(x)
        y = self.ffn(y)
        y = self.ffn_dropout(y)
        x = x + y
        return x


class DecoderLayer(nn.Module):
    def __init__(self, hidden_size, filter_size, dropout_rate):
        super(DecoderLayer, self).__init__()

        self.self_attention_norm = nn.LayerNorm(hidden_size, eps=1e-6)
        self.self_attention = MultiHeadAttention(hidden_size, dropout_rate)
        self.self_attention_dropout = nn.Dropout(dropout_rate)

        self.enc_dec_attention_norm = nn.LayerNorm(hidden_size, eps=1e-6)
        self.enc_dec_attention = MultiHeadAttention(hidden_size, dropout_rate)
        self.enc_dec_attention_dropout = nn.Dropout(dropout_rate)

        self.ffn_norm = nn.LayerNorm(hidden_size, eps=1e-6)
        self.ffn = FeedForwardNetwork(hidden_size, filter_size, dropout_rate)
        self.ffn_dropout = nn.Dropout(dropout_rate)

    def forward(self, x, enc_output, self_mask, i_mask, cache):
        y = self.self_attention_norm(x)
        y = self.self_attention(y, y, y, self_mask)
        y = self.self_attention_dropout(y)
        x = x + y

        if enc_output is not None:
            y = self.enc_dec_attention_norm(x)
            y = self.enc_dec_attention(y, enc_output, enc_output, i_mask,
                                       cache)
            y = self.enc_dec_attention_dropout(y)
            x = x + y

        y = self.ffn_norm(x)
        y = self.ffn(y)
        y = self.ffn_dropout(y)
        x = x + y
        return x


class Encoder(nn.Module):
    def __init__(self, hidden_size, filter_size, dropout_rate, n_layers):
        super(Encoder, self).__init__()

        encoders = [EncoderLayer(hidden_size, filter_size, dropout_rate)
                    for _ in range(n_layers)]
        self.layers = nn.ModuleList(encoders)

        self.last_norm = nn.LayerNorm(hidden_size, eps=1e-6)

    def forward(self, inputs, mask):
        encoder_output = inputs
        for enc_layer in self.layers:
            encoder_output = enc_layer(encoder_output, mask)
        return self.last_norm(encoder_output)


class Decoder(nn.Module):
    def __init__(self, hidden_size, filter_size, dropout_rate, n_layers):
        super(Decoder, self).__init__()

        decoders = [DecoderLayer(hidden_size, filter_size, dropout_rate)
                    for _ in range(n_layers)]
        self.layers = nn.ModuleList(decoders)

        self.last_norm = nn.LayerNorm(hidden_size, eps=1e-6)

    def forward(self, targets, enc_output, i_mask, t_self_mask, cache):
        decoder_output = targets
        for i, dec_layer in enumerate(self.layers):
            layer_cache = None
            if cache is not None:
                if i not in cache:
                    cache[i] = {}
                layer_cache = cache[i]
            decoder_output = dec_layer(decoder_output, enc_output,
                                       t_self_mask, i_mask, layer_cache)
        return self.last_norm(decoder_output)


class Transformer(nn.Module):
    def __init__(self, i_vocab_size, t_vocab_size,
                 n_layers=6,
                 hidden_size=512,
                 filter_size=2048,
                 dropout_rate=0.1,
                 share_target_embedding=True,
                 has_inputs=True,
                 src_pad_idx=None,
                 trg_pad_idx=None):
        super(Transformer, self).__init__()

        self.hidden_size = hidden_size
        self.emb_scale = hidden_size ** 0.5
        self.has_inputs = has_inputs
        self.src_pad_idx = src_pad_idx
        self.trg_pad_idx = trg_pad_idx

        self.t_vocab_embedding = nn.Embedding(t_vocab_size, hidden_size)
        nn.init.normal_(self.t_vocab_embedding.weight, mean=0,
                        std=hidden_size**-0.5)
        self.t_emb_dropout = nn.Dropout(dropout_rate)
        self.decoder = Decoder(hidden_size, filter_size,
                               dropout_rate, n_layers)

        if has_inputs:
            if not share_target_embedding:
                self.i_vocab_embedding = nn.Embedding(i_vocab_size,
                                                      hidden_size)
                nn.init.normal_(self.i_vocab_embedding.weight, mean=0,
                                std=hidden_size**-0.5)
            else:
                self.i_vocab_embedding = self.t_vocab_embedding

            self.i_emb_dropout = nn.Dropout(dropout_rate)

            self.encoder = Encoder(hidden_size, filter_size,
                                   dropout_rate, n_layers)

        # For positional encoding
        num_timescales = self.hidden_size // 2
        max_timescale = 10000.0
        min_timescale = 1.0
        log_timescale_increment = (
            math.log(float(max_timescale) / float(min_timescale)) /
            max(num_timescales - 1, 1))
        inv_timescales = min_timescale * torch.exp(
            torch.arange(num_timescales, dtype=torch.float32) *
            -log_timescale_increment)
        self.register_buffer('inv_timescales', inv_timescales)

    def forward(self, inputs, targets):
        enc_output, i_mask = None, None
        if self.has_inputs:
            i_mask = create_pad_mask(inputs, self.src_pad_idx)
            enc_output = self.encode(inputs, i_mask)

        t_mask = create_pad_mask(targets, self.trg_pad_idx)
        target_size = targets.size()[1]
        t_self_mask = create_trg_self_mask(target_size,
                                           device=targets.device)
        return self.decode(targets, enc_output, i_mask, t_self_mask, t_mask)

    def encode(self, inputs, i_mask):
        # Input embedding
        input_embedded = self.i_vocab_embedding(inputs)
        input_embedded.masked_fill_(i_mask.squeeze(1).unsqueeze(-1), 0)
        input_embedded *= self.emb_scale
        input_embedded += self.get_position_encoding(inputs)
        input_embedded = self.i_emb_dropout(input_embedded)

        return self.encoder(input_embedded, i_mask)

    def decode(self, targets, enc_output, i_mask, t_self_mask, t_mask,
               cache=None):
        # target embedding
        target_embedded = self.t_vocab_embedding(targets)
        target_embedded.masked_fill_(t_mask.squeeze(1).unsqueeze(-1), 0)

        # Shifting
        target_embedded = target_embedded[:, :-1]
        target_embedded = F.pad(target_embedded, (0, 0, 1, 0))

        target_embedded *= self.emb_scale
        target_embedded += self.get_position_encoding(targets)
        target_embedded = self.t_emb_dropout(target_embedded)

        # decoder
        decoder_output = self.decoder(target_embedded, enc_output, i_mask,
                                      t_self_mask, cache)
        # linear
        output = torch.matmul(decoder_output,
                              self.t_vocab_embedding.weight.transpose(0, 1))

        return output

    def get_position_encoding(self, x):
        max_length = x.size()[1]
        position = torch.arange(max_length, dtype=torch.float32,
                                device=x.device)
        scaled_time = position.unsqueeze(1) * self.inv_timescales.unsqueeze(0)
        signal = torch.cat([torch.sin(scaled_time), torch.cos(scaled_time)],
                           dim=1)
        signal = F.pad(signal, (0, 0, 0, self.hidden_size % 2))
        signal = signal.view(1, max_length, self.hidden_size)
        return signal


# ---------------------------------------------------------------- decoder.py
def encode_inputs(sentence_ids, model, src_pad_idx, beam_size, device):
    inputs = [sentence_ids + [EOS]]
    inputs = torch.tensor(inputs, device=device)
    with torch.no_grad():
        src_mask = create_pad_mask(inputs, src_pad_idx)
        enc_output = model.encode(inputs, src_mask)
        enc_output = enc_output.repeat(beam_size, 1, 1)
    return enc_output, src_mask


def update_targets(targets, best_indices, idx, vocab_size):
    best_tensor_indices = torch.div(best_indices, vocab_size, rounding_mode='floor')
    best_token_indices = torch.fmod(best_indices, vocab_size)
    new_batch = torch.index_select(targets, 0, best_tensor_indices)
    new_batch[:, idx] = best_token_indices
    return new_batch


def get_result_sentence(indices_history, itos, vocab_size):
    result = []
    k = 0
    for best_indices in indices_history[::-1]:
        best_idx = best_indices[k]
        k = best_idx // vocab_size
        best_token_idx = best_idx % vocab_size
        best_token = itos[best_token_idx]
        result.append(best_token)
    return ' '.join(result[::-1])


def translate(model, sentence_ids, itos, trg_pad_idx, src_pad_idx, beam_size=3, max_length=6, alpha=0.6,
              device=torch.device('cpu'), trace=None):
    pads = torch.tensor([trg_pad_idx] * beam_size, device=device)
    pads = pads.unsqueeze(-1)

    # We'll find a target sequence by beam search.
    scores_history = [torch.zeros((beam_size,), dtype=torch.float, device=device)]
    indices_history = []
    cache = {}

    eos_idx = EOS

    enc_output, src_mask = encode_inputs(sentence_ids, model, src_pad_idx, beam_size, device)
    targets = pads
    start_idx = 0

    with torch.no_grad():
        for idx in range(start_idx, max_length):
            if idx > start_idx:
                targets = torch.cat((targets, pads), dim=1)
            t_self_mask = create_trg_self_mask(targets.size()[1],
                                               device=targets.device)

            t_mask = create_pad_mask(targets, trg_pad_idx)
            pred = model.decode(targets, enc_output, src_mask,
                                t_self_mask, t_mask, cache)
            pred = pred[:, idx].squeeze(1)
            vocab_size = pred.size(1)

            pred = F.log_softmax(pred, dim=1)
            if trace is not None:
                trace.append((idx, targets.clone(), pred.clone()))
            if idx == start_idx:
                scores = pred[0]
            else:
                scores = scores_history[-1].unsqueeze(1) + pred
            length_penalty = pow(((5. + idx + 1.) / 6.), alpha)
            scores = scores / length_penalty
            scores = scores.view(-1)

            best_scores, best_indices = scores.topk(beam_size, 0)
            scores_history.append(best_scores)
            indices_history.append(best_indices)

            # Stop searching when the best output of beam is EOS.
            if best_indices[0].item() % vocab_size == eos_idx:
                break

            targets = update_targets(targets, best_indices, idx, vocab_size)

    return get_result_sentence(indices_history, itos, vocab_size), indices_history


# ---------------------------------------------------------------- reference, written by hand
def ref_sinusoid(length, hidden):
    half = hidden // 2
    inc = math.log(10000.0) / max(half - 1, 1)
    rows = []
    for p in range(length):
        rows.append([math.sin(p * math.exp(-i * inc)) for i in range(half)] +
                    [math.cos(p * math.exp(-i * inc)) for i in range(half)])
    return torch.tensor(rows, dtype=torch.float64)


def ref_attend(mha, xq, xkv, allowed):
    # one sequence, no batch, no mask tensor: each query's softmax runs over the keys it may see only
    heads, d = mha.head_size, mha.att_size
    q = xq @ mha.linear_q.weight.t()
    k = xkv @ mha.linear_k.weight.t()
    v = xkv @ mha.linear_v.weight.t()
    rows = []
    for i in range(xq.size(0)):
        per_head = []
        for h in range(heads):
            sl = slice(h * d, (h + 1) * d)
            js = [j for j in range(xkv.size(0)) if allowed(i, j)]
            s = torch.stack([(q[i, sl] * k[j, sl]).sum() / math.sqrt(d) for j in js])
            p = torch.softmax(s, dim=0)
            per_head.append(sum(p[n] * v[j, sl] for n, j in enumerate(js)))
        rows.append(torch.cat(per_head))
    return torch.stack(rows) @ mha.output_layer.weight.t()


def ref_logits(model, src, trg):
    """src: real source ids (ending in <eos>), trg: real target ids; logits [len(trg), V]"""
    E = model.t_vocab_embedding.weight
    H = model.hidden_size
    x = E[torch.tensor(src)] * math.sqrt(H) + ref_sinusoid(len(src), H)
    for lyr in model.encoder.layers:
        y = lyr.self_attention_norm(x)
        x = x + ref_attend(lyr.self_attention, y, y, lambda i, j: True)
        x = x + lyr.ffn(lyr.ffn_norm(x))
    mem = model.encoder.last_norm(x)

    prev = torch.cat([torch.zeros(1, H, dtype=E.dtype), E[torch.tensor(trg[:-1], dtype=torch.long)]], 0)
    x = prev * math.sqrt(H) + ref_sinusoid(len(trg), H)
    for lyr in model.decoder.layers:
        y = lyr.self_attention_norm(x)
        x = x + ref_attend(lyr.self_attention, y, y, lambda i, j: j <= i)
        y = lyr.enc_dec_attention_norm(x)
        x = x + ref_attend(lyr.enc_dec_attention, y, mem, lambda i, j: True)
        x = x + lyr.ffn(lyr.ffn_norm(x))
    return model.decoder.last_norm(x) @ E.t()


def ref_token_loss(logits, trg, vocab_size, label_smoothing):
    conf = 1.0 - label_smoothing
    low = label_smoothing / (vocab_size - 1)
    norm = -(conf * math.log(conf) + (vocab_size - 1) * low * math.log(low + 1e-20))
    total = 0.0
    for t, tok in enumerate(trg):
        lp = torch.log_softmax(logits[t], dim=0)
        xent = -(conf * lp[tok] + low * (lp.sum() - lp[tok]))
        total = total + (xent - norm)
    return total


def main():
    V = 24
    itos = ['<unk>', '<pad>', '<eos>'] + ['w%d' % i for i in range(3, V)]
    model = Transformer(V, V, n_layers=2, hidden_size=32, filter_size=64, dropout_rate=0.1,
                        share_target_embedding=True, has_inputs=True, src_pad_idx=PAD, trg_pad_idx=PAD)
    model = model.double()
    model.eval()  # dropout off so the batch and the reference can be compared

    # torchtext batch (batch_first=True): every example ends in <eos>, right-padded with <pad> = 1
    g = torch.Generator().manual_seed(1)
    src_lens, trg_lens = [7, 4, 5], [5, 3, 6]
    srcs = [torch.randint(3, V, (n - 1,), generator=g).tolist() + [EOS] for n in src_lens]
    trgs = [torch.randint(3, V, (n - 1,), generator=g).tolist() + [EOS] for n in trg_lens]
    S, T = max(src_lens), max(trg_lens)
    inputs = torch.tensor([s + [PAD] * (S - len(s)) for s in srcs])
    targets = torch.tensor([t + [PAD] * (T - len(t)) for t in trgs])

    # train.py's step
    label_smoothing = 0.1
    pred = model(inputs, targets)
    pred = pred.view(-1, pred.size(-1))
    ans = targets.view(-1)
    loss = get_loss(pred, ans, V, label_smoothing, PAD)
    model.zero_grad()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    pred = pred.view(len(srcs), T, V).detach()

    # reference: each pair alone, unpadded, attention by explicit loops
    model.zero_grad()
    ref_total, n_tok, worst = 0.0, 0, 0.0
    for b, (s, t) in enumerate(zip(srcs, trgs)):
        lg = ref_logits(model, s, t)
        worst = max(worst, (lg.detach() - pred[b, :len(t)]).abs().max().item())
        ref_total = ref_total + ref_token_loss(lg, t, V, label_smoothing)
        n_tok += len(t)
    ref_loss = ref_total / n_tok
    ref_loss.backward()
    # 1e-6: the project builds inv_timescales in float32 before .double(); the reference uses exact timescales
    assert worst < 1e-6, worst
    assert abs(loss.item() - ref_loss.item()) < 1e-6, (loss.item(), ref_loss.item())
    gworst = max((grads[n] - p.grad).abs().max().item() for n, p in model.named_parameters())
    assert gworst < 1e-6, gworst
    print("train step: logits err %.2e, loss %.6f (ref %.6f), grad err %.2e" % (worst, loss.item(), ref_loss.item(), gworst))

    # decoder.py's beam search, encdec keys cached after the first step; every beam row's step log-probs
    # checked against the reference run on that row's own prefix
    for b in range(len(srcs)):
        trace = []
        sent, _ = translate(model, srcs[b][:-1], itos, PAD, PAD, beam_size=3, max_length=6, trace=trace)
        serr = 0.0
        with torch.no_grad():
            for idx, tg, lp in trace:
                for r in range(tg.size(0)):
                    lg = ref_logits(model, srcs[b], tg[r, :idx + 1].tolist())
                    serr = max(serr, (torch.log_softmax(lg[idx], 0) - lp[r]).abs().max().item())
        assert serr < 1e-6, serr
        print("beam decode src %d: %d steps, step log-prob err %.2e -> %s" % (b, len(trace), serr, sent))
    print("ok")


if __name__ == "__main__":
    main()
