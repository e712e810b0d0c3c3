"""checks/padids.py: a padding mask the program holds that calls real the keys its batch's own token ids pad, on a
reproduction of a published bug (right-padded, causal SDPA) and on a program written otherwise (left-padded by hand,
a bidirectional eager encoder), and quiet where the mask keeps to the ids' padding or nothing is padded."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import maskcli
from checkbugs import caught, check_bug, first, traced as traced_program
from maskcli.checks.padids import id_padding
from maskcli.checks.registry import severity

BLIND = Path(__file__).parent / "data" / "blind"

PADIDS = Path(__file__).parent / "data" / "padids"


def test_xtuner_preference_collate_fn_mask_rows_is_flagged_and_its_fix_is_not(tmp_path):
    # InternLM/xtuner#859: `attention_mask[:i] = True` sets whole batch rows: every row all ones, the padding attended
    check_bug(tmp_path, "xtuner_preference_collate_fn_mask_rows", "pad-ids-unmasked")


def test_xtuner_default_collate_fn_mask_rows_by_length_is_flagged_and_its_fix_is_not(tmp_path):
    # InternLM/xtuner#829 (commit 16e2f8f1a): the same line in default_collate_fn, its batch handed to transformers'
    # LlamaForCausalLM (pad_token_id 0): the model call's own input_ids and attention_mask, no frame of the program's
    pytest.importorskip("transformers")
    check_bug(tmp_path, "xtuner_default_collate_fn_attention_mask_rows_by_length", "pad-ids-unmasked")


def test_openrlhf_vllm_samples_mask_built_from_already_padded_ids_is_flagged_and_its_fix_is_not(tmp_path):
    # OpenRLHF f2f3016e (written blind, blind-hx, round 54; caught before tuning): `_generate_vllm` right-pads
    # input_ids and then builds `[1] * len(input_ids) + [0] * ...` from the padded list: an all-ones mask over pads
    pytest.importorskip("transformers")
    [hit, *_] = check_bug(tmp_path, "openrlhf_vllm_samples_attention_mask_from_padded_input_ids", "pad-ids-unmasked")
    assert "input_ids ends in a run of id 0, found nowhere else, in 3 of 4 rows" in hit["message"]


def test_a_numpy_collator_that_fills_the_mask_by_columns_is_flagged_at_a_padded_cell(tmp_path):
    """Written otherwise: a numpy collator (`mask[:, :len(sample)] = 1`), four rows right-padded with id 0, GPT-2
    (no pad id stated) handed the batch as a dict. Against a double loop: the cell named is one a causal mask lets a
    query see, whose key is a pad of its row (past its sample's length), and the count is every such cell."""
    pytest.importorskip("transformers")
    hit = check_bug(tmp_path, "gpt2_numpy_collate_mask_by_columns", "pad-ids-unmasked", PADIDS)[0]
    lengths = (6, 3, 9, 4)
    cells = [(b, q, k) for b, n in enumerate(lengths) for q in range(9) for k in range(q + 1) if k >= n]
    assert tuple(hit["cell"]) in cells and f"({len(cells)} such cells, padded queries only)" in hit["message"]


class Encoder(nn.Module):
    """A bidirectional eager encoder: attention_mask (B, L), 1 = real, filled with -inf before the softmax."""

    def __init__(self, vocab=50, dim=8, heads=2):
        super().__init__()
        self.heads, self.embed, self.qkv = heads, nn.Embedding(vocab, dim), nn.Linear(dim, 3 * dim)

    def forward(self, input_ids, attention_mask):
        x = self.embed(input_ids)
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        scores = (q @ k.transpose(-1, -2)).masked_fill(attention_mask[:, None, None, :] == 0, float("-inf"))
        return (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, n, d)


PAD = 3
SAMPLES = [[5, 9, 12, 7, 20], [8, 11], [14, 6, 30]]


def left_padded() -> torch.Tensor:
    """The samples padded on the left by hand to the longest, with PAD."""
    width = max(map(len, SAMPLES))
    return torch.tensor([[PAD] * (width - len(s)) + s for s in SAMPLES])


def traced(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> list:
    torch.manual_seed(0)
    with maskcli.trace() as t, torch.no_grad():
        Encoder()(input_ids, attention_mask)
    return [(f.code, severity(f), f.cell) for group in t.groups() for f in group.findings]


def test_a_left_padded_batch_whose_mask_is_all_ones_is_flagged_at_its_first_real_query():
    ids = left_padded()
    found = [f for f in traced(ids, torch.ones_like(ids)) if f[0] == "pad-ids-unmasked"]
    # reference: every query sees every key (all ones, bidirectional); the ids' padding by a double loop over the rows
    pads = [[j < len(ids[0]) - len(s) for j in range(len(ids[0]))] for s in SAMPLES]
    real_q = [[not p for p in row] for row in pads]
    expected = first((3, 5, 5), lambda b, q, k: real_q[b][q] and pads[b][k])
    assert [(code, sev) for code, sev, _ in found] == [("pad-ids-unmasked", "wrong")]
    assert tuple(found[0][2])[0] == expected[0] and tuple(found[0][2])[2] == expected[2]


def test_quiet_where_the_mask_keeps_to_the_ids_padding_or_nothing_is_padded():
    ids = left_padded()
    assert [f for f in traced(ids, (ids != PAD).long()) if f[1] == "wrong"] == []
    unpadded = torch.randint(4, 50, (3, 6), generator=torch.Generator().manual_seed(1))
    assert [f for f in traced(unpadded, torch.ones_like(unpadded)) if f[1] == "wrong"] == []


def test_id_padding_reads_only_a_run_of_one_id_found_nowhere_else():
    real, pad = id_padding(left_padded().numpy())
    assert pad == PAD and real.sum(axis=1).tolist() == [5, 2, 3]
    eos_pads = torch.tensor([[5, 9, 2, 2, 2], [8, 2, 11, 6, 2]])  # pad id = eos, used inside the text too: not read
    assert id_padding(eos_pads.numpy()) is None
    one_each = torch.tensor([[5, 9, 12, 0], [8, 11, 13, 0]])  # every row the same run: a shared last token, not padding
    assert id_padding(one_each.numpy()) is None


def test_mlx_vlm_batch_quantized_cache_mask_ignores_left_padding_is_flagged_and_its_fix_is_not(tmp_path):
    # Blaizzy/mlx-vlm#1208: the batch cache's make_mask returns "causal" / None, its own left_padding never applied
    check_bug(tmp_path, "mlx_vlm_batch_quantized_cache_mask_ignores_left_padding", "left-padding-attended")


def generate(left_padding: list[int], use_padding: bool, steps: int = 2) -> list:
    """Written otherwise: a left-padded batch decoded step by step by an eager softmax over a key list kept by hand,
    the padding a plain local list, the mask a tril slice (and the padding slots hidden where `use_padding`)."""
    torch.manual_seed(0)
    rows, prompt, dim = len(left_padding), 4, 8
    proj = nn.Linear(dim, 3 * dim)
    with maskcli.trace() as t, torch.no_grad():
        x, keys, values = torch.randn(rows, prompt, dim), None, None
        for _ in range(steps + 1):
            q, k, v = proj(x).chunk(3, dim=-1)
            keys = k if keys is None else torch.cat([keys, k], 1)
            values = v if values is None else torch.cat([values, v], 1)
            n, total = q.shape[1], keys.shape[1]
            mask = torch.ones(total, total, dtype=torch.bool).tril()[total - n:][None].expand(rows, n, total)
            if use_padding:
                mask = mask & (torch.arange(total)[None, None, :] >= torch.tensor(left_padding)[:, None, None])
            scores = (q @ keys.transpose(1, 2)).masked_fill(~mask, float("-inf"))
            x = scores.softmax(-1) @ values
            x = x[:, -1:]
    return [(f.code, severity(f), f.cell) for group in t.groups() for f in group.findings]


def test_a_hand_kept_cache_that_never_masks_its_left_padding_is_flagged_at_prefill_and_decode():
    left_padding = [0, 3, 1]
    found = [f for f in generate(left_padding, use_padding=False) if f[0] == "left-padding-attended"]
    assert {sev for _, sev, _ in found} == {"wrong"} and len(found) == 3  # the prefill and both decode steps
    # reference at prefill: a double loop over the causal cells of each row's real queries
    expected = first((3, 4, 4), lambda b, q, k: k <= q and q >= left_padding[b] and k < left_padding[b])
    assert tuple(found[0][2]) == expected


def test_quiet_where_the_left_padding_is_masked_or_no_row_is_padded():
    assert [f for f in generate([0, 3, 1], use_padding=True) if f[1] == "wrong"] == []
    assert [f for f in generate([0, 0, 0], use_padding=False) if f[1] == "wrong"] == []


def test_id_padding_does_not_read_a_sampled_token_repeated_at_one_rows_end():
    sampled = torch.tensor([[5, 9, 12, 7, 25, 25], [8, 11, 4, 4, 6, 7], [1, 2, 3, 4, 5, 6]])
    assert id_padding(sampled.numpy()) is None


def test_modelopt_calib_dataloader_drops_attention_mask_is_flagged_and_its_fix_is_not(tmp_path):
    # NVIDIA/Model-Optimizer#1261: the calibration dataset keeps input_ids only, so the left-padded batches reach the
    # model with no attention_mask: a plain causal mask, the pads attended
    check_bug(tmp_path, "modelopt_calib_dataloader_drops_attention_mask", "left-pads-never-masked")


class TinyGPT(nn.Module):
    """Written otherwise: nanoGPT's shape, `idx` and no mask argument at all, an eager softmax under a tril buffer."""

    def __init__(self, vocab=50, dim=8, heads=2, size=16):
        super().__init__()
        self.heads, self.embed, self.qkv = heads, nn.Embedding(vocab, dim), nn.Linear(dim, 3 * dim)
        self.register_buffer("bias", torch.ones(size, size).tril())

    def forward(self, idx):
        x = self.embed(idx)
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        scores = (q @ k.transpose(-1, -2)).masked_fill(self.bias[:n, :n] == 0, float("-inf"))
        return (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, n, d)


def gpt_findings(idx: torch.Tensor) -> list:
    torch.manual_seed(0)
    with maskcli.trace() as t, torch.no_grad():
        TinyGPT()(idx)
    return [(f.code, severity(f), f.cell) for group in t.groups() for f in group.findings]


def test_left_padded_ids_given_to_a_model_with_no_mask_at_all_are_flagged_at_the_first_real_query():
    ids = left_padded()
    found = [f for f in gpt_findings(ids) if f[0] == "left-pads-never-masked"]
    # reference: a double loop over torch.tril's cells of each row's real queries, the keys its left padding holds
    pads = [[j < len(ids[0]) - len(s) for j in range(len(ids[0]))] for s in SAMPLES]
    tril = torch.ones(5, 5).tril()
    expected = first((3, 5, 5), lambda b, q, k: tril[q, k] and not pads[b][q] and pads[b][k])
    assert [(code, sev) for code, sev, _ in found] == [("left-pads-never-masked", "wrong")]
    assert tuple(found[0][2]) == expected


def test_no_alarm_for_right_padding_under_causality_or_an_unpadded_batch_with_no_mask():
    width = max(map(len, SAMPLES))
    right = torch.tensor([s + [PAD] * (width - len(s)) for s in SAMPLES])  # (real queries never see a later pad)
    assert [f for f in gpt_findings(right) if f[1] == "wrong"] == []
    unpadded = torch.randint(4, 50, (3, 6), generator=torch.Generator().manual_seed(1))
    assert [f for f in gpt_findings(unpadded) if f[1] == "wrong"] == []


def test_a_training_batch_in_an_outer_frame_is_not_held_against_a_generate_loops_mask(tmp_path):
    """Written blind (batch quiet-yl, correct): MPT's prefix-LM trained on a right-padded batch (`input_ids`, 8 tokens,
    padded with 0 in main()), then a greedy loop over left-padded prompts whose step over 8 keys holds its own
    `attention_mask` (3, 8): main's stale training ids are another batch, read against that mask only by their shape.
    The ids and the mask are paired only where one function holds both."""
    from checkbugs import traced

    quiet = Path(__file__).parent / "data" / "quiet_blind"
    status, found, report = traced(tmp_path, "quiet_llmfoundry_mpt_prefix_lm_full_alibi_generate", False, quiet)
    assert status == 0 and [f for f in found if f["code"] == "pad-ids-unmasked"] == [], report


def test_a_loss_mask_named_plain_mask_that_counts_the_stop_padding_is_no_padding_statement():
    """Written otherwise (trajectory-transformer's GPT, quiet_blind round 60): `forward(idx, targets, mask)` where `mask`
    is the loss's, 1 on the stop tokens that pad each row (their targets are trained), a causal softmax over right
    padding: only the padded queries see the pads, and the plain `mask` says nothing of attention. Named
    attention_mask, the same cells are still said (the gpt2 collator above)."""
    class CausalLM(nn.Module):
        def __init__(self, vocab=20, dim=8):
            super().__init__()
            self.embed, self.qkv, self.head = nn.Embedding(vocab, dim), nn.Linear(dim, 3 * dim), nn.Linear(dim, vocab)

        def forward(self, idx, targets=None, mask=None):
            x = self.embed(idx)
            q, k, v = self.qkv(x).chunk(3, dim=-1)
            n = idx.shape[1]
            scores = (q @ k.transpose(1, 2)).masked_fill(torch.ones(n, n).tril() == 0, float("-inf"))
            logits = self.head(scores.softmax(-1) @ v)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none")
            return (loss * mask.reshape(-1)).mean()

    stop = 7
    rows = [[3, 5, 9, 2, 4, 6], [8, 1, 3, stop, stop, stop], [2, 9, 5, 4, stop, stop]]
    idx = torch.tensor(rows)
    targets = torch.cat([idx[:, 1:], torch.full((3, 1), stop)], dim=1)
    mask = torch.ones_like(idx, dtype=torch.float)  # (the stop targets trained: the loss's own mask)
    torch.manual_seed(0)
    with maskcli.trace() as t, torch.no_grad():
        CausalLM()(idx, targets=targets, mask=mask)
    assert [f.code for group in t.groups() for f in group.findings if f.code == "pad-ids-unmasked"] == []


def test_an_eos_that_pads_kept_once_after_each_text_is_no_unmasked_padding(tmp_path):
    """The DPO reference implementation's collator (tests/data/quiet_blind, written blind, batch quiet-r69a) written
    another way (tests/data/padids): the tokenizer pads with its EOS id, each text ends with one EOS the mask keeps and
    the copies after it are masked, the longest text truncated without its EOS. The ids' run of the pad id starts with
    that kept EOS: the mask keeps one token of the run, its terminator, and masks the rest. Said as pad-ids-unmasked
    before; quiet now."""
    status, found, report = traced_program(tmp_path, "sft_batch_eos_as_pad_each_text_keeps_its_eos", False, PADIDS)
    assert status == 0, report
    assert [f for f in found if f["severity"] in ("wrong", "suspicious")] == [], report
    assert "causal (--lengths 7,4,5)" in report, report


def test_x_transformers_seq_start_pos_never_reaching_self_attention(tmp_path):
    """lucidrains/x-transformers#187 (cb50439; written blind, blind-nh, missed before tuning): generate left-pads the
    prompts and hands `seq_start_pos = t - prompt_lens` to every call, but self-attention read `mask` (None) instead of
    the left-pad mask built from it. The 1-D tensor `seq_start_pos` is each row's left padding (trace/held.py): the
    short row's real queries see its pad keys at the prefill and at every decode step. The fix is quiet."""
    hits = check_bug(tmp_path, "x_transformers_left_pad_kv_mask_unused_by_self_attention", "left-padding-attended",
                     BLIND)
    start = [0, 4]  # t - prompt_lens: 8 - [8, 4]
    assert tuple(hits[0]["cell"]) == first((2, 8, 8), lambda b, q, k: k <= q and q >= start[b] > k)
    assert "seq_start_pos" in hits[0]["source"]


def test_seq_start_pos_written_another_way_padding_dropped_at_decode_only(tmp_path):
    """Written another way: a GPT of the program's own over a hand-kept (k, v) cache, SDPA with a bool mask, three
    left-padded prompts, `seq_start_pos` handed to every call but the padding part built only where the call has no
    cache or several queries: every decode step's real query sees its row's pad keys. The fix is quiet."""
    hit = caught(tmp_path, "left_pad_seq_start_pos_dropped_at_cached_decode", ("left-padding-attended",))
    start = [0, 4, 2]  # 7 - [7, 3, 5]
    b, q, k = hit["cell"]  # (the first decode step's one query row: q is its row in the call)
    assert k < start[b] and q == 0 and "seq_start_pos" in hit["source"] and f"batch row {b}: query 7 " in hit["message"]
