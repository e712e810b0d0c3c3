"""checks/heldfold.py: a held padding read over a call that folds its sequence into the batch in chunks of the keys,
against a double loop over positions."""

from __future__ import annotations

import numpy as np

from maskcli.checks.heldfold import chunked, padded_batch


def test_chunked_against_double_loop():
    real = np.zeros((3, 12), dtype=bool)
    for b, n in enumerate((12, 7, 2)):
        for j in range(12 - n, 12):  # left padding
            real[b, j] = True
    folded = chunked(real, 9, 4)
    for r in range(9):
        for k in range(4):
            assert folded[r, k] == real[r // 3, (r % 3) * 4 + k]
    assert chunked(real, 3, 12) is None  # (no fold: the keys are the sequence)
    assert chunked(real, 6, 4) is None  # (not as many rows as chunks)
    assert chunked(real, 6, 5) is None  # (12 positions are no whole number of chunks of 5)


def test_padded_batch():
    assert padded_batch(np.array([[1, 1, 1], [1, 1, 0]], dtype=bool), True)
    assert not padded_batch(np.array([[1, 1, 1], [0, 1, 1]], dtype=bool), True)  # (a plain `mask`: right only)
    assert padded_batch(np.array([[1, 1, 1], [0, 1, 1]], dtype=bool), False)
    assert not padded_batch(np.array([[1, 1, 1], [0, 0, 0]], dtype=bool), False)  # (a row with no real token)
    assert not padded_batch(np.array([[1, 0, 1], [1, 1, 1]], dtype=bool), False)  # (not one run at an edge)


def test_beyond_batch_reads_a_first_axis_folded_with_the_module_heads():
    """fairseq's MultiheadAttention lays `bsz * num_heads` rows on the first axis (heads axis 1): 4 rows of a module
    stating 4 heads are one sample, so lengths of a batch of 4 held by the program's main() (quiet-r146b: each utterance
    run alone after the batch) are not this call's; 16 rows are 4 samples, and a module stating no heads is read as
    its rows."""
    from types import SimpleNamespace

    from maskcli.checks.heldfold import beyond_batch

    lengths = {"kind": "lengths", "rows": np.array([12, 5, 9, 3])}
    alone = SimpleNamespace(shape=(4, 1, 1, 12), details={"own_heads": 4})
    assert beyond_batch(None, alone, lengths)
    assert not beyond_batch(None, SimpleNamespace(shape=(16, 1, 1, 12), details={"own_heads": 4}), lengths)
    assert not beyond_batch(None, SimpleNamespace(shape=(4, 1, 1, 12), details={}), lengths)
    assert not beyond_batch(None, SimpleNamespace(shape=(4, 4, 1, 12), details={"own_heads": 4}), lengths)  # (heads apart)
    assert not beyond_batch(None, alone, {"kind": "lengths", "rows": np.array([12])})


BEAMS = """import sys
import torch
import torch.nn as nn


class Attention(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x, memory, mask):
        scores = self.q(x) @ self.k(memory).transpose(-1, -2) / x.shape[-1] ** 0.5
        if mask is not None:
            scores = scores.masked_fill(mask, float("-inf"))  # mask: True = padding, (B, 1, Lk)
        return torch.softmax(scores, dim=-1) @ self.v(memory)


class Encoder(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.attn = Attention(d)

    def forward(self, x, mask):
        return self.attn(x, x, mask) + x


class Decoder(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.cross_attn = Attention(d)

    def forward(self, y, memory, memory_mask):
        return self.cross_attn(y, memory, memory_mask) + y


def main():
    torch.manual_seed(0)
    d = 8
    encoder, decoder = Encoder(d), Decoder(d)
    lengths = [5, 3, 4]
    source = torch.randn(3, 5, d)
    pad = torch.arange(5)[None, :] >= torch.tensor(lengths)[:, None]
    source = source.masked_fill(pad[:, :, None], 0.0)
    memory = encoder(source, pad[:, None, :])
    target = torch.randn(3, 2, d)
    out = decoder(target, memory, pad[:, None, :] if "--fixed" in sys.argv else None)  # teacher-forced training step
    print("train", float(out.detach().sum()))
    # beam search over the first sentence alone: its memory repeated for 3 beams
    one = source[:1, :lengths[0]]
    one_pad = torch.zeros(1, 1, lengths[0], dtype=torch.bool)
    memory = encoder(one, one_pad).repeat(3, 1, 1)
    beams = torch.randn(3, 1, d)
    for step in range(2):
        beams = torch.cat([beams, decoder(beams, memory, one_pad)[:, -1:]], dim=1)
    print("beams", float(beams.sum()))


if __name__ == "__main__":
    main()
"""


def test_a_memory_copied_from_another_batch_is_not_held_to_the_batch_lengths(tmp_path):
    """A beam search over one sentence, its memory one encoder row repeated per beam, while main() holds the training
    batch's lengths of as many rows (quiet-r157b, tunz/transformer-pytorch's decoder.py): the beams' cross-attention
    is quiet; the training step's cross-attention handed no mask is still caught, as the encoder's padding dropped."""
    from checkbugs import traced

    (tmp_path / "beams.py").write_text(BEAMS)
    status, found, output = traced(tmp_path, "beams", True, folder=tmp_path)
    assert status == 0 and not found, output
    status, found, output = traced(tmp_path, "beams", False, folder=tmp_path)
    assert status == 1 and {f["code"] for f in found} == {"encoder-padding-ignored"}, output
