# Citation: sgl-project/sglang#9279 ("Fix swa eagle verify accuracy for Triton backend", merged 2025-08).
# Upstream: python/sglang/srt/layers/attention/triton_backend.py
#   (TritonAttnBackend.init_forward_metadata, target-verify branch; update_sliding_window_buffer;
#    forward_extend) and python/sglang/srt/layers/attention/triton_ops/extend_attention.py
#   (_fwd_kernel / extend_attention_fwd). Post-fix code read; the pre-fix side is that code
#   without window_kv_offsets (the PR's stated change), diff itself not read.
# Bug: in EAGLE target-verify the custom tree mask of each request is laid out as
#   [num_draft_tokens, prefix_len + num_draft_tokens] over the FULL prefix, but sliding-window
#   layers run the kernel over the window-clipped prefix only; the kernel indexed the mask with
#   the window length as row stride and column base, so draft tokens read the wrong mask bits
#   once a request's prefix is longer than the window.
# Fix: update_sliding_window_buffer also returns window_kv_start_idx as window_kv_offsets, and the
#   kernel reads mask[row * (cur_seq_len + window_kv_offset) + window_kv_offset + col].
# Torch port (Triton kernel re-written as tiled torch loops with the same index arithmetic).
import sys
import math
import torch

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

BLOCK_M = 4
BLOCK_N = 4


def create_flashinfer_kv_indices_triton(req_to_token, req_pool_indices, page_kernel_lens,
                                        kv_indptr, kv_start_idx, kv_indices):
    for i in range(req_pool_indices.numel()):
        start = 0 if kv_start_idx is None else int(kv_start_idx[i])
        n = int(page_kernel_lens[i])
        off = int(kv_indptr[i])
        kv_indices[off:off + n] = req_to_token[int(req_pool_indices[i]), start:start + n]


def update_sliding_window_buffer(window_kv_indptr, req_to_token, sliding_window_size,
                                 seq_lens, req_pool_indices, bs):
    window_kv_lens = torch.minimum(seq_lens, torch.tensor(sliding_window_size))
    window_kv_indptr[1:bs + 1] = torch.cumsum(window_kv_lens, dim=0)
    window_kv_indptr = window_kv_indptr[:bs + 1]
    window_kv_indices = torch.empty(int(window_kv_indptr[-1]), dtype=torch.int64)
    window_kv_start_idx = seq_lens - window_kv_lens
    create_flashinfer_kv_indices_triton(req_to_token, req_pool_indices, window_kv_lens,
                                        window_kv_indptr, window_kv_start_idx, window_kv_indices)
    if FIXED:
        return window_kv_indptr, window_kv_indices, window_kv_lens, window_kv_start_idx
    return window_kv_indptr, window_kv_indices, window_kv_lens


def _fwd_kernel(Q_Extend, K_Extend, V_Extend, O_Extend, K_Buffer, V_Buffer, qo_indptr,
                kv_indptr, kv_indices, mask_ptr, mask_indptr, window_kv_offset_ptr, sm_scale,
                kv_group_num, SLIDING_WINDOW_SIZE, USE_CUSTOM_MASK, IS_CAUSAL,
                SKIP_PREFIX_CUSTOM_MASK, cur_seq, cur_head, cur_block_m):
    cur_kv_head = cur_head // kv_group_num
    cur_seq_extend_start_idx = int(qo_indptr[cur_seq])
    cur_seq_len_extend = int(qo_indptr[cur_seq + 1]) - cur_seq_extend_start_idx
    cur_seq_kv_start_idx = int(kv_indptr[cur_seq])
    cur_seq_len_prefix = int(kv_indptr[cur_seq + 1]) - cur_seq_kv_start_idx
    cur_seq_len = cur_seq_len_prefix + cur_seq_len_extend

    if USE_CUSTOM_MASK:
        cur_seq_mask_start_idx = int(mask_indptr[cur_seq])

    window_kv_offset = 0
    if FIXED and USE_CUSTOM_MASK and SLIDING_WINDOW_SIZE > 0:
        window_kv_offset = int(window_kv_offset_ptr[cur_seq])

    offs_m = torch.arange(BLOCK_M)
    mask_m = (cur_block_m * BLOCK_M + offs_m) < cur_seq_len_extend
    q_rows = (cur_seq_extend_start_idx + cur_block_m * BLOCK_M + offs_m).clamp(max=Q_Extend.shape[0] - 1)
    q = Q_Extend[q_rows, cur_head].float() * mask_m[:, None]

    offs_n = torch.arange(BLOCK_N)
    scores, values = [], []

    # stage 1: prefix
    for start_n in range(0, cur_seq_len_prefix, BLOCK_N):
        mask_n = (start_n + offs_n) < cur_seq_len_prefix
        final_mask = mask_m[:, None] & mask_n[None, :]
        if USE_CUSTOM_MASK and not SKIP_PREFIX_CUSTOM_MASK:
            idx = (cur_seq_mask_start_idx
                   + (cur_block_m * BLOCK_M + offs_m[:, None]) * (cur_seq_len + window_kv_offset)
                   + window_kv_offset + start_n + offs_n[None, :])
            cm = torch.where(final_mask, mask_ptr[idx.clamp(0, mask_ptr.numel() - 1)], False)
            final_mask &= cm
        if SLIDING_WINDOW_SIZE > 0:
            window_mask = (cur_seq_len_prefix + cur_block_m * BLOCK_M + offs_m[:, None]) <= (
                start_n + offs_n[None, :] + SLIDING_WINDOW_SIZE)
            final_mask &= window_mask
        locs = kv_indices[(cur_seq_kv_start_idx + start_n + offs_n).clamp(max=kv_indices.numel() - 1)]
        k = K_Buffer[locs, cur_kv_head].float()
        v = V_Buffer[locs, cur_kv_head].float()
        qk = (q @ k.T) * sm_scale
        scores.append(torch.where(final_mask, qk, float("-inf")))
        values.append(v)

    # stage 2: extend (draft tokens)
    cur_block_m_end = cur_seq_len_extend if not IS_CAUSAL else min(cur_seq_len_extend, (cur_block_m + 1) * BLOCK_M)
    for start_n in range(0, cur_block_m_end, BLOCK_N):
        mask_n = (start_n + offs_n) < cur_block_m_end
        final_mask = mask_m[:, None] & mask_n[None, :]
        if USE_CUSTOM_MASK:
            idx = (cur_seq_mask_start_idx
                   + (cur_block_m * BLOCK_M + offs_m[:, None]) * (cur_seq_len + window_kv_offset)
                   + window_kv_offset + cur_seq_len_prefix + start_n + offs_n[None, :])
            cm = torch.where(final_mask, mask_ptr[idx.clamp(0, mask_ptr.numel() - 1)], False)
            cm &= mask_m[:, None] & mask_n[None, :]
            final_mask &= cm
        elif IS_CAUSAL:
            final_mask &= (cur_block_m * BLOCK_M + offs_m[:, None]) >= (start_n + offs_n[None, :])
        if SLIDING_WINDOW_SIZE > 0:
            final_mask &= (cur_block_m * BLOCK_M + offs_m[:, None]) <= (
                start_n + offs_n[None, :] + SLIDING_WINDOW_SIZE)
        rows = (cur_seq_extend_start_idx + start_n + offs_n).clamp(max=K_Extend.shape[0] - 1)
        k = K_Extend[rows, cur_kv_head].float()
        v = V_Extend[rows, cur_kv_head].float()
        qk = (q @ k.T) * sm_scale
        scores.append(torch.where(final_mask, qk, float("-inf")))
        values.append(v)

    s = torch.cat(scores, dim=1)
    vv = torch.cat(values, dim=0)
    row_max = s.max(dim=1, keepdim=True).values.clamp(min=-1e20)
    p = torch.exp(s - row_max)
    acc = (p @ vv) / p.sum(dim=1, keepdim=True).clamp(min=1e-20)
    for i in range(BLOCK_M):
        if mask_m[i]:
            O_Extend[cur_seq_extend_start_idx + cur_block_m * BLOCK_M + i, cur_head] = acc[i].to(O_Extend.dtype)


def extend_attention_fwd(q_extend, k_extend, v_extend, o_extend, k_buffer, v_buffer, qo_indptr,
                         kv_indptr, kv_indices, custom_mask, is_causal, mask_indptr,
                         max_len_extend, sm_scale=None, skip_prefix_custom_mask=True,
                         sliding_window_size=-1, window_kv_offsets=None):
    Lq = q_extend.shape[-1]
    sm_scale = sm_scale or 1.0 / math.sqrt(Lq)
    batch_size, head_num = qo_indptr.shape[0] - 1, q_extend.shape[1]
    kv_group_num = q_extend.shape[1] // k_extend.shape[1]
    USE_CUSTOM_MASK = custom_mask is not None
    for cur_seq in range(batch_size):
        for cur_head in range(head_num):
            for cur_block_m in range(math.ceil(max_len_extend / BLOCK_M)):
                _fwd_kernel(q_extend, k_extend, v_extend, o_extend, k_buffer, v_buffer,
                            qo_indptr, kv_indptr, kv_indices, custom_mask, mask_indptr,
                            window_kv_offsets, sm_scale, kv_group_num, sliding_window_size,
                            USE_CUSTOM_MASK, is_causal, skip_prefix_custom_mask,
                            cur_seq, cur_head, cur_block_m)


def build_tree_mask(seq_lens, parents):
    """EAGLE verify tree mask, per request [draft_token_num, seq_len + draft_token_num], flattened."""
    D = len(parents)
    masks, positions = [], []
    for sl in seq_lens.tolist():
        m = torch.zeros(D, sl + D, dtype=torch.bool)
        m[:, :sl] = True
        for i in range(D):
            j, depth = i, 0
            while j != -1:
                m[i, sl + j] = True
                j = parents[j]
                depth += 1
            positions.append(sl + depth - 1)
        masks.append(m.flatten())
    return torch.cat(masks), torch.tensor(positions)


class TritonAttnBackend:
    def __init__(self, req_to_token, num_draft_tokens, sliding_window_size, max_bs=8):
        self.req_to_token = req_to_token
        self.num_draft_tokens = num_draft_tokens
        self.sliding_window_size = sliding_window_size
        self.kv_indptr = torch.zeros(max_bs + 1, dtype=torch.int64)
        self.window_kv_indptr = torch.zeros(max_bs + 1, dtype=torch.int64)
        self.mask_indptr = torch.zeros(max_bs + 1, dtype=torch.int64)

    def init_forward_metadata_target_verify(self, req_pool_indices, seq_lens, custom_mask):
        bs = len(req_pool_indices)
        window_kv_offsets = None
        qo_indptr = torch.arange(0, (1 + bs) * self.num_draft_tokens, step=self.num_draft_tokens)
        kv_indptr = self.kv_indptr
        kv_indptr[1:bs + 1] = torch.cumsum(seq_lens, dim=0)
        kv_indptr = kv_indptr[:bs + 1]
        kv_indices = torch.empty(int(kv_indptr[-1]), dtype=torch.int64)
        create_flashinfer_kv_indices_triton(self.req_to_token, req_pool_indices, seq_lens,
                                            kv_indptr, None, kv_indices)
        if FIXED:
            # window_kv_offsets is used to calculate the start position in custom mask
            (window_kv_indptr, window_kv_indices, window_kv_lens,
             window_kv_offsets) = update_sliding_window_buffer(
                self.window_kv_indptr, self.req_to_token, self.sliding_window_size,
                seq_lens, req_pool_indices, bs)
        else:
            window_kv_indptr, window_kv_indices, window_kv_lens = update_sliding_window_buffer(
                self.window_kv_indptr, self.req_to_token, self.sliding_window_size,
                seq_lens, req_pool_indices, bs)
        seq_mask_len = self.num_draft_tokens * (seq_lens + self.num_draft_tokens)
        mask_indptr = self.mask_indptr
        mask_indptr[1:bs + 1] = torch.cumsum(seq_mask_len[:bs], dim=0)
        mask_indptr = mask_indptr[:bs + 1]
        self.md = dict(qo_indptr=qo_indptr, kv_indptr=kv_indptr, kv_indices=kv_indices,
                       custom_mask=custom_mask, mask_indptr=mask_indptr,
                       max_extend_len=self.num_draft_tokens, window_kv_indptr=window_kv_indptr,
                       window_kv_indices=window_kv_indices, window_kv_offsets=window_kv_offsets)

    def forward_extend(self, q, k, v, k_buffer, v_buffer, layer_sliding_window_size, scaling):
        md = self.md
        o = torch.empty_like(q)
        if layer_sliding_window_size is not None and layer_sliding_window_size > -1:
            sliding_window_size = layer_sliding_window_size
            kv_indptr, kv_indices = md["window_kv_indptr"], md["window_kv_indices"]
            window_kv_offsets = md["window_kv_offsets"]
        else:
            sliding_window_size = -1
            kv_indptr, kv_indices = md["kv_indptr"], md["kv_indices"]
            window_kv_offsets = None
        extend_attention_fwd(q, k, v, o, k_buffer, v_buffer, md["qo_indptr"], kv_indptr,
                             kv_indices, md["custom_mask"], False, md["mask_indptr"],
                             md["max_extend_len"], scaling, sliding_window_size=sliding_window_size,
                             window_kv_offsets=window_kv_offsets)
        return o


def rope(x, pos, base=10000.0):
    d = x.shape[-1]
    inv = 1.0 / base ** (torch.arange(0, d, 2).float() / d)
    ang = pos[:, None].float() * inv[None, :]
    cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
    x1, x2 = x[..., ::2], x[..., 1::2]
    out = torch.empty_like(x)
    out[..., ::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out


# ---- a tiny gpt-oss-like setup: one sliding-window layer, EAGLE tree verify ----
H, KVH, HD, HID, VOCAB = 4, 2, 16, 64, 50
WINDOW = 8                      # config.sliding_window
SWA = WINDOW - 1                # layer.sliding_window_size (sglang stores window - 1)
parents = [-1, 0, 0, 1, 2, 3]   # draft tree: root, two children, and one branch each deeper
D = len(parents)

wq = torch.randn(HID, H * HD) / HID ** 0.5
wk = torch.randn(HID, KVH * HD) / HID ** 0.5
wv = torch.randn(HID, KVH * HD) / HID ** 0.5
wo = torch.randn(H * HD, HID) / (H * HD) ** 0.5
emb = torch.randn(VOCAB, HID)
lm_head = torch.randn(HID, VOCAB) / HID ** 0.5

seq_lens = torch.tensor([21, 6])          # prefix lengths: one past the window, one inside it
req_pool_indices = torch.tensor([0, 1])
pool_size = 128
req_to_token = torch.zeros(2, 64, dtype=torch.int64)
k_buffer = torch.zeros(pool_size, KVH, HD)
v_buffer = torch.zeros(pool_size, KVH, HD)
nxt = 1
for r, sl in enumerate(seq_lens.tolist()):
    ids = torch.randint(0, VOCAB, (sl,))
    h = emb[ids]
    locs = torch.arange(nxt, nxt + sl)
    nxt += sl
    req_to_token[r, :sl] = locs
    k_buffer[locs] = rope((h @ wk).view(sl, KVH, HD), torch.arange(sl))
    v_buffer[locs] = (h @ wv).view(sl, KVH, HD)

# draft tokens (target verify): a tree of D tokens per request
draft_ids = torch.randint(0, VOCAB, (2 * D,))
custom_mask, positions = build_tree_mask(seq_lens, parents)
hd = emb[draft_ids]
q = rope((hd @ wq).view(-1, H, HD), positions)
k = rope((hd @ wk).view(-1, KVH, HD), positions)
v = (hd @ wv).view(-1, KVH, HD)

backend = TritonAttnBackend(req_to_token, D, SWA)
backend.init_forward_metadata_target_verify(req_pool_indices, seq_lens, custom_mask)
o = backend.forward_extend(q, k, v, k_buffer, v_buffer, SWA, 1.0 / math.sqrt(HD))
logits = (o.view(-1, H * HD) @ wo + hd) @ lm_head

print("mode:", "fixed" if FIXED else "buggy")
for r in range(2):
    rows = slice(r * D, (r + 1) * D)
    print(f"req {r} prefix_len={int(seq_lens[r])} attn_out_sum={o[rows].sum().item():.5f} "
          f"verify_argmax={logits[rows].argmax(-1).tolist()}")
print("logits checksum:", round(logits.abs().sum().item(), 4))
