"""checks/blockwindow.py: a local attention in blocks of its own window where a module around it states another."""

from __future__ import annotations

from pathlib import Path

from checkbugs import check_bug, first

BLOCKWINDOW = Path(__file__).parent / "data" / "blockwindow"


def test_snac_local_attention_window_size_not_passed(tmp_path):
    """hubertsiuzdak/snac 946c3bf (written blind, batch blind-ed): SNAC.__init__ kept `attn_window_size = 8` and built
    its Encoder and Decoder without it, so their LocalMHA reshaped 64 frames into blocks of its default 32. The first
    cell the configured window hides, by a double loop over block 0's query 0: a key in the same 32-frame block,
    outside the 8-frame one."""
    hit = check_bug(tmp_path, "snac_codec_local_attention_window_size_not_passed", "window-not-handed")[0]
    assert tuple(hit["cell"]) == first((1, 1, 32), lambda b, q, k: k // 32 == q // 32 and k // 8 != q // 8), hit
    assert "self.attn_window_size of SNAC states a window of 8" in hit["message"], hit["message"]
    assert "blocks of 32 keys" in hit["message"], hit["message"]


def test_config_window_of_a_padded_speech_encoder_never_passed(tmp_path):
    """Written another way: a config dataclass (`self.cfg.local_window = 16`), a padded batch (108 and 100 frames of
    128), softmax attention over (B * blocks, H, window, window) scores; the blocks built with their default 64."""
    hit = check_bug(tmp_path, "speech_encoder_block_attention_config_window_unused", "window-not-handed", BLOCKWINDOW)[0]
    assert tuple(hit["cell"]) == first((1, 1, 64), lambda b, q, k: k // 64 == q // 64 and k // 16 != q // 16), hit
    assert "self.cfg.local_window of SpeechEncoder states a window of 16" in hit["message"], hit["message"]


def test_quiet_where_the_windows_agree_or_the_blocks_are_not_the_layers_window():
    """The rule reads the statements trace recorded: agreeing statements are not recorded; blocks of another size than
    the layer's own window (a 2-D 7 x 7 window of 49 keys) say nothing of a convention, and neither does a cross call."""
    from types import SimpleNamespace

    from maskcli.checks.blockwindow import block_window
    from maskcli.checks.context import Run

    def call(shape, stated, **details):
        return SimpleNamespace(shape=shape, details={"block_windows": stated, **details}, index=0, where="x",
                               api="sdpa", stored=None)

    stated = [(8, "self.window of Model"), (32, "self.window_size of Local")]
    assert len(block_window(Run([call((2, 2, 32, 32), stated)], [], [], []))) == 1  # (the snac reading)
    assert block_window(Run([call((2, 2, 49, 49), [(4, "a"), (7, "b")])], [], [], [])) == []  # (blocks of 7 x 7)
    assert block_window(Run([call((2, 2, 1, 32), stated)], [], [], [])) == []  # (one query: a decode step)
