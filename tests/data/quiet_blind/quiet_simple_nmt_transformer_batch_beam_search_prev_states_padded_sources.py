# Follows kh-kim/simple-nmt @43bd462d90b838d5bb7815f55b6c883a44541f3c:
#   simple_nmt/models/transformer.py (Attention, MultiHead, EncoderBlock, DecoderBlock (Pre-LN), MySequential,
#   Transformer._generate_mask / forward / search / batch_beam_search), simple_nmt/search.py (SingleBeamSearchBoard),
#   simple_nmt/data_loader.py (PAD, BOS, EOS = 1, 2, 3; src Field batch_first, include_lengths) and translate.py
#   (sentences sorted by decreasing length, padded, translated, then put back in their original order).
# The source batch is right padded; _generate_mask marks the pads of each row (True = pad), the encoder gets it
# expanded to (batch, n, n) and the decoder's cross-attention gets it as (batch, 1, n), masked_fill(-inf) before the
# softmax. At inference the decoder keeps, for each layer, every earlier step's layer input ("prev_state_i") and
# attends the new token to it with no mask; batch_beam_search flattens the beams of the unfinished sentences into
# one batch each step (their encoder output and mask repeated beam_size times) and each SingleBeamSearchBoard
# index_selects its beams' states. As the board does, masked_fill_ on the previous step's cumulative scores is in
# place, so a beam that ended before the last step is scored -inf by get_n_best; the reference scores it the same.
# Checked (float64 but for the float32 position table, dropout 0): teacher-forced log-probs, greedy search and the beam search of the padded batch
# equal each sentence run alone, unpadded, through a hand-written per-head attention that recomputes the decoder.
import math
import types
from operator import itemgetter

import torch
import torch.nn as nn

torch.set_default_dtype(torch.float64)

data_loader = types.SimpleNamespace(PAD=1, BOS=2, EOS=3)

LENGTH_PENALTY = .2
MIN_LENGTH = 5


class SingleBeamSearchBoard():

    def __init__(
        self,
        device,
        prev_status_config,
        beam_size=5,
        max_length=255,
    ):
        self.beam_size = beam_size
        self.max_length = max_length

        self.device = device
        self.word_indice = [torch.LongTensor(beam_size).zero_().to(self.device) + data_loader.BOS]
        self.beam_indice = [torch.LongTensor(beam_size).zero_().to(self.device) - 1]
        self.cumulative_probs = [torch.FloatTensor([.0] + [-float('inf')] * (beam_size - 1)).to(self.device)]
        self.masks = [torch.BoolTensor(beam_size).zero_().to(self.device)]

        self.prev_status = {}
        self.batch_dims = {}
        for prev_status_name, each_config in prev_status_config.items():
            init_status = each_config['init_status']
            batch_dim_index = each_config['batch_dim_index']
            if init_status is not None:
                self.prev_status[prev_status_name] = torch.cat([init_status] * beam_size,
                                                               dim=batch_dim_index)
            else:
                self.prev_status[prev_status_name] = None
            self.batch_dims[prev_status_name] = batch_dim_index

        self.current_time_step = 0
        self.done_cnt = 0

    def get_length_penalty(
        self,
        length,
        alpha=LENGTH_PENALTY,
        min_length=MIN_LENGTH,
    ):
        p = ((min_length + 1) / (min_length + length))**alpha

        return p

    def is_done(self):
        if self.done_cnt >= self.beam_size:
            return 1
        return 0

    def get_batch(self):
        y_hat = self.word_indice[-1].unsqueeze(-1)
        # |y_hat| = (beam_size, 1)
        return y_hat, self.prev_status

    def collect_result(self, y_hat, prev_status):
        # |y_hat| = (beam_size, 1, output_size)
        output_size = y_hat.size(-1)

        self.current_time_step += 1

        cumulative_prob = self.cumulative_probs[-1].masked_fill_(self.masks[-1], -float('inf'))
        cumulative_prob = y_hat + cumulative_prob.view(-1, 1, 1).expand(self.beam_size, 1, output_size)
        # |cumulative_prob| = (beam_size, 1, output_size)

        top_log_prob, top_indice = cumulative_prob.view(-1).sort(descending=True)
        top_log_prob, top_indice = top_log_prob[:self.beam_size], top_indice[:self.beam_size]

        self.word_indice += [top_indice.fmod(output_size)]
        self.beam_indice += [top_indice.div(float(output_size)).long()]

        self.cumulative_probs += [top_log_prob]
        self.masks += [torch.eq(self.word_indice[-1], data_loader.EOS)]
        self.done_cnt += self.masks[-1].float().sum()

        for prev_status_name, prev_status in prev_status.items():
            self.prev_status[prev_status_name] = torch.index_select(
                prev_status,
                dim=self.batch_dims[prev_status_name],
                index=self.beam_indice[-1]
            ).contiguous()

    def get_n_best(self, n=1, length_penalty=.2):
        sentences, probs, founds = [], [], []

        for t in range(len(self.word_indice)):
            for b in range(self.beam_size):
                if self.masks[t][b] == 1:
                    probs += [self.cumulative_probs[t][b] * self.get_length_penalty(t, alpha=length_penalty)]
                    founds += [(t, b)]

        for b in range(self.beam_size):
            if self.cumulative_probs[-1][b] != -float('inf'):
                if not (len(self.cumulative_probs) - 1, b) in founds:
                    probs += [self.cumulative_probs[-1][b] * self.get_length_penalty(len(self.cumulative_probs),
                                                                                     alpha=length_penalty)]
                    founds += [(t, b)]

        sorted_founds_with_probs = sorted(
            zip(founds, probs),
            key=itemgetter(1),
            reverse=True,
        )[:n]
        probs = []

        for (end_index, b), prob in sorted_founds_with_probs:
            sentence = []

            for t in range(end_index, 0, -1):
                sentence = [self.word_indice[t][b]] + sentence
                b = self.beam_indice[t][b]

            sentences += [sentence]
            probs += [prob]

        return sentences, probs


class Attention(nn.Module):

    def __init__(self):
        super().__init__()

        self.softmax = nn.Softmax(dim=-1)

    def forward(self, Q, K, V, mask=None, dk=64):
        # |Q| = (batch_size, m, hidden_size)
        # |K| = |V| = (batch_size, n, hidden_size)
        # |mask| = (batch_size, m, n)

        w = torch.bmm(Q, K.transpose(1, 2))
        # |w| = (batch_size, m, n)
        if mask is not None:
            assert w.size() == mask.size()
            w.masked_fill_(mask, -float('inf'))

        w = self.softmax(w / (dk**.5))
        c = torch.bmm(w, V)
        # |c| = (batch_size, m, hidden_size)

        return c


class MultiHead(nn.Module):

    def __init__(self, hidden_size, n_splits):
        super().__init__()

        self.hidden_size = hidden_size
        self.n_splits = n_splits

        self.Q_linear = nn.Linear(hidden_size, hidden_size, bias=False)
        self.K_linear = nn.Linear(hidden_size, hidden_size, bias=False)
        self.V_linear = nn.Linear(hidden_size, hidden_size, bias=False)
        self.linear = nn.Linear(hidden_size, hidden_size, bias=False)

        self.attn = Attention()

    def forward(self, Q, K, V, mask=None):
        # |Q|    = (batch_size, m, hidden_size)
        # |K|    = (batch_size, n, hidden_size)
        # |mask| = (batch_size, m, n)

        QWs = self.Q_linear(Q).split(self.hidden_size // self.n_splits, dim=-1)
        KWs = self.K_linear(K).split(self.hidden_size // self.n_splits, dim=-1)
        VWs = self.V_linear(V).split(self.hidden_size // self.n_splits, dim=-1)

        QWs = torch.cat(QWs, dim=0)
        KWs = torch.cat(KWs, dim=0)
        VWs = torch.cat(VWs, dim=0)
        # |QWs| = (batch_size * n_splits, m, hidden_size / n_splits)

        if mask is not None:
            mask = torch.cat([mask for _ in range(self.n_splits)], dim=0)
            # |mask| = (batch_size * n_splits, m, n)

        c = self.attn(
            QWs, KWs, VWs,
            mask=mask,
            dk=self.hidden_size // self.n_splits,
        )

        c = c.split(Q.size(0), dim=0)
        c = self.linear(torch.cat(c, dim=-1))
        # |c| = (batch_size, m, hidden_size)

        return c


class EncoderBlock(nn.Module):

    def __init__(
        self,
        hidden_size,
        n_splits,
        dropout_p=.1,
        use_leaky_relu=False,
    ):
        super().__init__()

        self.attn = MultiHead(hidden_size, n_splits)
        self.attn_norm = nn.LayerNorm(hidden_size)
        self.attn_dropout = nn.Dropout(dropout_p)

        self.fc = nn.Sequential(
            nn.Linear(hidden_size, hidden_size * 4),
            nn.LeakyReLU() if use_leaky_relu else nn.ReLU(),
            nn.Linear(hidden_size * 4, hidden_size),
        )
        self.fc_norm = nn.LayerNorm(hidden_size)
        self.fc_dropout = nn.Dropout(dropout_p)

    def forward(self, x, mask):
        # |x|    = (batch_size, n, hidden_size)
        # |mask| = (batch_size, n, n)

        # Pre-LN:
        z = self.attn_norm(x)
        z = x + self.attn_dropout(self.attn(Q=z,
                                            K=z,
                                            V=z,
                                            mask=mask))
        z = z + self.fc_dropout(self.fc(self.fc_norm(z)))

        return z, mask


class DecoderBlock(nn.Module):

    def __init__(
        self,
        hidden_size,
        n_splits,
        dropout_p=.1,
        use_leaky_relu=False,
    ):
        super().__init__()

        self.masked_attn = MultiHead(hidden_size, n_splits)
        self.masked_attn_norm = nn.LayerNorm(hidden_size)
        self.masked_attn_dropout = nn.Dropout(dropout_p)

        self.attn = MultiHead(hidden_size, n_splits)
        self.attn_norm = nn.LayerNorm(hidden_size)
        self.attn_dropout = nn.Dropout(dropout_p)

        self.fc = nn.Sequential(
            nn.Linear(hidden_size, hidden_size * 4),
            nn.LeakyReLU() if use_leaky_relu else nn.ReLU(),
            nn.Linear(hidden_size * 4, hidden_size),
        )
        self.fc_norm = nn.LayerNorm(hidden_size)
        self.fc_dropout = nn.Dropout(dropout_p)

    def forward(self, x, key_and_value, mask, prev, future_mask):
        # |key_and_value| = (batch_size, n, hidden_size)
        # |mask|          = (batch_size, m, n)

        if prev is None:  # Training mode
            # |future_mask| = (batch_size, m, m)
            z = self.masked_attn_norm(x)
            z = x + self.masked_attn_dropout(
                self.masked_attn(z, z, z, mask=future_mask)
            )
        else:  # Inference mode
            # |x|    = (batch_size, 1, hidden_size)
            # |prev| = (batch_size, t, hidden_size), this step's input included
            normed_prev = self.masked_attn_norm(prev)
            z = self.masked_attn_norm(x)
            z = x + self.masked_attn_dropout(
                self.masked_attn(z, normed_prev, normed_prev, mask=None)
            )

        normed_key_and_value = self.attn_norm(key_and_value)
        z = z + self.attn_dropout(self.attn(Q=self.attn_norm(z),
                                            K=normed_key_and_value,
                                            V=normed_key_and_value,
                                            mask=mask))

        z = z + self.fc_dropout(self.fc(self.fc_norm(z)))
        # |z| = (batch_size, m, hidden_size)

        return z, key_and_value, mask, prev, future_mask


class MySequential(nn.Sequential):

    def forward(self, *x):
        for module in self._modules.values():
            x = module(*x)

        return x


class Transformer(nn.Module):

    def __init__(
        self,
        input_size,
        hidden_size,
        output_size,
        n_splits,
        n_enc_blocks=6,
        n_dec_blocks=6,
        dropout_p=.1,
        use_leaky_relu=False,
        max_length=512,
    ):
        self.input_size = input_size
        self.hidden_size = hidden_size
        self.output_size = output_size
        self.n_splits = n_splits
        self.n_enc_blocks = n_enc_blocks
        self.n_dec_blocks = n_dec_blocks
        self.dropout_p = dropout_p
        self.max_length = max_length

        super().__init__()

        self.emb_enc = nn.Embedding(input_size, hidden_size)
        self.emb_dec = nn.Embedding(output_size, hidden_size)
        self.emb_dropout = nn.Dropout(dropout_p)

        self.pos_enc = self._generate_pos_enc(hidden_size, max_length)

        self.encoder = MySequential(
            *[EncoderBlock(
                hidden_size,
                n_splits,
                dropout_p,
                use_leaky_relu,
              ) for _ in range(n_enc_blocks)],
        )
        self.decoder = MySequential(
            *[DecoderBlock(
                hidden_size,
                n_splits,
                dropout_p,
                use_leaky_relu,
              ) for _ in range(n_dec_blocks)],
        )
        self.generator = nn.Sequential(
            nn.LayerNorm(hidden_size),  # Only for Pre-LN Transformer.
            nn.Linear(hidden_size, output_size),
            nn.LogSoftmax(dim=-1),
        )

    @torch.no_grad()
    def _generate_pos_enc(self, hidden_size, max_length):
        enc = torch.FloatTensor(max_length, hidden_size).zero_()

        pos = torch.arange(0, max_length).unsqueeze(-1).float()
        dim = torch.arange(0, hidden_size // 2).unsqueeze(0).float()

        enc[:, 0::2] = torch.sin(pos / 1e+4**dim.div(float(hidden_size)))
        enc[:, 1::2] = torch.cos(pos / 1e+4**dim.div(float(hidden_size)))

        return enc

    def _position_encoding(self, x, init_pos=0):
        assert x.size(-1) == self.pos_enc.size(-1)
        assert x.size(1) + init_pos <= self.max_length

        pos_enc = self.pos_enc[init_pos:init_pos + x.size(1)].unsqueeze(0)
        x = x + pos_enc.to(x.device)

        return x

    @torch.no_grad()
    def _generate_mask(self, x, length):
        mask = []

        max_length = max(length)
        for l in length:
            if max_length - l > 0:
                mask += [torch.cat([x.new_ones(1, l).zero_(),
                                    x.new_ones(1, (max_length - l))
                                    ], dim=-1)]
            else:
                mask += [x.new_ones(1, l).zero_()]

        mask = torch.cat(mask, dim=0).bool()
        # |mask| = (batch_size, max_length)

        return mask

    def forward(self, x, y):
        # |x[0]| = (batch_size, n)
        # |y|    = (batch_size, m)

        with torch.no_grad():
            mask = self._generate_mask(x[0], x[1])
            x = x[0]

            mask_enc = mask.unsqueeze(1).expand(*x.size(), mask.size(-1))
            mask_dec = mask.unsqueeze(1).expand(*y.size(), mask.size(-1))
            # |mask_enc| = (batch_size, n, n)
            # |mask_dec| = (batch_size, m, n)

        z = self.emb_dropout(self._position_encoding(self.emb_enc(x)))
        z, _ = self.encoder(z, mask_enc)

        with torch.no_grad():
            future_mask = torch.triu(x.new_ones((y.size(1), y.size(1))), diagonal=1).bool()
            future_mask = future_mask.unsqueeze(0).expand(y.size(0), *future_mask.size())
            # |future_mask| = (batch_size, m, m)

        h = self.emb_dropout(self._position_encoding(self.emb_dec(y)))
        h, _, _, _, _ = self.decoder(h, z, mask_dec, None, future_mask)

        y_hat = self.generator(h)
        # |y_hat| = (batch_size, m, output_size)

        return y_hat

    def search(self, x, is_greedy=True, max_length=255):
        batch_size = x[0].size(0)

        mask = self._generate_mask(x[0], x[1])
        x = x[0]

        mask_enc = mask.unsqueeze(1).expand(mask.size(0), x.size(1), mask.size(-1))
        mask_dec = mask.unsqueeze(1)
        # |mask_enc| = (batch_size, n, n)
        # |mask_dec| = (batch_size, 1, n)

        z = self.emb_dropout(self._position_encoding(self.emb_enc(x)))
        z, _ = self.encoder(z, mask_enc)

        y_t_1 = x.new(batch_size, 1).zero_() + data_loader.BOS
        is_decoding = x.new_ones(batch_size, 1).bool()

        prevs = [None for _ in range(len(self.decoder._modules) + 1)]
        y_hats, indice = [], []
        while is_decoding.sum() > 0 and len(indice) < max_length:
            h_t = self.emb_dropout(
                self._position_encoding(self.emb_dec(y_t_1), init_pos=len(indice))
            )
            if prevs[0] is None:
                prevs[0] = h_t
            else:
                prevs[0] = torch.cat([prevs[0], h_t], dim=1)

            for layer_index, block in enumerate(self.decoder._modules.values()):
                prev = prevs[layer_index]

                h_t, _, _, _, _ = block(h_t, z, mask_dec, prev, None)

                if prevs[layer_index + 1] is None:
                    prevs[layer_index + 1] = h_t
                else:
                    prevs[layer_index + 1] = torch.cat([prevs[layer_index + 1], h_t], dim=1)

            y_hat_t = self.generator(h_t)
            # |y_hat_t| = (batch_size, 1, output_size)

            y_hats += [y_hat_t]
            if is_greedy:
                y_t_1 = torch.topk(y_hat_t, 1, dim=-1)[1].squeeze(-1)
            else:
                y_t_1 = torch.multinomial(y_hat_t.exp().view(x.size(0), -1), 1)
            # Put PAD if the sample is done.
            y_t_1 = y_t_1.masked_fill_(
                ~is_decoding,
                data_loader.PAD,
            )

            is_decoding = is_decoding * torch.ne(y_t_1, data_loader.EOS)
            indice += [y_t_1]

        y_hats = torch.cat(y_hats, dim=1)
        indice = torch.cat(indice, dim=-1)

        return y_hats, indice

    def batch_beam_search(
        self,
        x,
        beam_size=5,
        max_length=255,
        n_best=1,
        length_penalty=.2,
    ):
        batch_size = x[0].size(0)
        n_dec_layers = len(self.decoder._modules)

        mask = self._generate_mask(x[0], x[1])
        x = x[0]

        mask_enc = mask.unsqueeze(1).expand(mask.size(0), x.size(1), mask.size(-1))
        mask_dec = mask.unsqueeze(1)
        # |mask_enc| = (batch_size, n, n)
        # |mask_dec| = (batch_size, 1, n)

        z = self.emb_dropout(self._position_encoding(self.emb_enc(x)))
        z, _ = self.encoder(z, mask_enc)

        prev_status_config = {}
        for layer_index in range(n_dec_layers + 1):
            prev_status_config['prev_state_%d' % layer_index] = {
                'init_status': None,
                'batch_dim_index': 0,
            }

        boards = [
            SingleBeamSearchBoard(
                z.device,
                prev_status_config,
                beam_size=beam_size,
                max_length=max_length,
            ) for _ in range(batch_size)
        ]
        done_cnt = [board.is_done() for board in boards]

        length = 0
        while sum(done_cnt) < batch_size and length <= max_length:
            fab_input, fab_z, fab_mask = [], [], []
            fab_prevs = [[] for _ in range(n_dec_layers + 1)]

            for i, board in enumerate(boards):  # i == sample_index in minibatch
                if board.is_done() == 0:
                    y_hat_i, prev_status = board.get_batch()

                    fab_input += [y_hat_i                 ]
                    fab_z     += [z[i].unsqueeze(0)       ] * beam_size
                    fab_mask  += [mask_dec[i].unsqueeze(0)] * beam_size

                    for layer_index in range(n_dec_layers + 1):
                        prev_i = prev_status['prev_state_%d' % layer_index]
                        if prev_i is not None:
                            fab_prevs[layer_index] += [prev_i]
                        else:
                            fab_prevs[layer_index] = None

            fab_input = torch.cat(fab_input, dim=0)
            fab_z     = torch.cat(fab_z,     dim=0)
            fab_mask  = torch.cat(fab_mask,  dim=0)
            for i, fab_prev in enumerate(fab_prevs):  # i == layer_index
                if fab_prev is not None:
                    fab_prevs[i] = torch.cat(fab_prev, dim=0)
            # |fab_input|    = (current_batch_size, 1,)
            # |fab_z|        = (current_batch_size, n, hidden_size)
            # |fab_mask|     = (current_batch_size, 1, n)
            # |fab_prevs[i]| = (current_batch_size, length, hidden_size)

            h_t = self.emb_dropout(
                self._position_encoding(self.emb_dec(fab_input), init_pos=length)
            )
            if fab_prevs[0] is None:
                fab_prevs[0] = h_t
            else:
                fab_prevs[0] = torch.cat([fab_prevs[0], h_t], dim=1)

            for layer_index, block in enumerate(self.decoder._modules.values()):
                prev = fab_prevs[layer_index]

                h_t, _, _, _, _ = block(h_t, fab_z, fab_mask, prev, None)

                if fab_prevs[layer_index + 1] is None:
                    fab_prevs[layer_index + 1] = h_t
                else:
                    fab_prevs[layer_index + 1] = torch.cat(
                        [fab_prevs[layer_index + 1], h_t],
                        dim=1,
                    )

            y_hat_t = self.generator(h_t)

            cnt = 0
            for board in boards:
                if board.is_done() == 0:
                    begin = cnt * beam_size
                    end = begin + beam_size

                    prev_status = {}
                    for layer_index in range(n_dec_layers + 1):
                        prev_status['prev_state_%d' % layer_index] = fab_prevs[layer_index][begin:end]

                    board.collect_result(y_hat_t[begin:end], prev_status)

                    cnt += 1

            done_cnt = [board.is_done() for board in boards]
            length += 1

        batch_sentences, batch_probs = [], []

        for i, board in enumerate(boards):
            sentences, probs = board.get_n_best(n_best, length_penalty=length_penalty)

            batch_sentences += [sentences]
            batch_probs     += [probs]

        return batch_sentences, batch_probs


# ---- translate.py's batch handling: sort by decreasing length, pad right (torchtext Field.pad / numericalize) ----

def numericalize_padded(sorted_lines):
    lengths = [len(line) for line in sorted_lines]
    width = max(lengths)
    ids = torch.full((len(sorted_lines), width), data_loader.PAD, dtype=torch.long)
    for i, line in enumerate(sorted_lines):
        ids[i, :len(line)] = torch.tensor(line)
    return ids, torch.tensor(lengths)


def sort_batch(lines):
    lengths = [len(line) for line in lines]
    original_indice = [i for i in range(len(lines))]
    sorted_tuples = sorted(zip(lines, lengths, original_indice), key=itemgetter(1), reverse=True)
    sorted_lines = [t[0] for t in sorted_tuples]
    original_indice = [t[2] for t in sorted_tuples]
    return sorted_lines, original_indice


def restore(outputs, original_indice):
    sorted_tuples = sorted(zip(outputs, original_indice), key=itemgetter(1))
    return [t[0] for t in sorted_tuples]


# ---- reference, written independently: one sentence at a time, no padding, decoder recomputed every step ----

def ref_mha(mh, q_in, kv_in, causal):
    # q_in (m, H), kv_in (n, H); head h uses columns h*d:(h+1)*d; row i sees keys 0..i when causal.
    H = mh.hidden_size
    d = H // mh.n_splits
    Q = q_in @ mh.Q_linear.weight.T
    K = kv_in @ mh.K_linear.weight.T
    V = kv_in @ mh.V_linear.weight.T
    out = torch.zeros(q_in.shape[0], H)
    for h in range(mh.n_splits):
        cols = slice(h * d, (h + 1) * d)
        for i in range(q_in.shape[0]):
            keys = i + 1 if causal else kv_in.shape[0]
            s = (K[:keys, cols] @ Q[i, cols]) / math.sqrt(d)
            p = torch.exp(s - s.max())
            p = p / p.sum()
            out[i, cols] = p @ V[:keys, cols]
    return out @ mh.linear.weight.T


def ref_ln(ln, x):
    mu = x.mean(-1, keepdim=True)
    var = ((x - mu) ** 2).mean(-1, keepdim=True)
    return (x - mu) / torch.sqrt(var + ln.eps) * ln.weight + ln.bias


def ref_ffn(fc, x):
    return fc[2](torch.relu(fc[0](x)))


def ref_sinusoid(n, H):
    pe = torch.zeros(n, H)
    for p in range(n):
        for j in range(H // 2):
            angle = p / (10000.0 ** (j / H))
            pe[p, 2 * j] = math.sin(angle)
            pe[p, 2 * j + 1] = math.cos(angle)
    return pe


def ref_encode(model, src):
    x = model.emb_enc.weight[torch.tensor(src)] + ref_sinusoid(len(src), model.hidden_size)
    for blk in model.encoder:
        x = x + ref_mha(blk.attn, ref_ln(blk.attn_norm, x), ref_ln(blk.attn_norm, x), causal=False)
        x = x + ref_ffn(blk.fc, ref_ln(blk.fc_norm, x))
    return x


def ref_decode_logprobs(model, memory, tgt):
    # log-probs of the next token after each prefix tgt[:i+1]
    y = model.emb_dec.weight[torch.tensor(tgt)] + ref_sinusoid(len(tgt), model.hidden_size)
    for blk in model.decoder:
        n = ref_ln(blk.masked_attn_norm, y)
        y = y + ref_mha(blk.masked_attn, n, n, causal=True)
        y = y + ref_mha(blk.attn, ref_ln(blk.attn_norm, y), ref_ln(blk.attn_norm, memory), causal=False)
        y = y + ref_ffn(blk.fc, ref_ln(blk.fc_norm, y))
    gen_ln, gen_lin = model.generator[0], model.generator[1]
    logits = ref_ln(gen_ln, y) @ gen_lin.weight.T + gen_lin.bias
    return logits - torch.logsumexp(logits, dim=-1, keepdim=True)


def ref_greedy(model, src, max_length):
    memory = ref_encode(model, src)
    tgt, out = [data_loader.BOS], []
    while len(out) < max_length:
        w = int(ref_decode_logprobs(model, memory, tgt)[-1].argmax())
        out.append(w)
        if w == data_loader.EOS:
            break
        tgt.append(w)
    return out


def ref_beam(model, src, beam_size, max_length, n_best, length_penalty):
    # live: list of (score, tokens after BOS). Each step the beam_size best continuations of the live beams are
    # kept; those ending in EOS are finished at that step. Stops after beam_size EOS picks or max_length + 1 steps.
    memory = ref_encode(model, src)
    live = [(0.0, [])]
    finished = []  # (step, score, tokens)
    steps, n_eos = 0, 0
    while n_eos < beam_size and steps <= max_length:
        cands = []
        for score, toks in live:
            lp = ref_decode_logprobs(model, memory, [data_loader.BOS] + toks)[-1]
            for w in range(lp.shape[0]):
                cands.append((score + float(lp[w]), toks + [w]))
        cands.sort(key=lambda c: c[0], reverse=True)
        chosen = cands[:beam_size]
        steps += 1
        live = []
        for score, toks in chosen:
            if toks[-1] == data_loader.EOS:
                finished.append((steps, score, toks))
                n_eos += 1
            else:
                live.append((score, toks))
    penalty = lambda length: ((MIN_LENGTH + 1) / (MIN_LENGTH + length)) ** length_penalty
    scored = []
    for step, score, toks in finished:
        # the board's in-place masked_fill_ leaves -inf for beams that ended before the final step
        scored.append((score * penalty(step) if step == steps else -float('inf'), toks))
    for score, toks in live:
        scored.append((score * penalty(steps + 1), toks))
    scored.sort(key=lambda c: c[0], reverse=True)
    return scored[:n_best], steps


def main():
    torch.manual_seed(0)
    src_vocab, tgt_vocab = 20, 12
    model = Transformer(src_vocab, 32, tgt_vocab, n_splits=4, n_enc_blocks=2, n_dec_blocks=2, dropout_p=.1)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.35)
        model.generator[1].bias[data_loader.EOS] += 3.0
        model.generator[1].bias[data_loader.PAD] -= 4.0
    model.eval()

    # Source sentences (ids >= 4), in reading order, of different lengths.
    lines = [[5, 9, 4, 17], [12, 6, 8, 19, 7, 11, 15], [10, 13], [16, 4, 18, 5, 14]]
    sorted_lines, original_indice = sort_batch(lines)
    x = numericalize_padded(sorted_lines)
    assert x[0].shape == (4, 7) and (x[0] == data_loader.PAD).sum() == 3 + 5 + 2

    with torch.no_grad():
        # Teacher forcing on a right-padded target batch (the decoder sees only its future mask; pads are last).
        tgts = [[data_loader.BOS, 4, 7, 9], [data_loader.BOS, 6], [data_loader.BOS, 8, 5, 11, 10, 4],
                [data_loader.BOS, 9, 9, 5]]
        y = torch.full((4, 6), data_loader.PAD, dtype=torch.long)
        for i, t in enumerate(tgts):
            y[i, :len(t)] = torch.tensor(t)
        y_hat = model(x, y)
        for i in range(4):
            ref = ref_decode_logprobs(model, ref_encode(model, sorted_lines[i]), tgts[i])
            err = (y_hat[i, :len(tgts[i])] - ref).abs().max().item()
            assert err < 1e-5, (i, err)

        # Greedy search (beam_size == 1 in translate.py).
        max_length = 8
        y_hats, indice = model.search(x, max_length=max_length)
        greedy = []
        for i in range(4):
            row = [int(v) for v in indice[i]]
            out = row[:row.index(data_loader.EOS) + 1] if data_loader.EOS in row else row
            ref = ref_greedy(model, sorted_lines[i], max_length)
            assert out == ref, (i, out, ref)
            ref_lp = ref_decode_logprobs(model, ref_encode(model, sorted_lines[i]), [data_loader.BOS] + ref[:-1])
            err = (y_hats[i, :len(ref)] - ref_lp).abs().max().item()
            assert err < 1e-5, (i, err)
            greedy.append(out)
        greedy = restore(greedy, original_indice)

        # Mini-batch parallelized beam search.
        beam_size, n_best, length_penalty = 3, 3, 1.2
        batch_sentences, batch_probs = model.batch_beam_search(
            x, beam_size=beam_size, max_length=max_length, n_best=n_best, length_penalty=length_penalty,
        )
        steps_taken = []
        for i in range(4):
            ref_best, ref_steps = ref_beam(model, sorted_lines[i], beam_size, max_length, n_best, length_penalty)
            steps_taken.append(ref_steps)
            got = [[int(w) for w in s] for s in batch_sentences[i]]
            assert got == [toks for _, toks in ref_best], (i, got, ref_best)
            for p, (rp, _) in zip(batch_probs[i], ref_best):
                assert (float(p) == rp) or abs(float(p) - rp) < 1e-5, (i, float(p), rp)
        batch_sentences = restore(batch_sentences, original_indice)

    assert len(set(steps_taken)) > 1, steps_taken
    print("greedy:", greedy)
    print("beam steps per sorted sentence:", steps_taken)
    for i, sents in enumerate(batch_sentences):
        print("sentence", i, "n-best:", [[int(w) for w in s] for s in sents])
    print("ok: padded batch == each sentence alone (teacher forcing, greedy, beam search)")


if __name__ == "__main__":
    main()
