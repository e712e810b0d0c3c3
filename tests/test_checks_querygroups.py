"""checks/querygroups.py (and trace/querygroups.py): a Group-DETR self-attention in training whose query groups see each
other, against the groups each kernel row holds worked out here by replaying the program's split and reshape on
query numbers."""

from __future__ import annotations

from pathlib import Path

import torch

from checkbugs import check_bug, first, traced

GROUPS = Path(__file__).parent / "data" / "querygroups"


def row_groups(split_view) -> list[set[int]]:
    """The groups of the queries each kernel row holds, the queries numbered 0 .. G * n - 1 in group order."""
    return [set(row) for row in split_view]


def test_detrex_group_split_undone_by_the_pre_split_reshape(tmp_path):
    # IDEA-Research/detrex#238 (written blind, batch blind-ev): GroupConditionalSelfAttention splits the 3 groups of 5
    # queries into the batch axis, then reshapes with the pre-split (N, B) = (15, 1)
    groups, n, bs = 3, 5, 1
    ids = torch.arange(groups * n).reshape(groups * n, bs)  # (N, B) query numbers, sequence first
    split = torch.cat(ids.split(n, dim=0), dim=1)  # (n, B * G): the groups in the batch axis
    rows = split.reshape(groups * n, bs).T  # the buggy reshape: one row of 15 queries, interleaved
    held = row_groups((rows // n).tolist())
    assert held == [{0, 1, 2}]  # every group in the one row the kernel attends, each query seeing all 15 keys
    [hit] = check_bug(tmp_path, "detrex_group_detr_self_attention_groups_leak", "query-groups-leak")
    assert "group_nums=3 of GroupConditionalSelfAttention" in hit["message"]
    assert f"query 0 of row 0 sees {groups * n} keys, more than its group's {n}" in hit["message"]


def test_a_batch_first_split_along_the_batch_axis(tmp_path):
    """Written another way: LW-DETR's `group_detr` on the decoder layer, batch-first queries, nn.MultiheadAttention, two
    images with a padded memory; the split along dim 0 cuts the batch of 2 into one chunk: nothing moves."""
    groups, n, bs = 4, 3, 2
    ids = torch.arange(groups * n).repeat(bs, 1)  # (B, N) query numbers, batch first
    rows = torch.cat(ids.split(n, dim=0), dim=1)  # the port's split, on the batch axis: one chunk, the same tensor
    assert row_groups((rows // n).tolist()) == [set(range(groups))] * bs
    fixed = torch.cat(ids.split(n, dim=1), dim=0)  # the fix: B * G rows of one group each
    assert all(len(g) == 1 for g in row_groups((fixed // n).tolist()))
    [hit] = check_bug(tmp_path, "lwdetr_group_split_on_batch_first_queries_is_noop", "query-groups-leak", folder=GROUPS)
    assert "group_detr=4 of DecoderLayer" in hit["message"] and "over 2 batch rows" in hit["message"]
    assert f"sees {groups * n} keys, more than its group's {n}" in hit["message"]


def test_quiet_on_a_block_diagonal_group_mask_and_on_inference(tmp_path):
    status, found, report = traced(tmp_path, "group_detr_block_diagonal_mask_and_inference", False, GROUPS)
    assert status == 0 and not [f for f in found if f["severity"] in ("wrong", "suspicious")], report


def _first_query_seeing_another_group(labels) -> tuple[int, int, int] | None:
    """checkbugs.first over (row, query, key) of the kernel: a full self-attention, so a query sees every key of its
    row; bad where the key is of another (image, group) than the query."""
    rows, length = len(labels), len(labels[0])
    return first((rows, length, length), lambda b, q, k: labels[b][q] != labels[b][k])


def test_lw_detr_view_with_the_pre_split_batch_and_length(tmp_path):
    # huggingface/transformers#44441 (written blind, batch blind-ff): LwDetrAttention splits the 3 groups of 8 queries
    # onto the batch axis in training, then views q/k/v with the pre-split (batch, seq_len) = (2, 24); LwDetrConfig,
    # kept as the module's `config`, states group_detr=3 and num_queries=8
    groups, n, bs = 3, 8, 2
    image = torch.arange(bs)[:, None].expand(bs, groups * n)
    group = (torch.arange(groups * n) // n)[None].expand(bs, -1)
    labels = image * groups + group  # (B, G * n): (image, group) of each query, batch first
    split = torch.cat(labels.split(n, dim=1), dim=0)  # (B * G, n): the program's split
    rows = split.reshape(bs, groups * n).tolist()  # the pre-split view: every kernel row holds 3 of the 6 groups
    assert all(len(set(row)) == groups for row in rows)
    ref = _first_query_seeing_another_group(rows)
    [hit, _] = check_bug(tmp_path, "transformers_lw_detr_group_detr_self_attn_view_pre_split_shape", "query-groups-leak")
    assert tuple(hit["cell"][:2]) == ref[:2]
    assert "config.group_detr=3 of LwDetrAttention" in hit["message"]
    assert f"sees {groups * n} keys, more than its group's {n}" in hit["message"]


def test_a_dict_config_and_sequence_first_sdpa(tmp_path):
    """Written another way: the layer keeps a dict (group_detr, num_queries), the queries are (N, B, E), split along N
    onto the batch, and reshaped with the pre-split (N, B) before SDPA; 4 images and 2 groups (rows a multiple of G)."""
    groups, n, bs = 2, 6, 4
    labels = (torch.arange(bs)[None] * groups + (torch.arange(groups * n) // n)[:, None])  # (N, B): (image, group)
    split = torch.cat(labels.split(n, dim=0), dim=1)  # (n, B * G)
    rows = split.reshape(groups * n, bs).T.tolist()  # the pre-split (N, B), batch rows first as the kernel takes them
    ref = _first_query_seeing_another_group(rows)
    [hit, _] = check_bug(tmp_path, "rtdetr_style_dict_config_sdpa_reshape_with_pre_split_shape", "query-groups-leak",
                         folder=GROUPS)
    assert tuple(hit["cell"][:2]) == ref[:2]
    assert "cfg.group_detr=2 of DecoderLayer" in hit["message"] and "over 4 batch rows" in hit["message"]
    assert "the groups folded back into each row" in hit["message"]


def test_quiet_on_a_config_stated_block_mask_and_an_encoder(tmp_path):
    status, found, report = traced(tmp_path, "group_detr_dataclass_config_block_mask_and_encoder", False, GROUPS)
    assert status == 0 and not [f for f in found if f["severity"] in ("wrong", "suspicious")], report
