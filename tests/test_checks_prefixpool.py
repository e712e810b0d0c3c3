"""checks/prefixpool.py (and trace/prefixpool.py): an attention pool over the tokens against the prefix tokens its
model states the pooling leaves out."""

from __future__ import annotations

from pathlib import Path

from checkbugs import check_bug, traced

PREFIXPOOL = Path(__file__).parent / "data" / "prefixpool"


def _first_prefix_seen(keep_rows: list[list[bool]], prefix: int, queries: int) -> tuple[int, int, int]:
    """The first (batch row, query, key) of a pool's keep rows (one per batch row, every query alike) that is one of
    the first `prefix` keys: a plain loop over absolute key positions."""
    for b, row in enumerate(keep_rows):
        for q in range(queries):
            for k in range(len(row)):
                if k < prefix and row[k]:
                    return b, q, k
    raise AssertionError("no prefix key seen")


def test_timm_naflexvit_map_pool_prefix_tokens_polarity(tmp_path):
    """pytorch-image-models 4d9c87bb: with pool_include_prefix=False the MAP latent attended the class and the 4
    register tokens; the fix slices them off (`x[:, num_prefix_tokens:]`: 16 keys, quiet)."""
    hits = check_bug(tmp_path, "timm_naflexvit_map_pool_prefix_tokens_polarity", "pool-sees-prefix")
    prefix = 1 + 4  # class_token + reg_tokens of the program's NaFlexVitCfg
    keys = prefix + (16 // 4) ** 2  # 16x16 images in 4x4 patches; the pool is unmasked (patch_valid None)
    assert tuple(hits[0]["cell"]) == _first_prefix_seen([[True] * keys] * 2, prefix, 1)
    assert "num_prefix_tokens=5" in hits[0]["message"] and "pool_include_prefix=False" in hits[0]["message"]


def test_siglip_naflex_mha_probe_pool_keeps_cls(tmp_path):
    """Written another way: the config a dict kept as `self.cfg`, right-padded patches, blocks by masked_fill +
    softmax, the pool an nn.MultiheadAttention probe whose key_padding_mask calls the class token real. The cell is the
    first prefix key the probe's mask keeps (built here by a loop over the program's lengths); the fix is quiet."""
    status, found, report = traced(tmp_path, "siglip_naflex_mha_probe_pool_keeps_cls", False, PREFIXPOOL)
    assert status == 1, report
    hit = next(f for f in found if f["code"] == "pool-sees-prefix")
    assert hit["severity"] == "wrong"
    prefix, lengths, longest = 1, (9, 6), 9
    rows = [[True] * prefix + [p < n for p in range(longest)] for n in lengths]  # the probe's keys, valid = seen
    assert tuple(hit["cell"]) == _first_prefix_seen(rows, prefix, 1)
    status, found, report = traced(tmp_path, "siglip_naflex_mha_probe_pool_keeps_cls", True, PREFIXPOOL)
    assert status == 0 and [f for f in found if f["severity"] in ("wrong", "suspicious")] == [], report


def test_naflex_mha_probe_pool_prefix_hidden_by_mask(tmp_path):
    """Quiet: all N tokens handed to the probe, the class token hidden by its key_padding_mask."""
    status, found, report = traced(tmp_path, "naflex_mha_probe_pool_prefix_hidden_by_mask", False, PREFIXPOOL)
    assert status == 0 and [f for f in found if f["severity"] in ("wrong", "suspicious")] == [], report
