"""checks/locallayers.py (and trace/layerkinds.py): a layer GPT-Neo's config names local whose real query sees more
keys than its window_size, against the cells worked out here from the program's own positions by a double loop
(checkbugs.first): a key the query sees more than window_size positions back (past even a window counted without
the query's own key)."""

from __future__ import annotations

from pathlib import Path

from checkbugs import check_bug, first, traced

LOCAL = Path(__file__).parent / "data" / "locallayers"


def test_trtmc_gpt_neo_every_layer_given_the_global_causal_mask(tmp_path):
    # NVIDIA/TensorRT-Model-Connect 78c8085f1 (written blind, batch blind-ff): RAW_CONFIG's attention_types
    # [[["global", "local"], 2]] and window_size 4; the prefill of 10 tokens attends over the 32 static-cache slots
    # (none written yet) then the 10 new keys, and layer 1 (local) gets the plain causal mask
    window, slots, n = 4, 32, 10
    key_pos = list(range(slots)) + list(range(n))
    written = [False] * slots + [True] * n  # (the runtime mask: no slot below past_length 0)

    def beyond(b, q, k):  # the buggy mask lets query q (position q) see key k, more than `window` positions back
        return written[k] and key_pos[k] <= q and q - key_pos[k] > window

    ref = first((1, n, slots + n), beyond)
    assert ref == (0, 5, 32)
    hits = check_bug(tmp_path, "trtmc_gpt_neo_local_layers_use_global_causal_mask", "local-layer-unwindowed")
    assert sorted(int(h["message"].split("layer ")[1].split(" ")[0]) for h in hits) == [1, 3]  # the local layers
    assert tuple(hits[0]["cell"]) == ref
    assert "attention_types (layer 1: 'local'), window_size=4" in hits[0]["message"]
    assert "`layer_idx` = 1 in decoder_step" in hits[0]["message"]


def test_a_dataclass_config_left_padded_sdpa_module_layers(tmp_path):
    """Written another way: a dataclass's attention_layers on every block, ModuleList layer numbers, a left-padded
    batch, SDPA with a bool keep-mask, a growing cache."""
    window = 3
    ids = [[0, 0, 5, 6, 7, 8, 9], [11, 12, 13, 14, 15, 16, 17]]
    real = [[t != 0 for t in row] for row in ids]
    pos = [[max(sum(r[: i + 1]) - 1, 0) for i in range(len(r))] for r in real]

    def beyond(b, q, k):
        return real[b][q] and real[b][k] and pos[b][k] <= pos[b][q] and pos[b][q] - pos[b][k] > window

    ref = first((2, 7, 7), beyond)
    hits = check_bug(tmp_path, "gptneo_dataclass_layers_sdpa_left_padded_causal_everywhere", "local-layer-unwindowed",
                     folder=LOCAL)
    assert tuple(hits[0]["cell"]) == ref == (0, 6, 2)
    assert "self.config of Block (NeoConfig): attention_layers[1] = 'local', window_size=3" in hits[0]["message"]
    assert len(hits) == 2  # layers 1 and 2


def test_quiet_on_transformers_gpt_neo(tmp_path):
    status, found, report = traced(tmp_path, "hf_gptneo_local_layers_left_padded_generate", False, LOCAL)
    assert status == 0 and not [f for f in found if f["severity"] in ("wrong", "suspicious")], report


def _windows(grid: int, window: int):
    """The window of each patch of a grid x grid image, row-major, as SAM's window_partition cuts it (zero padding to
    a multiple of the window goes on the right and the bottom: no patch changes window)."""
    return [(r // window, c // window) for r in range(grid) for c in range(grid)]


def test_trtmc_sam_window_layers_run_as_global_attention(tmp_path):
    # NVIDIA/TensorRT-Model-Connect#950 (written blind, batch blind-ff): SAM_CFG states window_size 14 and
    # global_attn_indexes [1, 3] over 4 layers; layers 0 and 2 attend over the whole 20 x 20 grid of one image
    grid, window = 20, 14
    where = _windows(grid, window)
    ref = first((1, grid * grid, grid * grid), lambda b, q, k: where[q] != where[k])  # a key of another window
    hits = check_bug(tmp_path, "trtmc_sam_vit_window_layers_run_as_global_attention", "local-layer-unwindowed")
    assert len(hits) == 2 and tuple(hits[0]["cell"][:2]) == ref[:2] == (0, 0)
    assert "global_attn_indexes (layer 0 not among them), window_size=14" in hits[0]["message"]
    assert "the 196 patches of its 14x14 window; but batch row 0's query 0 sees 400 keys" in hits[0]["message"]
    assert "`layer_idx` = 2 in encode_image" in hits[1]["message"]


def test_vitdet_dataclass_window_blocks_built_global(tmp_path):
    """Written another way: ViTDet's window_block_indices in a dataclass the backbone keeps, blocks in a ModuleList,
    2 images on a 6 x 6 grid padded to 4 x 4 windows, SDPA with no mask."""
    grid, window = 6, 4
    where = _windows(grid, window)
    ref = first((2, grid * grid, grid * grid), lambda b, q, k: where[q] != where[k])
    hits = check_bug(tmp_path, "vitdet_dataclass_window_blocks_built_with_window_zero", "local-layer-unwindowed",
                     folder=LOCAL)
    assert tuple(hits[0]["cell"][:2]) == ref[:2]
    assert "self.config of Backbone (BackboneConfig): window_block_indices (layer 0: 'local')" in hits[0]["message"]
    assert "sees 36 keys" in hits[0]["message"]


def test_quiet_on_transformers_sam_vision_encoder(tmp_path):
    status, found, report = traced(tmp_path, "hf_sam_vision_encoder_windows_correct", False, LOCAL)
    assert status == 0 and not [f for f in found if f["severity"] in ("wrong", "suspicious")], report
