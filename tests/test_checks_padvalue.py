"""checks/padvalue.py: an attention_mask padded with the pad id (its values above 1 only on the pad id's tokens, a run
at one edge of each row) states its 1s as the tokens; read by real.py (padding-ignored) and kept from numbered.py's
packed samples and globaltokens.py's global marks. On TRL#885's DPO collator (written blind, batch blind-gq) and a
loop over rows as reference."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings, strategies as st

from checkbugs import check_bug
from maskcli.checks.padvalue import padded_with_id


def test_dpo_collator_masks_padded_with_the_pad_id_are_flagged_and_masks_padded_with_0_are_not(tmp_path):
    # huggingface/trl#885 (48b3ef0b): the DPO collator padded `*_attention_mask` with padding_value, the pad id 2, so
    # generate's left-padded prompts attend their padding (transformers reads any nonzero as attend); the fix pads
    # masks with 0. Its fix was a false alarm before: padding-unused held `chosen_attention_mask` (12 tokens, in
    # get_batch_samples' batch dict) against generate's decode step over 12 keys, whose own attention_mask the kernel
    # keeps to (checks/heldextra.stated_instead). Prompts of 7, 2 and 4 tokens, left-padded to 8 (row 1: 6 pads)
    [hit, *_] = check_bug(tmp_path, "trl_dpo_collator_attention_mask_padded_with_padding_value", "padding-ignored")
    message = " ".join(hit["message"].split())
    assert message.startswith("batch row 1: query 5 sees key 0, which the attention_mask (padded with the pad id 2, "
                              "not 0) given to LlamaForCausalLM marks as padding"), message


def _reference(mask, ids, pad_id):
    values = {int(v) for row in mask for v in row if v > 1}
    if len(values) != 1 or values != {pad_id} or not any(v == 1 for row in mask for v in row):
        return None
    rows = []
    for m_row, i_row in zip(mask, ids):
        at = [p for p, v in enumerate(m_row) if v > 1]
        if any(i_row[p] != pad_id for p in at) or len(at) == len(m_row):
            return None
        if at and (at != list(range(at[0], at[-1] + 1)) or not (at[0] == 0 or at[-1] == len(m_row) - 1)):
            return None
        rows.append(bool(at))
    return pad_id if any(rows) else None


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 4), st.integers(2, 7), st.integers(2, 3), st.data())
def test_padded_with_id_matches_a_loop_over_rows(rows, length, pad_id, data):
    mask = np.array(data.draw(st.lists(st.lists(st.integers(0, 3), min_size=length, max_size=length),
                                       min_size=rows, max_size=rows)), dtype=np.int64)
    ids = np.array(data.draw(st.lists(st.lists(st.integers(0, 4), min_size=length, max_size=length),
                                      min_size=rows, max_size=rows)), dtype=np.int64)
    if data.draw(st.booleans()):  # (the pad id where the mask says so: the collator's way)
        ids = np.where(mask > 1, pad_id, ids)
    assert padded_with_id({"attention_mask": mask, "input_ids": ids, "pad_id": pad_id}) == \
        _reference(mask.tolist(), ids.tolist(), pad_id)
