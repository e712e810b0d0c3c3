"""InferSent BiLSTM sentence encoder, pool_type="mean": the mean divides each sentence by another one's length.

Citation: facebookresearch/InferSent commit ad225b0 ("Fixed mean normalization", models.py,
``InferSent.forward``), reported as facebookresearch/InferSent#51 ("Two pooling issues", point 1).

The bug: ``forward`` sorts the batch by length to pack it, and overwrote ``sent_len`` with the
sorted lengths (``sent_len, idx_sort = np.sort(sent_len)[::-1], np.argsort(-sent_len)``). The LSTM
outputs are put back in the caller's order (``index_select(1, idx_unsort)``), but the mean pooling
then divides each row's sum over time by ``sent_len``, which is still in sorted order: for any batch
not already sorted by decreasing length (train_nli.py's ``evaluate`` builds its batches with
``data.get_batch`` in dataset order), a sentence's summed states are divided by some other
sentence's length.

The fix: keep the sorted lengths apart (``sent_len_sorted``), pack with them, and divide by the
caller's ``sent_len``.

Ported from models.py at ad225b0^ (InferSent, NLINet) with data.get_batch and train_nli.evaluate,
at toy sizes with random word vectors (word_emb_dim 16, enc_lstm_dim 12, fc_dim 8) and
``pool_type="mean"`` (train_nli.py's ``--pool_type mean``). Two CPU adaptations: the mean branch's
unconditional ``.cuda()`` is taken only when the model is on CUDA, and the reversed numpy view of
the sorted lengths is copied (as commit c4d43da later did) because current torch refuses negative
strides in ``pack_padded_sequence``.
"""

import sys

import numpy as np
import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv


class InferSent(nn.Module):

    def __init__(self, config):
        super(InferSent, self).__init__()
        self.bsize = config['bsize']
        self.word_emb_dim = config['word_emb_dim']
        self.enc_lstm_dim = config['enc_lstm_dim']
        self.pool_type = config['pool_type']
        self.dpout_model = config['dpout_model']
        self.version = 1 if 'version' not in config else config['version']

        self.enc_lstm = nn.LSTM(self.word_emb_dim, self.enc_lstm_dim, 1,
                                bidirectional=True, dropout=self.dpout_model)

        assert self.version in [1, 2]
        if self.version == 1:
            self.bos = '<s>'
            self.eos = '</s>'
            self.max_pad = True
            self.moses_tok = False
        elif self.version == 2:
            self.bos = '<p>'
            self.eos = '</p>'
            self.max_pad = False
            self.moses_tok = True

    def is_cuda(self):
        # either all weights are on cpu or they are on gpu
        return self.enc_lstm.bias_hh_l0.data.is_cuda

    def forward(self, sent_tuple):
        # sent_len: [max_len, ..., min_len] (bsize)
        # sent: (seqlen x bsize x worddim)
        sent, sent_len = sent_tuple

        # Sort by length (keep idx)
        if FIXED:
            sent_len_sorted, idx_sort = np.sort(sent_len)[::-1], np.argsort(-sent_len)
            sent_len_sorted = sent_len_sorted.copy()
        else:
            sent_len, idx_sort = np.sort(sent_len)[::-1], np.argsort(-sent_len)
            sent_len = sent_len.copy()
            sent_len_sorted = sent_len
        idx_unsort = np.argsort(idx_sort)

        idx_sort = torch.from_numpy(idx_sort).cuda() if self.is_cuda() \
            else torch.from_numpy(idx_sort)
        sent = sent.index_select(1, idx_sort)

        # Handling padding in Recurrent Networks
        sent_packed = nn.utils.rnn.pack_padded_sequence(sent, sent_len_sorted)
        sent_output = self.enc_lstm(sent_packed)[0]  # seqlen x batch x 2*nhid
        sent_output = nn.utils.rnn.pad_packed_sequence(sent_output)[0]

        # Un-sort by length
        idx_unsort = torch.from_numpy(idx_unsort).cuda() if self.is_cuda() \
            else torch.from_numpy(idx_unsort)
        sent_output = sent_output.index_select(1, idx_unsort)

        # Pooling
        if self.pool_type == "mean":
            sent_len = torch.FloatTensor(sent_len.copy()).unsqueeze(1)
            sent_len = sent_len.cuda() if self.is_cuda() else sent_len
            emb = torch.sum(sent_output, 0).squeeze(0)
            emb = emb / sent_len.expand_as(emb)
        elif self.pool_type == "max":
            if not self.max_pad:
                sent_output[sent_output == 0] = -1e9
            emb = torch.max(sent_output, 0)[0]
            if emb.ndimension() == 3:
                emb = emb.squeeze(0)
                assert emb.ndimension() == 2

        return emb


class NLINet(nn.Module):
    def __init__(self, config):
        super(NLINet, self).__init__()

        # classifier
        self.nonlinear_fc = config['nonlinear_fc']
        self.fc_dim = config['fc_dim']
        self.n_classes = 3
        self.enc_lstm_dim = config['enc_lstm_dim']
        self.encoder_type = config['encoder_type']
        self.dpout_fc = config['dpout_fc']

        self.encoder = eval(self.encoder_type)(config)
        self.inputdim = 4*2*self.enc_lstm_dim
        if self.nonlinear_fc:
            self.classifier = nn.Sequential(
                nn.Dropout(p=self.dpout_fc),
                nn.Linear(self.inputdim, self.fc_dim),
                nn.Tanh(),
                nn.Dropout(p=self.dpout_fc),
                nn.Linear(self.fc_dim, self.fc_dim),
                nn.Tanh(),
                nn.Dropout(p=self.dpout_fc),
                nn.Linear(self.fc_dim, self.n_classes),
                )
        else:
            self.classifier = nn.Sequential(
                nn.Linear(self.inputdim, self.fc_dim),
                nn.Linear(self.fc_dim, self.fc_dim),
                nn.Linear(self.fc_dim, self.n_classes)
                )

    def forward(self, s1, s2):
        # s1 : (s1, s1_len)
        u = self.encoder(s1)
        v = self.encoder(s2)

        features = torch.cat((u, v, torch.abs(u-v), u*v), 1)
        output = self.classifier(features)
        return output

    def encode(self, s1):
        emb = self.encoder(s1)
        return emb


def get_batch(batch, word_vec, emb_dim):
    # sent in batch in decreasing order of lengths (bsize, max_len, word_dim)
    lengths = np.array([len(x) for x in batch])
    max_len = np.max(lengths)
    embed = np.zeros((max_len, len(batch), emb_dim))

    for i in range(len(batch)):
        for j in range(len(batch[i])):
            embed[j, i, :] = word_vec[batch[i][j]]

    return torch.from_numpy(embed).float(), lengths


def main():
    torch.manual_seed(1234)
    np.random.seed(1234)

    # a dev split in dataset order (not sorted by length), with <s> ... </s> as train_nli.py adds
    s1 = ["a man is playing a guitar on the stage",
          "two dogs run",
          "a woman slices an onion in the kitchen",
          "kids play"]
    s2 = ["a person plays music",
          "the animals are sleeping on the couch",
          "someone cooks",
          "children are outside playing in the park today"]
    target = np.array([0, 2, 1, 0])
    s1 = [['<s>'] + s.split() + ['</s>'] for s in s1]
    s2 = [['<s>'] + s.split() + ['</s>'] for s in s2]

    words = sorted({w for s in s1 + s2 for w in s})
    emb_dim = 16
    word_vec = {w: np.random.randn(emb_dim) for w in words}

    config_nli_model = {
        'n_words': len(word_vec),
        'word_emb_dim': emb_dim,
        'enc_lstm_dim': 12,
        'n_enc_layers': 1,
        'dpout_model': 0.,
        'dpout_fc': 0.,
        'fc_dim': 8,
        'bsize': 4,
        'n_classes': 3,
        'pool_type': 'mean',
        'nonlinear_fc': 0,
        'encoder_type': 'InferSent',
        'use_cuda': False,
    }
    nli_net = NLINet(config_nli_model)
    nli_net.eval()

    batch_size = 4
    correct = 0.
    with torch.no_grad():
        for i in range(0, len(s1), batch_size):
            # prepare batch
            s1_batch, s1_len = get_batch(s1[i:i + batch_size], word_vec, emb_dim)
            s2_batch, s2_len = get_batch(s2[i:i + batch_size], word_vec, emb_dim)
            tgt_batch = torch.LongTensor(target[i:i + batch_size])

            # model forward
            output = nli_net((s1_batch, s1_len), (s2_batch, s2_len))

            pred = output.data.max(1)[1]
            correct += pred.long().eq(tgt_batch.data.long()).cpu().sum().item()

            u = nli_net.encode((s1_batch, s1_len))
            print("s1 lengths", s1_len.tolist())
            print("s1 embedding norms", [round(x, 4) for x in u.norm(dim=1).tolist()])
            print("logits", [[round(x, 4) for x in row] for row in output.tolist()])
            print("pred", pred.tolist())

    eval_acc = round(100 * correct / len(s1), 2)
    print("accuracy", eval_acc)


if __name__ == "__main__":
    main()
