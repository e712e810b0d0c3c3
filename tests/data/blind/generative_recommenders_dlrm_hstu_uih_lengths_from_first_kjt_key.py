# meta-recsys/generative-recommenders commit 2e37261 ("Fix uih_lengths bug in dlrm_hstu.py", D69276960);
# bug read at 2e37261^ in generative_recommenders/modules/dlrm_hstu.py (DlrmHSTU.preprocess / main_forward),
# ops/pytorch/pt_hstu_attention.py (pytorch_hstu_mha, _get_valid_attn_mask) and dlrm_v3/datasets/movie_lens.py
# (the UIH KeyedJaggedTensor: contextual keys user_id.. first, each of length 1, then movie_id.. of the history length).
# Bug: preprocess took the user-history lengths as `uih_features.lengths().view(len(keys), -1)[0]`, the lengths of
# the first KJT key (user_id, 1 per user), so the jagged concat of history + candidates and the seq_offsets handed
# to the HSTU attention describe 1-item histories. Fix: take the lengths of the post-id feature
# (`uih_features[uih_post_id_feature_name].lengths()`).
# fbgemm's jagged ops and torchrec's KeyedJaggedTensor are replaced by plain-torch equivalents.
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


# ---- plain-torch stand-ins for torchrec / fbgemm ---------------------------------------------------------------
class KeyedJaggedTensor:
    """keys, lengths laid out key-major ([key0: b0 b1 .., key1: b0 b1 ..]), values in the same order."""

    def __init__(self, keys, lengths, values):
        self._keys, self._lengths, self._values = list(keys), lengths, values

    def keys(self):
        return self._keys

    def lengths(self):
        return self._lengths

    def values(self):
        return self._values

    def __getitem__(self, key):
        K = len(self._keys)
        lens = self._lengths.view(K, -1)
        starts = torch.cat([torch.zeros(1, dtype=torch.long), lens.flatten().cumsum(0)])
        i = self._keys.index(key)
        B = lens.size(1)
        s, e = starts[i * B], starts[(i + 1) * B]
        return KeyedJaggedTensor([key], lens[i], self._values[s:e])


def asynchronous_complete_cumsum(lengths):
    return torch.cat([torch.zeros(1, dtype=lengths.dtype), lengths.cumsum(0)])


def fx_mark_length_features(x):
    return x


def fx_infer_max_len(lengths):
    return int(lengths.max().item())


def jagged_to_padded_dense(values, offsets, max_lengths, padding_value=0.0):
    (off,), (N,) = offsets, max_lengths
    B = off.numel() - 1
    out = values.new_full((B, N) + values.shape[1:], padding_value)
    for b in range(B):
        s, e = int(off[b]), int(off[b + 1])
        out[b, : e - s] = values[s:e]
    return out


def dense_to_jagged(dense, offsets, total_L):
    (off,) = offsets
    return [torch.cat([dense[b, : int(off[b + 1] - off[b])] for b in range(dense.size(0))], 0)[:total_L]]


def concat_2D_jagged(max_len_left, offsets_left, values_left, max_len_right, offsets_right, values_right):
    rows = []
    for b in range(offsets_left.numel() - 1):
        rows.append(values_left[offsets_left[b]: offsets_left[b + 1]])
        rows.append(values_right[offsets_right[b]: offsets_right[b + 1]])
    return torch.cat(rows, 0)


# ---- ops/pytorch/pt_hstu_attention.py ---------------------------------------------------------------------------
def _get_valid_attn_mask(device, causal, N, seq_lengths, num_targets=None, max_attn_len=0, contextual_seq_len=0):
    ids = torch.arange(0, N, device=device).view(1, N)
    max_ids = seq_lengths.view(-1, 1, 1)
    if contextual_seq_len > 0:
        ids = ids - contextual_seq_len + 1
        ids = torch.clamp(ids, min=0)
        max_ids = max_ids - contextual_seq_len + 1
    if num_targets is not None:
        max_ids = max_ids - num_targets.view(-1, 1, 1)
        ids = torch.clamp(ids, max=max_ids)
        row_ids = ids.view(-1, N, 1).expand(-1, N, N)
        col_ids = ids.view(-1, 1, N).expand(-1, N, N)
    else:
        row_ids = ids.view(N, 1).expand(N, N)
        col_ids = row_ids.t()
        row_ids = row_ids.view(1, N, N)
        col_ids = col_ids.view(1, N, N)
    row_col_dist = row_ids - col_ids
    valid_attn_mask = torch.eye(N, device=device, dtype=torch.bool).view(1, N, N)
    if not causal:
        row_col_dist = torch.where(row_col_dist > 0, row_col_dist, -row_col_dist)
    valid_attn_mask = torch.logical_or(valid_attn_mask, row_col_dist > 0)
    if max_attn_len > 0:
        valid_attn_mask = torch.logical_and(valid_attn_mask, row_col_dist <= max_attn_len)
    if contextual_seq_len > 0:
        valid_attn_mask = torch.logical_or(valid_attn_mask, torch.logical_and(row_ids == 0, col_ids < max_ids))
    return valid_attn_mask


def _pad_qkv(q, k, v, seq_offsets, N):
    L, H, D = q.shape
    V = v.shape[2]
    padded_q = jagged_to_padded_dense(q.reshape(L, H * D), [seq_offsets], [N]).view(-1, N, H, D).transpose(1, 2)
    padded_k = jagged_to_padded_dense(k.reshape(L, H * D), [seq_offsets], [N]).view(-1, N, H, D).transpose(1, 2)
    padded_v = jagged_to_padded_dense(v.reshape(L, H * V), [seq_offsets], [N]).view(-1, N, H, V).transpose(1, 2)
    return padded_q, padded_k, padded_v


def pytorch_hstu_mha(max_seq_len, alpha, q, k, v, seq_offsets, causal=True, num_targets=None,
                     max_attn_len=0, contextual_seq_len=0):
    L, H, _ = q.shape
    V = v.shape[2]
    q, k, v = _pad_qkv(q, k, v, seq_offsets, max_seq_len)
    qk_attn = torch.einsum("bhxa,bhya->bhxy", q, k) * alpha
    qk_attn = F.silu(qk_attn) / max_seq_len
    valid_attn_mask = _get_valid_attn_mask(
        device=q.device, causal=causal, N=max_seq_len, seq_lengths=seq_offsets[1:] - seq_offsets[:-1],
        num_targets=num_targets, max_attn_len=max_attn_len, contextual_seq_len=contextual_seq_len,
    )
    qk_attn = qk_attn * valid_attn_mask.unsqueeze(1)
    attn_dense = torch.einsum("bhxd,bhdv->bhxv", qk_attn, v)
    return dense_to_jagged(attn_dense.transpose(1, 2).flatten(2, 3), [seq_offsets], L)[0].view(L, H, V)


# ---- modules/dlrm_hstu.py (trimmed) -----------------------------------------------------------------------------
class DlrmHSTUConfig:
    def __init__(self):
        self.hstu_num_heads = 2
        self.hstu_attn_qk_dim = 8
        self.hstu_attn_linear_dim = 8
        self.hstu_embedding_table_dim = 16
        self.user_embedding_feature_names = ["movie_id", "user_id"]
        self.item_embedding_feature_names = ["item_movie_id"]
        self.uih_post_id_feature_name = "movie_id"
        self.merge_uih_candidate_feature_mapping = [("movie_id", "item_movie_id")]


class DlrmHSTU(nn.Module):
    def __init__(self, hstu_configs, num_items=50):
        super().__init__()
        self._hstu_configs = hstu_configs
        D = hstu_configs.hstu_embedding_table_dim
        H, A, Vd = hstu_configs.hstu_num_heads, hstu_configs.hstu_attn_qk_dim, hstu_configs.hstu_attn_linear_dim
        self._movie_table = nn.Embedding(num_items, D)
        self._uvqk = nn.Linear(D, H * (2 * A + 2 * Vd), bias=False)
        self._out = nn.Linear(H * Vd, D, bias=False)
        self._H, self._A, self._V = H, A, Vd

    def _embedding_collection(self, kjt):
        return {k: kjt[k] for k in kjt.keys() if k in ("movie_id", "item_movie_id")}

    def preprocess(self, uih_features, candidates_features):
        merged_sparse_features = KeyedJaggedTensor(
            keys=uih_features.keys() + candidates_features.keys(),
            values=torch.cat([uih_features.values(), candidates_features.values()], dim=0),
            lengths=torch.cat([uih_features.lengths(), candidates_features.lengths()], dim=0),
        )
        seq_embeddings_dict = self._embedding_collection(merged_sparse_features)
        num_candidates = fx_mark_length_features(
            candidates_features.lengths().view(len(candidates_features.keys()), -1)
        )[0]
        max_num_candidates = fx_infer_max_len(num_candidates)
        if FIXED:
            uih_seq_lengths = uih_features[self._hstu_configs.uih_post_id_feature_name].lengths()
        else:
            uih_seq_lengths = fx_mark_length_features(
                uih_features.lengths().view(len(uih_features.keys()), -1)
            )[0]
        max_uih_len = fx_infer_max_len(uih_seq_lengths)
        seq_embeddings = {
            k: self._movie_table(seq_embeddings_dict[k].values()) for k in seq_embeddings_dict
        }
        return seq_embeddings, max_uih_len, uih_seq_lengths, max_num_candidates, num_candidates

    def main_forward(self, seq_embeddings, max_uih_len, uih_seq_lengths, max_num_candidates, num_candidates):
        uih_feature_name, candidate_feature_name = self._hstu_configs.merge_uih_candidate_feature_mapping[0]
        embedding = concat_2D_jagged(
            max_len_left=max_uih_len,
            offsets_left=asynchronous_complete_cumsum(uih_seq_lengths),
            values_left=seq_embeddings[uih_feature_name],
            max_len_right=max_num_candidates,
            offsets_right=asynchronous_complete_cumsum(num_candidates),
            values_right=seq_embeddings[candidate_feature_name],
        )
        seq_lengths = uih_seq_lengths + num_candidates
        seq_offsets = asynchronous_complete_cumsum(seq_lengths)
        max_seq_len = max_uih_len + max_num_candidates
        L = embedding.size(0)
        H, A, Vd = self._H, self._A, self._V
        u, v, q, k = torch.split(F.silu(self._uvqk(embedding)), [H * Vd, H * Vd, H * A, H * A], dim=1)
        attn = pytorch_hstu_mha(
            max_seq_len=max_seq_len, alpha=1.0 / A ** 0.5,
            q=q.view(L, H, A), k=k.view(L, H, A), v=v.view(L, H, Vd),
            seq_offsets=seq_offsets, causal=True, num_targets=num_candidates,
        ).reshape(L, H * Vd)
        out = embedding + self._out(F.layer_norm(attn, [H * Vd]) * u)
        # candidate embeddings: the last num_candidates rows of each user's jagged row
        cand = torch.cat([out[seq_offsets[b + 1] - num_candidates[b]: seq_offsets[b + 1]]
                          for b in range(num_candidates.numel())], 0)
        return (cand * seq_embeddings[candidate_feature_name]).sum(-1)

    def forward(self, uih_features, candidates_features):
        return self.main_forward(*self.preprocess(uih_features, candidates_features))


def collate(rows, uih_keys, cand_keys):
    """movie_lens.py builds one KJT per user; batching lays lengths and values out key-major."""
    lengths, values = [], []
    for key in uih_keys:
        for r in rows:
            lengths.append(len(r[key]))
            values.extend(r[key])
    uih = KeyedJaggedTensor(uih_keys, torch.tensor(lengths), torch.tensor(values))
    lengths, values = [], []
    for key in cand_keys:
        for r in rows:
            lengths.append(len(r[key]))
            values.extend(r[key])
    return uih, KeyedJaggedTensor(cand_keys, torch.tensor(lengths), torch.tensor(values))


def main():
    cfg = DlrmHSTUConfig()
    model = DlrmHSTU(cfg).eval()
    # contextual feature first (user_id, length 1), then the history, then the dummy query time (length 1)
    uih_keys = ["user_id", "movie_id", "action_timestamp", "dummy_query_time"]
    cand_keys = ["item_movie_id"]
    rows = [
        {"user_id": [3], "movie_id": [5, 9, 12, 7, 21], "action_timestamp": [10, 11, 12, 13, 14],
         "dummy_query_time": [14], "item_movie_id": [30, 31]},
        {"user_id": [8], "movie_id": [2, 40, 17], "action_timestamp": [20, 21, 22],
         "dummy_query_time": [22], "item_movie_id": [33, 34]},
    ]
    uih, cands = collate(rows, uih_keys, cand_keys)
    with torch.no_grad():
        scores = model(uih, cands)
    print("candidate scores:", [round(x, 5) for x in scores.tolist()])


if __name__ == "__main__":
    main()
