"""sees-later-media (checks/media.py): a Flamingo-style media cross-attention whose text sees an image placed after
it, where the attending module states only_attend_previous=True."""

from __future__ import annotations

from checkbugs import caught, check_bug, first


def test_text_that_attends_the_next_image_against_only_attend_previous(tmp_path):
    """Otter#41 (written blind): `attend_previous` False shifts each caption to the next image (a softmax of its own,
    `lang_x`, 2 images of 3 latents in one row). Written another way: SDPA with a bool keep mask, `input_ids`, every
    previous image visible, the media counter one token early, a batch of 2. Both fixes quiet."""
    found = check_bug(tmp_path, "otter_flamingo_media_placement_attend_next_image", "sees-later-media")
    ids = [3, 10, 11, 2, 3, 12, 13, 2]
    at = [i for i, t in enumerate(ids) if t == 3]
    # text_time after the buggy shift: the image count so far, +1 off the media tokens, 0 past the last image
    time, count = [], 0
    for i, t in enumerate(ids):
        count += t == 3
        shifted = count if t == 3 else count + 1
        time.append(shifted if shifted <= len(at) else 0)
    assert tuple(found[0]["cell"]) == first((1, 8, 6), lambda b, q, k: time[q] == k // 3 + 1 and at[k // 3] > q)
    hit = caught(tmp_path, "media_mask_counts_images_one_token_early", ("sees-later-media",))
    rows = [[5, 1, 2, 5, 3, 4], [1, 5, 2, 3, 5, 4]]
    nxt = [[sum(t == 5 for t in row[1:q + 2]) for q in range(6)] for row in rows]  # images counted one token early
    places = [[i for i, t in enumerate(row) if t == 5] for row in rows]
    assert tuple(hit["cell"]) == first((2, 6, 4), lambda b, q, k: nxt[b][q] >= k // 2 + 1 and places[b][k // 2] > q)
