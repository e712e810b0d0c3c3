"""ForwardTacotron: the masked L1 loss built its length mask along the mel-bin axis, not the frame axis.

Citation: as-ideas/ForwardTacotron#21 ("Loss masking bug?"), fixed by as-ideas/ForwardTacotron#22
("Fixed masking bug with swapped axes.", merged; repository now axelspringer/ForwardTacotron).
The PR diff was not read; the "after" code below is the fix as the issue and PR title describe it.

The bug: the model returns mels laid (batch, n_mels, frames) (``x.transpose(1, 2)`` at the end of
ForwardTacotron.forward), but MaskedL1 took ``max_len = target.size(1)``: the mel-bin count (80),
not the frame count. ``pad_mask(lens, 80)`` compares frame lengths (hundreds of frames) with bin
indices 0..79, so it is all ones, and ``mask.unsqueeze(2).expand_as(x)`` spreads it over the
frames: the right-padded frames of the shorter utterances are scored as if they were speech.
As the maintainer put it, "it simply does not mask anything".

The fix: the frame length is read from the frame axis (``target.size(2)``) and the per-frame mask
is broadcast over the mel bins (``mask.unsqueeze(1)``).

This program keeps the project's shapes: a collate that right-pads the mels of a batch to the
longest one, a toy ForwardTacotron-like model (embedding, length regulator from durations,
conv + BiLSTM, linear to n_mels, transposed to (B, n_mels, T)), and MaskedL1 as trainer/common.py
writes it, at toy sizes with random weights; one training step prints the losses.
"""

import sys

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv

torch.manual_seed(0)
np.random.seed(0)


class Hparams:
    n_mels = 80
    num_chars = 40
    embed_dims = 32
    rnn_dims = 32
    mel_pad_value = -11.5129  # log(1e-5): silence in the project's log-mel scale


hp = Hparams()


# --------------------------------------------------------------------------- utils (trainer/common.py)

def pad_mask(lens, max_len):
    batch_size = lens.size(0)
    seq_range = torch.arange(0, max_len).long()
    seq_range = seq_range.unsqueeze(0)
    seq_range = seq_range.expand(batch_size, max_len)
    if lens.is_cuda:
        seq_range = seq_range.cuda()
    lens = lens.unsqueeze(1)
    lens = lens.expand_as(seq_range)
    mask = seq_range < lens
    return mask.float()


class MaskedL1(torch.nn.Module):

    def forward(self, x, target, lens):
        target.requires_grad = False
        if FIXED:
            max_len = target.size(2)
            mask = pad_mask(lens, max_len)
            mask = mask.unsqueeze(1).expand_as(x)
        else:
            max_len = target.size(1)
            mask = pad_mask(lens, max_len)
            mask = mask.unsqueeze(2).expand_as(x)
        loss = F.l1_loss(x * mask, target * mask, reduction='sum')
        return loss / mask.sum()


# --------------------------------------------------------------------------- data (utils/dataset.py)

def pad1d(x, max_len):
    return np.pad(x, (0, max_len - len(x)), mode='constant')


def pad2d(x, max_len):
    return np.pad(x, ((0, 0), (0, max_len - x.shape[-1])), mode='constant',
                  constant_values=hp.mel_pad_value)


def collate_tts(batch):
    x_lens = [len(x[0]) for x in batch]
    max_x_len = max(x_lens)
    chars = np.stack([pad1d(x[0], max_x_len) for x in batch])
    spec_lens = [x[1].shape[-1] for x in batch]
    max_spec_len = max(spec_lens)
    mel = np.stack([pad2d(x[1], max_spec_len) for x in batch])
    dur = np.stack([pad1d(x[2], max_x_len) for x in batch])
    chars = torch.tensor(chars).long()
    mel = torch.tensor(mel).float()
    dur = torch.tensor(dur).long()
    mel_lens = torch.tensor(spec_lens)
    return chars, mel, mel_lens, dur


def make_item(n_chars, n_frames):
    chars = np.random.randint(1, hp.num_chars, size=n_chars)
    dur = np.full(n_chars, n_frames // n_chars)
    dur[-1] += n_frames - dur.sum()
    mel = np.random.randn(hp.n_mels, n_frames).astype(np.float32) - 4.0
    return chars, mel, dur


# --------------------------------------------------------------------------- model (models/forward_tacotron.py)

class LengthRegulator(nn.Module):

    def forward(self, x, dur):
        return self.expand(x, dur)

    @staticmethod
    def build_index(duration, x):
        duration[duration < 0] = 0
        tot_duration = duration.cumsum(1).detach().cpu().numpy().astype('int')
        max_duration = int(tot_duration.max().item())
        index = np.zeros([x.shape[0], max_duration, x.shape[2]], dtype='long')
        for i in range(tot_duration.shape[0]):
            pos = 0
            for j in range(tot_duration.shape[1]):
                pos1 = tot_duration[i, j]
                index[i, pos:pos1, :] = j
                pos = pos1
            index[i, pos:, :] = j
        return torch.LongTensor(index).to(duration.device)

    def expand(self, x, dur):
        idx = self.build_index(dur, x)
        y = torch.gather(x, 1, idx)
        return y


class ForwardTacotron(nn.Module):

    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(hp.num_chars, hp.embed_dims)
        self.lr = LengthRegulator()
        self.prenet = nn.Conv1d(hp.embed_dims, hp.embed_dims, 3, padding=1)
        self.lstm = nn.LSTM(hp.embed_dims, hp.rnn_dims, batch_first=True, bidirectional=True)
        self.lin = nn.Linear(2 * hp.rnn_dims, hp.n_mels)
        self.postnet = nn.Conv1d(hp.n_mels, hp.n_mels, 5, padding=2)

    def forward(self, x, mel, dur):
        x = self.embedding(x)
        x = self.prenet(x.transpose(1, 2)).transpose(1, 2)
        x = self.lr(x, dur)
        x, _ = self.lstm(x)
        x = F.dropout(x, p=0.0, training=self.training)
        x = self.lin(x)
        x = x.transpose(1, 2)
        x_post = x + self.postnet(x)
        return x, x_post


# --------------------------------------------------------------------------- trainer (trainer/forward_trainer.py)

def main():
    batch = [make_item(12, 240), make_item(9, 150), make_item(7, 100)]
    x, m, mel_lens, dur = collate_tts(batch)

    model = ForwardTacotron()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    l1_loss = MaskedL1()

    model.train()
    m1_hat, m2_hat = model(x, m, dur)
    m1_loss = l1_loss(m1_hat, m, mel_lens)
    m2_loss = l1_loss(m2_hat, m, mel_lens)
    loss = m1_loss + m2_loss
    optimizer.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()

    print(f"mel shape {tuple(m.shape)}, mel_lens {mel_lens.tolist()}")
    print(f"m1_loss {m1_loss.item():.6f}  m2_loss {m2_loss.item():.6f}")

    model.eval()
    with torch.no_grad():
        m1_hat, m2_hat = model(x, m, dur)
        print(f"after one step: m2_loss {l1_loss(m2_hat, m, mel_lens).item():.6f}")


if __name__ == "__main__":
    main()
