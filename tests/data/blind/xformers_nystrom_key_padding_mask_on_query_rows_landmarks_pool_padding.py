# Citation: facebookresearch/xformers#366 "Fix nystromformer attention" (fixes issue #360),
#   commit 1870c3bedce639a27766763da7cd6170902e3537.
# Upstream: xformers/components/attention/nystrom.py, NystromAttention.forward (with AvgPool,
#   and core.scaled_query_key_softmax / scaled_dot_product_attention, utils.bool_mask_to_additive /
#   reshape_key_padding_mask / iterative_pinv; called through components/multi_head_dispatch.py
#   MultiHeadDispatch.forward).
# Bug: with a key_padding_mask and seq_len > num_landmarks, the additive padding mask was transposed and
#   added to kernel_1 (q x k_landmarks) as a mask over *query rows*, while q and k were pooled into the
#   landmarks with the padded positions still in them (no masking before pooling).
# Fix: multiply q and k by the keep mask (1 = real token) before landmark pooling, and drop the padding
#   mask from kernel_1 / kernel_2 (the padding mask stays on kernel_3, landmarks x keys).
import sys
import math
import logging
from typing import Optional

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv


# ---- xformers/components/attention/utils.py ------------------------------------------------------
def reshape_key_padding_mask(key_padding_mask: torch.Tensor, batched_dim: int) -> torch.Tensor:
    assert key_padding_mask.ndim == 2
    batch_size, src_len = key_padding_mask.size()
    num_heads = batched_dim // batch_size
    return _reshape_key_padding_mask(key_padding_mask, batch_size, src_len, num_heads)


def _reshape_key_padding_mask(key_padding_mask, batch_size, src_len, num_heads):
    assert key_padding_mask.shape == (batch_size, src_len)
    key_padding_mask = (
        key_padding_mask.view(batch_size, 1, 1, src_len)
        .expand(-1, num_heads, -1, -1)
        .reshape(batch_size * num_heads, 1, src_len)
    )
    return key_padding_mask


def iterative_pinv(softmax_mat: torch.Tensor, n_iter=6, pinverse_original_init=False):
    i = torch.eye(softmax_mat.size(-1), device=softmax_mat.device, dtype=softmax_mat.dtype)
    k = softmax_mat
    if pinverse_original_init:
        v = 1 / torch.max(torch.sum(k, dim=-2)) * k.transpose(-1, -2)
    else:
        v = 1 / torch.max(torch.sum(k, dim=-2), dim=-1).values[:, None, None] * k.transpose(-1, -2)
    for _ in range(n_iter):
        kv = torch.matmul(k, v)
        v = torch.matmul(0.25 * v, 13 * i - torch.matmul(kv, 15 * i - torch.matmul(kv, 7 * i - kv)))
    return v


def bool_mask_to_additive(mask: torch.Tensor, dtype: Optional[torch.dtype] = torch.float32) -> torch.Tensor:
    assert mask.dtype == torch.bool, "This util is meant to convert in between bool masks and additive ones"
    mask_ = torch.zeros_like(mask, dtype=dtype)
    mask_[~mask] = float("-inf")
    return mask_


# ---- xformers/components/attention/core.py (dense path) ------------------------------------------
def _matmul_with_mask(a, b, mask):
    if mask is None:
        return a @ b
    att = a @ b
    if mask.dtype == torch.bool:
        if mask.ndim == 2:
            mask = mask.unsqueeze(0).expand(att.shape[0], -1, -1)
        att[~mask] = float("-inf")
    else:
        # mask is presumed additive
        att += mask
    return att


def _softmax(a, causal=False):
    return torch.softmax(a, dim=a.ndim - 1)


def scaled_query_key_softmax(q, k, att_mask):
    q = q / math.sqrt(k.size(-1))
    mask = att_mask
    att = _matmul_with_mask(q, k.transpose(-2, -1), mask)
    att = _softmax(att, causal=False)
    return att


def scaled_dot_product_attention(q, k, v, att_mask, dropout=None):
    att = scaled_query_key_softmax(q, k, att_mask=att_mask)
    if dropout is not None:
        att = dropout(att)
    y = att @ v
    return y


# ---- xformers/components/attention/nystrom.py ----------------------------------------------------
class AvgPool(nn.Module):
    def __init__(self, n: int):
        super().__init__()
        self.n = n

    def forward(self, x: torch.Tensor):
        seq_len = x.shape[1]
        head_dim = x.shape[2]
        segments = seq_len // self.n
        assert segments > 0, "num_landmarks should be smaller than the sequence length"
        if seq_len % self.n == 0:
            return x.reshape(-1, self.n, segments, head_dim).mean(dim=-2)
        n_round = self.n - seq_len % self.n
        x_avg_round = x[:, : n_round * segments, :].reshape(-1, n_round, segments, head_dim).mean(dim=-2)
        x_avg_off = x[:, n_round * segments:, :].reshape(-1, self.n - n_round, segments + 1, head_dim).mean(dim=-2)
        return torch.cat((x_avg_round, x_avg_off), dim=-2)


class NystromAttention(nn.Module):
    def __init__(self, dropout, num_heads, num_landmarks=64, landmark_pooling=None, causal=False,
                 use_razavi_pinverse=True, pinverse_original_init=False, inv_iterations=6,
                 v_skip_connection=None, conv_kernel_size=None):
        super().__init__()
        self.requires_separate_masks = True
        self.requires_input_projection = True
        self.requires_head_dimension = False
        self.requires_skip_multi_head = False
        self.num_landmarks = num_landmarks
        self.num_heads = num_heads
        self.use_razavi_pinverse = use_razavi_pinverse
        self.pinverse_original_init = pinverse_original_init
        self.inv_iterations = inv_iterations
        self.attn_drop = nn.Dropout(dropout)
        self.skip_connection = v_skip_connection
        self.causal = causal
        if self.skip_connection is None and conv_kernel_size is not None:
            self.skip_connection = nn.Conv2d(self.num_heads, self.num_heads, kernel_size=(conv_kernel_size, 1),
                                             padding=(conv_kernel_size // 2, 0), bias=False, groups=self.num_heads)
        self.landmark_pooling = landmark_pooling if landmark_pooling is not None else AvgPool(n=self.num_landmarks)
        self.causal_mask_1 = None
        self.causal_mask_2 = None
        self.causal_mask_3 = None
        self.supports_attention_mask = False
        self.supports_key_padding_mask = True

    def forward(self, q, k, v, key_padding_mask=None, *args, **kwargs):
        batched_dim = k.size(0)
        seq_len = k.size(-2)
        tt = {"dtype": q.dtype, "device": q.device}

        if key_padding_mask is not None:
            if key_padding_mask.dtype == torch.bool:
                logging.warning("Bool mask found, but an additive mask is expected. Converting but this is slow")
                key_padding_mask = bool_mask_to_additive(key_padding_mask)

            if key_padding_mask.ndim == 2:
                key_padding_mask = reshape_key_padding_mask(key_padding_mask, batched_dim)

            if FIXED:
                zeros = torch.zeros_like(key_padding_mask)
                ones = torch.ones_like(key_padding_mask)
                is_masked = torch.isinf(-key_padding_mask)
                # _mask takes 1 if the token is not padded, otherwise 0.
                _mask = torch.where(is_masked, zeros, ones)
                _mask = _mask.transpose(2, 1)
                assert _mask.shape == (batched_dim, q.shape[1], 1)
                # Mask q and k before pooling
                q = q * _mask
                k = k * _mask

            assert key_padding_mask.size() == (batched_dim, 1, seq_len)

        if self.num_landmarks >= seq_len:
            mask = None
            if self.causal:
                mask = self._triu_mask(batched_dim, seq_len, seq_len, **tt)
            if key_padding_mask is not None:
                mask = key_padding_mask if mask is None else mask + key_padding_mask
            x = scaled_dot_product_attention(q=q, k=k, v=v, att_mask=mask)
        else:
            q_landmarks = self.landmark_pooling(q)
            k_landmarks = self.landmark_pooling(k)

            if self.causal and (self.causal_mask_1 is None
                                or (batched_dim, seq_len, self.num_landmarks) != self.causal_mask_1.size()):
                self.causal_mask_1 = self._triu_mask(batched_dim, seq_len, self.num_landmarks, **tt)
                self.causal_mask_2 = self._triu_mask(batched_dim, self.num_landmarks, self.num_landmarks, **tt)
                self.causal_mask_3 = self._triu_mask(batched_dim, self.num_landmarks, seq_len, **tt)

            if not FIXED:
                mask_1 = self.causal_mask_1
                mask_2 = self.causal_mask_2
            mask_3 = self.causal_mask_3
            if key_padding_mask is not None:
                if not FIXED:
                    mask_1 = (key_padding_mask.transpose(-2, -1) if mask_1 is None
                              else mask_1 + key_padding_mask.transpose(-2, -1))
                mask_3 = key_padding_mask if mask_3 is None else mask_3 + key_padding_mask

            if not FIXED:
                kernel_1 = scaled_query_key_softmax(q=q, k=k_landmarks, att_mask=mask_1)
                kernel_2 = scaled_query_key_softmax(q=q_landmarks, k=k_landmarks, att_mask=mask_2)
            else:
                kernel_1 = scaled_query_key_softmax(q=q, k=k_landmarks, att_mask=None)
                kernel_2 = scaled_query_key_softmax(q=q_landmarks, k=k_landmarks, att_mask=None)
            kernel_3 = scaled_dot_product_attention(q=q_landmarks, k=k, v=v, att_mask=mask_3)

            kernel_2_inv = (iterative_pinv(kernel_2, self.inv_iterations, self.pinverse_original_init)
                            if self.use_razavi_pinverse else torch.linalg.pinv(kernel_2))

            x = torch.matmul(torch.matmul(kernel_1, kernel_2_inv), kernel_3)

        if self.skip_connection:
            v_conv = self.skip_connection(v.reshape(-1, self.num_heads, v.size(-2), v.size(-1)))
            x += v_conv.reshape(-1, v_conv.size(-2), v_conv.size(-1))
        x = self.attn_drop(x)
        return x

    def _triu_mask(self, dim_1, dim_2, dim_3, **kwargs):
        return torch.triu(torch.ones(dim_2, dim_3, dtype=kwargs["dtype"], device=kwargs["device"]) * float("-inf"),
                          diagonal=1).expand(dim_1, -1, -1)


# ---- xformers/components/multi_head_dispatch.py --------------------------------------------------
def _fold_heads(t, B, S, H, Hs):
    return t.view(B, S, H, Hs).transpose(1, 2).flatten(start_dim=0, end_dim=1)


class InputProjection(nn.Module):
    # use_separate_proj_weight=True: three independent projections
    def __init__(self, dim_model, dim_key, dim_value, bias):
        super().__init__()
        self.q_proj = nn.Linear(dim_model, dim_key, bias=bias[0])
        self.k_proj = nn.Linear(dim_model, dim_key, bias=bias[1])
        self.v_proj = nn.Linear(dim_model, dim_value, bias=bias[2])

    def forward(self, query, key, value):
        return self.q_proj(query), self.k_proj(key), self.v_proj(value)


class MultiHeadDispatch(nn.Module):
    def __init__(self, dim_model, num_heads, attention, bias=(True, True, True, True), residual_dropout=0.0):
        super().__init__()
        self.num_heads = num_heads
        self.dim_key_head = dim_model // num_heads
        self.dim_value_head = dim_model // num_heads
        self.attention = attention
        self.in_proj_container = InputProjection(dim_model, dim_model, dim_model, bias)
        self.resid_drop = nn.Dropout(residual_dropout, inplace=False)
        self.proj = nn.Linear(dim_model, dim_model, bias=bias[3])
        if self.proj.bias is not None:
            nn.init.constant_(self.proj.bias, 0.0)

    def forward(self, query, key=None, value=None, att_mask=None, key_padding_mask=None):
        key = query if key is None else key
        value = query if value is None else value
        B, S_Q, _ = query.size()
        _, S_K, _ = key.size()
        kw_mask_args = {}
        if key_padding_mask is not None:
            assert self.attention.supports_key_padding_mask
            kw_mask_args["key_padding_mask"] = key_padding_mask
        q, k, v = self.in_proj_container(query=query, key=key, value=value)
        q = _fold_heads(q, B, S_Q, self.num_heads, self.dim_key_head)
        k = _fold_heads(k, B, S_K, self.num_heads, self.dim_key_head)
        v = _fold_heads(v, B, S_K, self.num_heads, self.dim_value_head)
        y = self.attention(q, k, v, **kw_mask_args)
        y = y.view(B, self.num_heads, S_Q, self.dim_value_head).transpose(1, 2).flatten(start_dim=2, end_dim=3)
        y = self.resid_drop(self.proj(y))
        return y


# ---- a small classifier over a right-padded batch, as in issue #360 ------------------------------
def main():
    torch.manual_seed(0)
    dim_model, num_heads, num_landmarks, seq_len = 32, 4, 4, 16
    lengths = [16, 11, 7]
    B = len(lengths)

    attn = NystromAttention(dropout=0.0, num_heads=num_heads, num_landmarks=num_landmarks)
    msa = MultiHeadDispatch(dim_model=dim_model, num_heads=num_heads, attention=attn,
                            bias=(False, False, False, True), residual_dropout=0.0)
    norm = nn.LayerNorm(dim_model)
    head = nn.Linear(dim_model, 3)
    msa.eval()

    vocab, pad_id = 50, 1
    token_emb = nn.Embedding(vocab, dim_model)
    pos_emb = nn.Embedding(seq_len, dim_model)
    ids = torch.randint(4, vocab, (B, seq_len))
    padding_mask = torch.zeros(B, seq_len, dtype=torch.bool)  # True = padded position
    for i, L in enumerate(lengths):
        padding_mask[i, L:] = True
        ids[i, L:] = pad_id
    x = token_emb(ids) + pos_emb(torch.arange(seq_len))[None]
    key_padding_mask = bool_mask_to_additive(~padding_mask)
    labels = torch.tensor([0, 2, 1])

    with torch.no_grad():
        h = x + msa(norm(x), key_padding_mask=key_padding_mask)
        pooled = torch.stack([h[i, :L].mean(dim=0) for i, L in enumerate(lengths)])
        logits = head(pooled)
        loss = nn.functional.cross_entropy(logits, labels)

    for i, L in enumerate(lengths):
        print(f"seq {i} (len {L}): real-token output sum = {h[i, :L].sum().item():.5f}")
    print("logits:", [[round(v, 5) for v in row] for row in logits.tolist()])
    print(f"loss: {loss.item():.5f}")


if __name__ == "__main__":
    main()
