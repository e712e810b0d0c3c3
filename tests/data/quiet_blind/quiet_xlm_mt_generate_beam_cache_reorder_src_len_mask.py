"""XLM (facebookresearch/XLM) translation with beam search, shrunk to tiny sizes.

Correct program (quiet batch quiet-r147b). Ported from facebookresearch/XLM
@cccf13bdb283c786964fe19c40e85608fc57ad0d:
  xlm/model/transformer.py   get_masks, MultiHeadAttention (cache keyed by layer_id,
                             keep-mask turned into masked_fill(-inf)), TransformerModel.fwd
                             (time-major x, cache['slen'], src_mask from src_len),
                             TransformerModel.generate_beam and BeamHypotheses
  xlm/data/dataset.py        Dataset.batch_sentences (<EOS> w1 .. wn <EOS>, right-padded)
  xlm/evaluation/evaluator.py  EncDecEvaluator.evaluate_mt (encode, transpose, generate_beam
                             with max_len = int(1.5 * len1.max() + 10))
  xlm/trainer.py             EncDecTrainer.mt_step (pred_mask = alen[:, None] < len2[None] - 1)

The encoder runs over a right-padded source batch; generate_beam repeats each source
row beam_size times (src_enc and src_len), the decoder's cross-attention masks the
source pads from src_len, the per-layer (k, v) cache (self and encoder attention) is
re-ordered by beam_idx every step and finished hypotheses go to BeamHypotheses.

Checked against a reference written here: each sentence translated alone (unpadded
source, batch of one), with a beam search that re-runs the whole prefix every step
(no cache); plus the decoded batch teacher-forced as mt_step scores it, against each
pair alone.
"""
import itertools
import math

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

N_MAX_POSITIONS = 512  # maximum input sequence length

BOS_WORD = '<s>'
EOS_WORD = '</s>'
PAD_WORD = '<pad>'
UNK_WORD = '<unk>'


class AttrDict(dict):
    def __init__(self, *args, **kwargs):
        super(AttrDict, self).__init__(*args, **kwargs)
        self.__dict__ = self


class Dictionary(object):

    def __init__(self, id2word):
        self.id2word = id2word
        self.word2id = {w: i for i, w in id2word.items()}
        self.bos_index = self.word2id[BOS_WORD]
        self.eos_index = self.word2id[EOS_WORD]
        self.pad_index = self.word2id[PAD_WORD]
        self.unk_index = self.word2id[UNK_WORD]

    def __len__(self):
        return len(self.id2word)

    def __getitem__(self, i):
        return self.id2word[i]


def Embedding(num_embeddings, embedding_dim, padding_idx=None):
    m = nn.Embedding(num_embeddings, embedding_dim, padding_idx=padding_idx)
    nn.init.normal_(m.weight, mean=0, std=embedding_dim ** -0.5)
    if padding_idx is not None:
        nn.init.constant_(m.weight[padding_idx], 0)
    return m


def Linear(in_features, out_features, bias=True):
    m = nn.Linear(in_features, out_features, bias)
    return m


def create_sinusoidal_embeddings(n_pos, dim, out):
    position_enc = np.array([
        [pos / np.power(10000, 2 * (j // 2) / dim) for j in range(dim)]
        for pos in range(n_pos)
    ])
    out[:, 0::2] = torch.FloatTensor(np.sin(position_enc[:, 0::2]))
    out[:, 1::2] = torch.FloatTensor(np.cos(position_enc[:, 1::2]))
    out.detach_()
    out.requires_grad = False


def gelu(x):
    return 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0)))


def get_masks(slen, lengths, causal):
    """
    Generate hidden states mask, and optionally an attention mask.
    """
    assert lengths.max().item() <= slen
    bs = lengths.size(0)
    alen = torch.arange(slen, dtype=torch.long, device=lengths.device)
    mask = alen < lengths[:, None]

    # attention mask is the same as mask, or triangular inferior attention (causal)
    if causal:
        attn_mask = alen[None, None, :].repeat(bs, slen, 1) <= alen[None, :, None]
    else:
        attn_mask = mask

    # sanity check
    assert mask.size() == (bs, slen)
    assert causal is False or attn_mask.size() == (bs, slen, slen)

    return mask, attn_mask


class PredLayer(nn.Module):
    """
    Prediction layer (cross_entropy).
    """
    def __init__(self, params):
        super().__init__()
        self.n_words = params.n_words
        self.pad_index = params.pad_index
        dim = params.emb_dim
        self.proj = Linear(dim, params.n_words, bias=True)

    def forward(self, x, y, get_scores=False):
        assert (y == self.pad_index).sum().item() == 0
        scores = self.proj(x).view(-1, self.n_words)
        loss = F.cross_entropy(scores, y, reduction='mean')
        return scores, loss

    def get_scores(self, x):
        assert x.dim() == 2
        return self.proj(x)


class MultiHeadAttention(nn.Module):

    NEW_ID = itertools.count()

    def __init__(self, n_heads, dim, dropout):
        super().__init__()
        self.layer_id = next(MultiHeadAttention.NEW_ID)
        self.dim = dim
        self.n_heads = n_heads
        self.dropout = dropout
        assert self.dim % self.n_heads == 0

        self.q_lin = Linear(dim, dim)
        self.k_lin = Linear(dim, dim)
        self.v_lin = Linear(dim, dim)
        self.out_lin = Linear(dim, dim)

    def forward(self, input, mask, kv=None, cache=None):
        """
        Self-attention (if kv is None) or attention over source sentence (provided by kv).
        """
        # Input is (bs, qlen, dim)
        # Mask is (bs, klen) (non-causal) or (bs, klen, klen)
        bs, qlen, dim = input.size()
        if kv is None:
            klen = qlen if cache is None else cache['slen'] + qlen
        else:
            klen = kv.size(1)
        assert dim == self.dim, 'Dimensions do not match: %s input vs %s configured' % (dim, self.dim)
        n_heads = self.n_heads
        dim_per_head = dim // n_heads
        mask_reshape = (bs, 1, qlen, klen) if mask.dim() == 3 else (bs, 1, 1, klen)

        def shape(x):
            """  projection """
            return x.view(bs, -1, self.n_heads, dim_per_head).transpose(1, 2)

        def unshape(x):
            """  compute context """
            return x.transpose(1, 2).contiguous().view(bs, -1, self.n_heads * dim_per_head)

        q = shape(self.q_lin(input))                                          # (bs, n_heads, qlen, dim_per_head)
        if kv is None:
            k = shape(self.k_lin(input))                                      # (bs, n_heads, qlen, dim_per_head)
            v = shape(self.v_lin(input))                                      # (bs, n_heads, qlen, dim_per_head)
        elif cache is None or self.layer_id not in cache:
            k = v = kv
            k = shape(self.k_lin(k))                                          # (bs, n_heads, qlen, dim_per_head)
            v = shape(self.v_lin(v))                                          # (bs, n_heads, qlen, dim_per_head)

        if cache is not None:
            if self.layer_id in cache:
                if kv is None:
                    k_, v_ = cache[self.layer_id]
                    k = torch.cat([k_, k], dim=2)                             # (bs, n_heads, klen, dim_per_head)
                    v = torch.cat([v_, v], dim=2)                             # (bs, n_heads, klen, dim_per_head)
                else:
                    k, v = cache[self.layer_id]
            cache[self.layer_id] = (k, v)

        q = q / math.sqrt(dim_per_head)                                       # (bs, n_heads, qlen, dim_per_head)
        scores = torch.matmul(q, k.transpose(2, 3))                           # (bs, n_heads, qlen, klen)
        mask = (mask == 0).view(mask_reshape).expand_as(scores)               # (bs, n_heads, qlen, klen)
        scores.masked_fill_(mask, -float('inf'))                              # (bs, n_heads, qlen, klen)

        weights = F.softmax(scores.float(), dim=-1).type_as(scores)           # (bs, n_heads, qlen, klen)
        weights = F.dropout(weights, p=self.dropout, training=self.training)  # (bs, n_heads, qlen, klen)
        context = torch.matmul(weights, v)                                    # (bs, n_heads, qlen, dim_per_head)
        context = unshape(context)                                            # (bs, qlen, dim)

        return self.out_lin(context)


class TransformerFFN(nn.Module):

    def __init__(self, in_dim, dim_hidden, out_dim, dropout, gelu_activation):
        super().__init__()
        self.dropout = dropout
        self.lin1 = Linear(in_dim, dim_hidden)
        self.lin2 = Linear(dim_hidden, out_dim)
        self.act = gelu if gelu_activation else F.relu

    def forward(self, input):
        x = self.lin1(input)
        x = self.act(x)
        x = self.lin2(x)
        x = F.dropout(x, p=self.dropout, training=self.training)
        return x


class TransformerModel(nn.Module):

    def __init__(self, params, dico, is_encoder, with_output):
        """
        Transformer model (encoder or decoder).
        """
        super().__init__()

        # encoder / decoder, output layer
        self.is_encoder = is_encoder
        self.is_decoder = not is_encoder
        self.with_output = with_output

        # dictionary / languages
        self.n_langs = params.n_langs
        self.n_words = params.n_words
        self.eos_index = params.eos_index
        self.pad_index = params.pad_index
        self.dico = dico
        self.id2lang = params.id2lang
        self.lang2id = params.lang2id
        self.use_lang_emb = getattr(params, 'use_lang_emb', True)
        assert len(self.dico) == self.n_words
        assert len(self.id2lang) == len(self.lang2id) == self.n_langs

        # model parameters
        self.dim = params.emb_dim
        self.hidden_dim = self.dim * 4
        self.n_heads = params.n_heads
        self.n_layers = params.n_layers
        self.dropout = params.dropout
        self.attention_dropout = params.attention_dropout
        assert self.dim % self.n_heads == 0, 'transformer dim must be a multiple of n_heads'

        # embeddings
        self.position_embeddings = Embedding(N_MAX_POSITIONS, self.dim)
        if params.sinusoidal_embeddings:
            create_sinusoidal_embeddings(N_MAX_POSITIONS, self.dim, out=self.position_embeddings.weight)
        if params.n_langs > 1 and self.use_lang_emb:
            self.lang_embeddings = Embedding(self.n_langs, self.dim)
        self.embeddings = Embedding(self.n_words, self.dim, padding_idx=self.pad_index)
        self.layer_norm_emb = nn.LayerNorm(self.dim, eps=1e-12)

        # transformer layers
        self.attentions = nn.ModuleList()
        self.layer_norm1 = nn.ModuleList()
        self.ffns = nn.ModuleList()
        self.layer_norm2 = nn.ModuleList()
        if self.is_decoder:
            self.layer_norm15 = nn.ModuleList()
            self.encoder_attn = nn.ModuleList()

        for layer_id in range(self.n_layers):
            self.attentions.append(MultiHeadAttention(self.n_heads, self.dim, dropout=self.attention_dropout))
            self.layer_norm1.append(nn.LayerNorm(self.dim, eps=1e-12))
            if self.is_decoder:
                self.layer_norm15.append(nn.LayerNorm(self.dim, eps=1e-12))
                self.encoder_attn.append(MultiHeadAttention(self.n_heads, self.dim, dropout=self.attention_dropout))
            self.ffns.append(TransformerFFN(self.dim, self.hidden_dim, self.dim, dropout=self.dropout, gelu_activation=params.gelu_activation))
            self.layer_norm2.append(nn.LayerNorm(self.dim, eps=1e-12))

        # output layer
        if self.with_output:
            self.pred_layer = PredLayer(params)
            if params.share_inout_emb:
                self.pred_layer.proj.weight = self.embeddings.weight

    def forward(self, mode, **kwargs):
        """
        Forward function with different forward modes.
        ### Small hack to handle PyTorch distributed.
        """
        if mode == 'fwd':
            return self.fwd(**kwargs)
        elif mode == 'predict':
            return self.predict(**kwargs)
        else:
            raise Exception("Unknown mode: %s" % mode)

    def fwd(self, x, lengths, causal, src_enc=None, src_len=None, positions=None, langs=None, cache=None):
        """
        Inputs:
            `x` LongTensor(slen, bs), containing word indices
            `lengths` LongTensor(bs), containing the length of each sentence
            `causal` Boolean, if True, the attention is only done over previous hidden states
            `positions` LongTensor(slen, bs), containing word positions
            `langs` LongTensor(slen, bs), containing language IDs
        """
        # check inputs
        slen, bs = x.size()
        assert lengths.size(0) == bs
        assert lengths.max().item() <= slen
        x = x.transpose(0, 1)  # batch size as dimension 0
        assert (src_enc is None) == (src_len is None)
        if src_enc is not None:
            assert self.is_decoder
            assert src_enc.size(0) == bs

        # generate masks
        mask, attn_mask = get_masks(slen, lengths, causal)
        if self.is_decoder and src_enc is not None:
            src_mask = torch.arange(src_len.max(), dtype=torch.long, device=lengths.device) < src_len[:, None]

        # positions
        if positions is None:
            positions = x.new(slen).long()
            positions = torch.arange(slen, out=positions).unsqueeze(0)
        else:
            assert positions.size() == (slen, bs)
            positions = positions.transpose(0, 1)

        # langs
        if langs is not None:
            assert langs.size() == (slen, bs)
            langs = langs.transpose(0, 1)

        # do not recompute cached elements
        if cache is not None:
            _slen = slen - cache['slen']
            x = x[:, -_slen:]
            positions = positions[:, -_slen:]
            if langs is not None:
                langs = langs[:, -_slen:]
            mask = mask[:, -_slen:]
            attn_mask = attn_mask[:, -_slen:]

        # embeddings
        tensor = self.embeddings(x)
        tensor = tensor + self.position_embeddings(positions).expand_as(tensor)
        if langs is not None and self.use_lang_emb:
            tensor = tensor + self.lang_embeddings(langs)
        tensor = self.layer_norm_emb(tensor)
        tensor = F.dropout(tensor, p=self.dropout, training=self.training)
        tensor *= mask.unsqueeze(-1).to(tensor.dtype)

        # transformer layers
        for i in range(self.n_layers):

            # self attention
            attn = self.attentions[i](tensor, attn_mask, cache=cache)
            attn = F.dropout(attn, p=self.dropout, training=self.training)
            tensor = tensor + attn
            tensor = self.layer_norm1[i](tensor)

            # encoder attention (for decoder only)
            if self.is_decoder and src_enc is not None:
                attn = self.encoder_attn[i](tensor, src_mask, kv=src_enc, cache=cache)
                attn = F.dropout(attn, p=self.dropout, training=self.training)
                tensor = tensor + attn
                tensor = self.layer_norm15[i](tensor)

            # FFN
            tensor = tensor + self.ffns[i](tensor)
            tensor = self.layer_norm2[i](tensor)

            tensor *= mask.unsqueeze(-1).to(tensor.dtype)

        # update cache length
        if cache is not None:
            cache['slen'] += tensor.size(1)

        # move back sequence length to dimension 0
        tensor = tensor.transpose(0, 1)

        return tensor

    def predict(self, tensor, pred_mask, y, get_scores):
        """
        Given the last hidden state, compute word scores and/or the loss.
        """
        masked_tensor = tensor[pred_mask.unsqueeze(-1).expand_as(tensor)].view(-1, self.dim)
        scores, loss = self.pred_layer(masked_tensor, y, get_scores)
        return scores, loss

    def generate_beam(self, src_enc, src_len, tgt_lang_id, beam_size, length_penalty, early_stopping, max_len=200):
        """
        Decode a sentence given initial start.
        """

        # check inputs
        assert src_enc.size(0) == src_len.size(0)
        assert beam_size >= 1

        # batch size / number of words
        bs = len(src_len)
        n_words = self.n_words

        # expand to beam size the source latent representations / source lengths
        src_enc = src_enc.unsqueeze(1).expand((bs, beam_size) + src_enc.shape[1:]).contiguous().view((bs * beam_size,) + src_enc.shape[1:])
        src_len = src_len.unsqueeze(1).expand(bs, beam_size).contiguous().view(-1)

        # generated sentences (batch with beam current hypotheses)
        generated = src_len.new(max_len, bs * beam_size)  # upcoming output
        generated.fill_(self.pad_index)                   # fill upcoming ouput with <PAD>
        generated[0].fill_(self.eos_index)                # we use <EOS> for <BOS> everywhere

        # generated hypotheses
        generated_hyps = [BeamHypotheses(beam_size, max_len, length_penalty, early_stopping) for _ in range(bs)]

        # positions
        positions = src_len.new(max_len).long()
        positions = torch.arange(max_len, out=positions).unsqueeze(1).expand_as(generated)

        # language IDs
        langs = positions.clone().fill_(tgt_lang_id)

        # scores for each sentence in the beam
        beam_scores = src_enc.new(bs, beam_size).fill_(0)
        beam_scores[:, 1:] = -1e9
        beam_scores = beam_scores.view(-1)

        # current position
        cur_len = 1

        # cache compute states
        cache = {'slen': 0}

        # done sentences
        done = [False for _ in range(bs)]

        while cur_len < max_len:

            # compute word scores
            tensor = self.forward(
                'fwd',
                x=generated[:cur_len],
                lengths=src_len.new(bs * beam_size).fill_(cur_len),
                positions=positions[:cur_len],
                langs=langs[:cur_len],
                causal=True,
                src_enc=src_enc,
                src_len=src_len,
                cache=cache
            )
            assert tensor.size() == (1, bs * beam_size, self.dim)
            tensor = tensor.data[-1, :, :]               # (bs * beam_size, dim)
            scores = self.pred_layer.get_scores(tensor)  # (bs * beam_size, n_words)
            scores = F.log_softmax(scores, dim=-1)       # (bs * beam_size, n_words)
            assert scores.size() == (bs * beam_size, n_words)

            # select next words with scores
            _scores = scores + beam_scores[:, None].expand_as(scores)  # (bs * beam_size, n_words)
            _scores = _scores.view(bs, beam_size * n_words)            # (bs, beam_size * n_words)

            next_scores, next_words = torch.topk(_scores, 2 * beam_size, dim=1, largest=True, sorted=True)
            assert next_scores.size() == next_words.size() == (bs, 2 * beam_size)

            # next batch beam content
            # list of (bs * beam_size) tuple(next hypothesis score, next word, current position in the batch)
            next_batch_beam = []

            # for each sentence
            for sent_id in range(bs):

                # if we are done with this sentence
                done[sent_id] = done[sent_id] or generated_hyps[sent_id].is_done(next_scores[sent_id].max().item())
                if done[sent_id]:
                    next_batch_beam.extend([(0, self.pad_index, 0)] * beam_size)  # pad the batch
                    continue

                # next sentence beam content
                next_sent_beam = []

                # next words for this sentence
                for idx, value in zip(next_words[sent_id], next_scores[sent_id]):

                    # get beam and word IDs
                    beam_id = idx // n_words
                    word_id = idx % n_words

                    # end of sentence, or next word
                    if word_id == self.eos_index or cur_len + 1 == max_len:
                        generated_hyps[sent_id].add(generated[:cur_len, sent_id * beam_size + beam_id].clone(), value.item())
                    else:
                        next_sent_beam.append((value, word_id, sent_id * beam_size + beam_id))

                    # the beam for next step is full
                    if len(next_sent_beam) == beam_size:
                        break

                # update next beam content
                assert len(next_sent_beam) == 0 if cur_len + 1 == max_len else beam_size
                if len(next_sent_beam) == 0:
                    next_sent_beam = [(0, self.pad_index, 0)] * beam_size  # pad the batch
                next_batch_beam.extend(next_sent_beam)
                assert len(next_batch_beam) == beam_size * (sent_id + 1)

            # sanity check / prepare next batch
            assert len(next_batch_beam) == bs * beam_size
            beam_scores = beam_scores.new([x[0] for x in next_batch_beam])
            beam_words = generated.new([x[1] for x in next_batch_beam])
            beam_idx = src_len.new([x[2] for x in next_batch_beam])

            # re-order batch and internal states
            generated = generated[:, beam_idx]
            generated[cur_len] = beam_words
            for k in cache.keys():
                if k != 'slen':
                    cache[k] = (cache[k][0][beam_idx], cache[k][1][beam_idx])

            # update current length
            cur_len = cur_len + 1

            # stop when we are done with each sentence
            if all(done):
                break

        # select the best hypotheses
        tgt_len = src_len.new(bs)
        best = []

        for i, hypotheses in enumerate(generated_hyps):
            best_hyp = max(hypotheses.hyp, key=lambda x: x[0])[1]
            tgt_len[i] = len(best_hyp) + 1  # +1 for the <EOS> symbol
            best.append(best_hyp)

        # generate target batch
        decoded = src_len.new(tgt_len.max().item(), bs).fill_(self.pad_index)
        for i, hypo in enumerate(best):
            decoded[:tgt_len[i] - 1, i] = hypo
            decoded[tgt_len[i] - 1, i] = self.eos_index

        # sanity check
        assert (decoded == self.eos_index).sum() == 2 * bs

        return decoded, tgt_len


class BeamHypotheses(object):

    def __init__(self, n_hyp, max_len, length_penalty, early_stopping):
        """
        Initialize n-best list of hypotheses.
        """
        self.max_len = max_len - 1  # ignoring <BOS>
        self.length_penalty = length_penalty
        self.early_stopping = early_stopping
        self.n_hyp = n_hyp
        self.hyp = []
        self.worst_score = 1e9

    def __len__(self):
        """
        Number of hypotheses in the list.
        """
        return len(self.hyp)

    def add(self, hyp, sum_logprobs):
        """
        Add a new hypothesis to the list.
        """
        score = sum_logprobs / len(hyp) ** self.length_penalty
        if len(self) < self.n_hyp or score > self.worst_score:
            self.hyp.append((score, hyp))
            if len(self) > self.n_hyp:
                sorted_scores = sorted([(s, idx) for idx, (s, _) in enumerate(self.hyp)])
                del self.hyp[sorted_scores[0][1]]
                self.worst_score = sorted_scores[1][0]
            else:
                self.worst_score = min(score, self.worst_score)

    def is_done(self, best_sum_logprobs):
        """
        If there are enough hypotheses and that none of the hypotheses being generated
        can become better than the worst one in the heap, then we are done with this sentence.
        """
        if len(self) < self.n_hyp:
            return False
        elif self.early_stopping:
            return True
        else:
            return self.worst_score >= best_sum_logprobs / self.max_len ** self.length_penalty


def batch_sentences(sentences, pad_index, eos_index):
    """
    Take as input a list of n sentences (torch.LongTensor vectors) and return
    a tensor of size (slen, n) where slen is the length of the longest
    sentence, and a vector lengths containing the length of each sentence.
    """
    lengths = torch.LongTensor([len(s) + 2 for s in sentences])
    sent = torch.LongTensor(lengths.max().item(), lengths.size(0)).fill_(pad_index)

    sent[0] = eos_index
    for i, s in enumerate(sentences):
        if lengths[i] > 2:  # if sentence not empty
            sent[1:lengths[i] - 1, i].copy_(torch.from_numpy(s.astype(np.int64)))
        sent[lengths[i] - 1, i] = eos_index

    return sent, lengths


def translate_batch(encoder, decoder, params, sentences, lang1, lang2):
    """As EncDecEvaluator.evaluate_mt does it for one batch (eval_bleu, beam_size > 1)."""
    lang1_id = params.lang2id[lang1]
    lang2_id = params.lang2id[lang2]
    x1, len1 = batch_sentences(sentences, params.pad_index, params.eos_index)
    langs1 = x1.clone().fill_(lang1_id)

    # encode source sentence
    enc1 = encoder('fwd', x=x1, lengths=len1, langs=langs1, causal=False)
    enc1 = enc1.transpose(0, 1)

    # generate translation - translate / convert to text
    max_len = int(1.5 * len1.max().item() + 10)
    generated, lengths = decoder.generate_beam(
        enc1, len1, lang2_id, beam_size=params.beam_size,
        length_penalty=params.length_penalty,
        early_stopping=params.early_stopping,
        max_len=max_len
    )
    return generated, lengths, max_len


def reverse_pair(params, n):
    """Toy parallel data: the 'fr' sentence is the 'en' one reversed."""
    src = np.random.randint(4, params.n_words, size=n)
    return src, src[::-1].copy()


def mt_step(encoder, decoder, params, optimizer, lang1, lang2):
    """
    Machine translation step, as EncDecTrainer.mt_step takes it (no back-translation).
    """
    encoder.train()
    decoder.train()
    lang1_id = params.lang2id[lang1]
    lang2_id = params.lang2id[lang2]

    pairs = [reverse_pair(params, np.random.randint(2, 12)) for _ in range(params.batch_size)]
    x1, len1 = batch_sentences([p[0] for p in pairs], params.pad_index, params.eos_index)
    x2, len2 = batch_sentences([p[1] for p in pairs], params.pad_index, params.eos_index)
    langs1 = x1.clone().fill_(lang1_id)
    langs2 = x2.clone().fill_(lang2_id)

    # target words to predict
    alen = torch.arange(len2.max(), dtype=torch.long, device=len2.device)
    pred_mask = alen[:, None] < len2[None] - 1  # do not predict anything given the last target word
    y = x2[1:].masked_select(pred_mask[:-1])
    assert len(y) == (len2 - 1).sum().item()

    # encode source sentence
    enc1 = encoder('fwd', x=x1, lengths=len1, langs=langs1, causal=False)
    enc1 = enc1.transpose(0, 1)

    # decode target sentence
    dec2 = decoder('fwd', x=x2, lengths=len2, langs=langs2, causal=True, src_enc=enc1, src_len=len1)

    # loss
    _, loss = decoder('predict', tensor=dec2, pred_mask=pred_mask, y=y, get_scores=False)

    # optimize
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss.item()


def mt_scores(encoder, decoder, params, x1, len1, x2, len2, lang1, lang2):
    """Teacher-forced sum of log-probs per sentence, the tensors laid out as mt_step lays them."""
    lang1_id = params.lang2id[lang1]
    lang2_id = params.lang2id[lang2]
    langs1 = x1.clone().fill_(lang1_id)
    langs2 = x2.clone().fill_(lang2_id)

    # target words to predict
    alen = torch.arange(len2.max(), dtype=torch.long, device=len2.device)
    pred_mask = alen[:, None] < len2[None] - 1  # do not predict anything given the last target word
    y = x2[1:].masked_select(pred_mask[:-1])
    assert len(y) == (len2 - 1).sum().item()

    enc1 = encoder('fwd', x=x1, lengths=len1, langs=langs1, causal=False)
    enc1 = enc1.transpose(0, 1)
    dec2 = decoder('fwd', x=x2, lengths=len2, langs=langs2, causal=True, src_enc=enc1, src_len=len1)

    scores, _ = decoder('predict', tensor=dec2, pred_mask=pred_mask, y=y, get_scores=True)
    lprobs = F.log_softmax(scores, dim=-1).gather(1, y[:, None]).squeeze(1)
    # pred_mask is (slen, bs) and masked_select walks it time-major: put each token back in its column
    token_lp = torch.zeros(pred_mask.shape).masked_scatter_(pred_mask, lprobs)
    return token_lp.sum(0)


# ----------------------------------------------------------------------------------------
# reference: one sentence alone, no padding, no cache, the whole prefix re-run every step

def reference_beam(encoder, decoder, params, src, lang1, lang2, max_len):
    eos, pad = params.eos_index, params.pad_index
    beam_size, n_words = params.beam_size, params.n_words
    x1 = torch.LongTensor([eos] + src.tolist() + [eos])[:, None]
    len1 = torch.LongTensor([x1.size(0)])
    enc1 = encoder('fwd', x=x1, lengths=len1, langs=x1.clone().fill_(params.lang2id[lang1]), causal=False)
    enc1 = enc1.transpose(0, 1)  # (1, slen, dim)

    hyps = BeamHypotheses(beam_size, max_len, params.length_penalty, params.early_stopping)
    beams = [([eos], 0.0)]  # live prefixes and their summed log-probs
    cur_len = 1
    while cur_len < max_len:
        prefixes = torch.LongTensor([p for p, _ in beams]).t()  # (cur_len, n_live)
        n_live = prefixes.size(1)
        out = decoder('fwd', x=prefixes, lengths=torch.full((n_live,), cur_len, dtype=torch.long),
                      langs=prefixes.clone().fill_(params.lang2id[lang2]), causal=True,
                      src_enc=enc1.expand(n_live, -1, -1), src_len=len1.expand(n_live))
        lprobs = F.log_softmax(decoder.pred_layer.get_scores(out[-1]), dim=-1)  # (n_live, n_words)
        total = lprobs + torch.tensor([s for _, s in beams])[:, None]
        cand = sorted(((total[b, w].item(), b, w) for b in range(n_live) for w in range(n_words)),
                      key=lambda c: -c[0])[:2 * beam_size]
        if hyps.is_done(cand[0][0]):
            break
        new_beams = []
        for value, b, w in cand:
            if w == eos or cur_len + 1 == max_len:
                hyps.add(torch.LongTensor(beams[b][0]), value)
            else:
                new_beams.append((beams[b][0] + [w], value))
            if len(new_beams) == beam_size:
                break
        if not new_beams:
            break
        beams = new_beams
        cur_len += 1
    score, best = max(hyps.hyp, key=lambda h: h[0])
    return best, score


def main():
    torch.set_num_threads(1)  # tiny tensors: extra threads only add contention
    torch.manual_seed(0)
    np.random.seed(0)

    id2word = {0: BOS_WORD, 1: EOS_WORD, 2: PAD_WORD, 3: UNK_WORD}
    for i in range(4, 28):
        id2word[i] = 'w%i' % i
    dico = Dictionary(id2word)

    params = AttrDict(
        n_words=len(dico), eos_index=dico.eos_index, pad_index=dico.pad_index,
        n_langs=2, id2lang={0: 'en', 1: 'fr'}, lang2id={'en': 0, 'fr': 1}, use_lang_emb=True,
        emb_dim=32, n_heads=4, n_layers=2, dropout=0.1, attention_dropout=0.1,
        gelu_activation=True, sinusoidal_embeddings=False, share_inout_emb=True,
        beam_size=3, length_penalty=1.0, early_stopping=False,
        batch_size=32, n_train_steps=150,
    )
    encoder = TransformerModel(params, dico, is_encoder=True, with_output=True)
    decoder = TransformerModel(params, dico, is_encoder=False, with_output=True)
    optimizer = torch.optim.Adam(list(encoder.parameters()) + list(decoder.parameters()), lr=3e-3)
    for _ in range(params.n_train_steps):
        loss = mt_step(encoder, decoder, params, optimizer, 'en', 'fr')
    print('mt_step loss after %i steps: %.3f' % (params.n_train_steps, loss))
    encoder.eval()
    decoder.eval()

    # source sentences of different lengths (dataset ids, no specials)
    lengths = [7, 2, 11, 4, 9]
    sentences = [np.random.randint(4, params.n_words, size=n) for n in lengths]

    with torch.no_grad():
        decoded, tgt_len, max_len = translate_batch(encoder, decoder, params, sentences, 'en', 'fr')
        print('decoded (time-major, pad=%i):' % params.pad_index)
        print(decoded)
        print('tgt_len', tgt_len.tolist(), 'max_len', max_len)

        # 1. every sentence's best hypothesis matches the sentence translated alone, uncached
        ref_scores = []
        for i, src in enumerate(sentences):
            ref_hyp, ref_score = reference_beam(encoder, decoder, params, src, 'en', 'fr', max_len)
            got = decoded[:tgt_len[i] - 1, i]
            assert torch.equal(got, ref_hyp), (i, got.tolist(), ref_hyp.tolist())
            assert decoded[tgt_len[i] - 1, i].item() == params.eos_index
            assert (decoded[tgt_len[i]:, i] == params.pad_index).all()
            ref_scores.append(ref_score)
        print('best hypotheses match each sentence decoded alone (no padding, no cache)')

        # 2. the decoded batch, teacher-forced as mt_step lays it out, scores each pair as it scores alone
        x1, len1 = batch_sentences(sentences, params.pad_index, params.eos_index)
        batch_lp = mt_scores(encoder, decoder, params, x1, len1, decoded, tgt_len, 'en', 'fr')
        for i, src in enumerate(sentences):
            x1_i, len1_i = batch_sentences([src], params.pad_index, params.eos_index)
            x2_i = decoded[:tgt_len[i], i:i + 1]
            alone_lp = mt_scores(encoder, decoder, params, x1_i, len1_i, x2_i, tgt_len[i:i + 1], 'en', 'fr')
            assert torch.allclose(batch_lp[i], alone_lp[0], atol=1e-4), (i, batch_lp[i].item(), alone_lp[0].item())
            # a hypothesis that ended on its own </s> scores sum_logprobs / len(hyp) ** length_penalty
            if tgt_len[i] < max_len:
                expect = alone_lp[0].item() / (tgt_len[i].item() - 1) ** params.length_penalty
                assert abs(expect - ref_scores[i]) < 1e-4, (i, expect, ref_scores[i])
        print('teacher-forced log-probs: batch == alone', [round(v, 4) for v in batch_lp.tolist()])
    print('ok')


if __name__ == '__main__':
    main()
