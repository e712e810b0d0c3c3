"""checks/mediapad.py: a language model's mask against the model call's attention_mask carried through its media
placeholders (media-padding-shifted)."""

from __future__ import annotations

from pathlib import Path

from checkbugs import check_bug, first, traced

MEDIA = Path(__file__).parent / "data" / "mediapad"


def _expanded(ids: list[list[int]], media: int, patches: int, pad: int, total: int) -> list[list[str]]:
    """Per row of a right-padded batch, what each of the `total` slots holds after expanding every `media` id into
    `patches` slots, as the upstream fix lays it out: "text", "media", "pad" (the ids' own pads) or "extra" (the
    slots the expansion leaves over, at the end)."""
    rows = []
    for row in ids:
        slots = []
        for one in row:
            slots += ["media"] * patches if one == media else ["pad" if one == pad else "text"]
        rows.append(slots + ["extra"] * (total - len(slots)))
    return rows


def _left_empty(slots: list[list[str]]) -> list[set[int]]:
    """Per row, the media slots that the buggy merge left empty: it wrote the media into the row's LAST free slots
    (media or extra: VideoLlava's skip of the first `nb_image_pad` free slots is the same)."""
    out = []
    for row in slots:
        free = [k for k, one in enumerate(row) if one in ("media", "extra")]
        taken = set(free[len(free) - row.count("media"):])
        out.append({k for k, one in enumerate(row) if one == "media" and k not in taken})
    return out


def test_video_llava_right_padded_merge_video_tokens_shifted_into_pad(tmp_path):
    """transformers#34305: VideoLlava's merge with right padding, row 0 one <video> (2 frames x 5 patches: 10 slots)
    and 4 pads, row 1 two videos. The upstream layout (the fix's) puts row 0's video at slots 3-12 and its padding at
    16-28; the buggy merge wrote the video into the row's last 10 free slots (12 and 20-28), so slots 3-11 were left
    empty and hidden. The first of them, by a double loop over the upstream layout, is the cell: batch row 0, key 3
    (its own query, which hides it). Its fix: quiet."""
    hits = check_bug(tmp_path, "video_llava_right_padded_merge_video_tokens_shifted_into_pad", "media-padding-shifted")
    v, p = 127, 0
    ids = [[1, 5, 6, v, 7, 8, 9, p, p, p, p], [1, 5, 6, v, 10, 11, v, 12, 13, 14, 15]]
    empty = _left_empty(_expanded(ids, v, 10, p, 29))
    assert tuple(hits[0]["cell"]) == first((2, 29, 29), lambda b, q, k: q == k and k in empty[b])
    assert "keys 20-28 are padding slots it keeps instead" in hits[0]["message"]


def test_mini_vlm_right_padded_image_slots_taken_from_row_end_eager(tmp_path):
    """Written another way: a dataclass config's image_token_id, 4 patches per <image>, eager softmax with an additive
    causal & padding mask; the merge took each row's last free slots for the images, so row 1 (one image, 4 pads)
    holds its image at slots 3 and 11-13. The first image slot of the upstream layout it left empty is the cell
    (row 1, key 0);
    its fix (the first free slots) is quiet."""
    name = "mini_vlm_right_padded_image_slots_taken_from_row_end_eager"
    status, found, report = traced(tmp_path, name, False, MEDIA)
    assert status == 1, report
    hits = [f for f in found if f["code"] == "media-padding-shifted" and f["severity"] == "wrong"]
    assert hits, report
    i, p = 63, 0
    empty = _left_empty(_expanded([[i, 5, 6, 7, 8, i, 9, 10], [i, 11, 12, 13, p, p, p, p]], i, 4, p, 14))
    assert tuple(hits[0]["cell"]) == first((2, 14, 14), lambda b, q, k: q == k and k in empty[b])
    assert "image_token_id=63" in hits[0]["message"]
    status, found, report = traced(tmp_path, name, True, MEDIA)
    assert status == 0 and [f for f in found if f["severity"] in ("wrong", "suspicious")] == [], report


def test_mini_vlm_left_padded_merge_offset_quiet(tmp_path):
    """The same model over a left-padded batch, merged right (each row shifted by the slots its expansion leaves
    over): the mask keeps each row's last real tokens, as the stated padding carried through the images says."""
    status, found, report = traced(tmp_path, "mini_vlm_left_padded_merge_offset_quiet", False, MEDIA)
    assert status == 0 and [f for f in found if f["severity"] in ("wrong", "suspicious")] == [], report
