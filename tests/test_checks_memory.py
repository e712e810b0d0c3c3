"""checks/memory.py: a cross-attention against the encoder padding the model call states."""

from __future__ import annotations

from checkbugs import first, traced
from pathlib import Path

from maskcli.checks.context import Run, Top
from maskcli.checks.memory import memory

ARGS = Path(__file__).parent / "data" / "args"


def test_gpt2_cross_attention_drops_encoder_mask(tmp_path):
    """huggingface/transformers#47946: encoder_attention_mask overwritten with None before the cross mask is built."""
    from checkbugs import check_bug

    check_bug(tmp_path, "gpt2_cross_attention_drops_encoder_mask", "encoder-padding-ignored")


def test_memory_key_padding_mask_not_passed(tmp_path):
    """Written another way: nn.TransformerDecoder, memory left-padded and stated True = padding, never handed on; the
    first cell reported is the first a double loop finds over the stated padding (the call has no mask)."""
    import torch

    status, found, report = traced(tmp_path, "memory_padding_not_passed", fixed=False, folder=ARGS)
    assert status == 1, report
    hit = next(f for f in found if f["code"] == "encoder-padding-ignored")
    assert hit["severity"] == "wrong"
    padded = torch.tensor([[True, True, False, False], [False] * 4, [True, False, False, False]])
    assert tuple(hit["cell"]) == first((3, 7, 4), lambda b, q, k: bool(padded[b, k]))
    status, found, report = traced(tmp_path, "memory_padding_not_passed", fixed=True, folder=ARGS)
    assert status == 0 and [f for f in found if f["severity"] in ("wrong", "suspicious")] == [], report


class _Call:
    def __init__(self, cells, index=0):
        import numpy as np

        self.index, self.where, self.step, self.api = index, "decoder.0.encoder_attn", 0, "sdpa"
        self.shape = cells.shape
        self.details = {}
        self.mask = "m"
        self.stored = {"form": "dense"}
        self._cells = np.asarray(cells, dtype=bool)


def _run(cells, arguments, config=None, monkeypatch=None):
    import maskcli.checks.memory as module

    call = _Call(cells)
    monkeypatch.setattr(module, "keep", lambda c: c._cells)
    return Run([], [Top("Model", config, arguments, 0, 1)], [call])


def test_against_nn_multihead_attention(monkeypatch):
    """The mask nn.MultiheadAttention builds from a key_padding_mask is quiet; the same keys unmasked for one batch row
    are found at the cell a double loop gives."""
    import numpy as np
    import torch

    pad = torch.tensor([[False, False, False, True, True], [False] * 5])
    mha = torch.nn.MultiheadAttention(4, 1, batch_first=True)
    _, weights = mha(torch.randn(2, 3, 4), torch.randn(2, 5, 4), torch.randn(2, 5, 4), key_padding_mask=pad)
    cells = (weights > 0).detach().numpy()[:, None]  # (2, 1, 3, 5): what MHA let each query see
    arguments = {"memory_key_padding_mask": pad.numpy().astype(np.int64)}
    assert memory(_run(cells, arguments, monkeypatch=monkeypatch)) == []
    leaky = cells.copy()
    leaky[0, :, 1, :] = True
    (_, finding), = memory(_run(leaky, arguments, monkeypatch=monkeypatch))
    assert finding.cell == first((2, 3, 5), lambda b, q, k: bool(leaky[b, 0, q, k] and pad[b, k]))


def test_encoder_decoder_attention_mask_and_all_padding_row(monkeypatch):
    """An encoder-decoder's attention_mask is its encoder's; a batch row whose memory is all padding is left alone."""
    import numpy as np

    class Config:
        is_encoder_decoder = True

    cells = np.ones((2, 1, 2, 3), dtype=bool)
    arguments = {"attention_mask": np.array([[1, 1, 0], [0, 0, 0]])}
    (_, finding), = memory(_run(cells, arguments, Config(), monkeypatch))
    assert finding.cell == (0, 0, 2)
    assert memory(_run(cells, {"attention_mask": np.array([[1, 1, 1], [0, 0, 0]])}, Config(), monkeypatch)) == []
    assert memory(_run(cells, arguments, None, monkeypatch)) == []  # a decoder-only model's attention_mask is its own
