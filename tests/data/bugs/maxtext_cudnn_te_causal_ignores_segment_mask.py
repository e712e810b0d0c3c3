"""MaxText: the cuDNN / Transformer Engine attention path dropped the packing (segment) mask.

Citation: AI-Hypercomputer/maxtext#878 ("Mask is being ignored when cudnn_flash_attention is used"), closed
by PR #913 (merged, per the issue thread). I read the issue and the pre-fix ``layers/attentions.py``
(``AttentionOp.generate_attention_mask`` and ``cudnn_flash_attention``); I did not read PR #913's diff.

Bug: with ``attention: cudnn_flash_te`` MaxText built the segment-aware mask
(``decoder_segment_ids[:, :, None] == decoder_segment_ids[:, None, :]`` AND causal) and passed it as
``mask=attn_mask`` to Transformer Engine's ``DotProductAttention(attn_mask_type="causal")``. TE documents
that ``mask`` is ignored for ``'no_mask'`` and ``'causal'``, so packed training examples attended causally
across the boundaries of the documents packed into one row: the second document's tokens saw the first's.

Fix (as proposed in the issue and merged in #913): a mask type that honours the mask
(``"padding_causal"``), so the segment mask reaches the kernel.

Reproduction: JAX/Flax code rendered in torch. ``generate_attention_mask`` is kept line for line;
``DotProductAttention`` below is a torch stand-in for TE's layer that keeps only its documented mask
handling and runs ``F.scaled_dot_product_attention``. Two packed rows of 8 tokens in BSHD layout, with the
``decoder_segment_ids`` a packed MaxText batch carries (0 = padding).
"""
import math
import sys
from types import SimpleNamespace

import torch
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv

MODEL_MODE_AUTOREGRESSIVE = "autoregressive"
MODEL_MODE_TRAIN = "train"
DECODING_ACTIVE_SEQUENCE_INDICATOR = 1
DEFAULT_MASK_VALUE = -0.7 * float(torch.finfo(torch.float32).max)


class DotProductAttention:
    """torch stand-in for transformer_engine.jax.flax.DotProductAttention (mask handling only).

    TE: "mask ... is ignored for 'no_mask' and 'causal'". With a padding type the mask is applied together
    with causality. The mask comes in MaxText's additive encoding (0 keep, DEFAULT_MASK_VALUE drop).
    """

    def __init__(self, head_dim, num_attention_heads, num_gqa_groups, attn_mask_type, scale_factor,
                 qkv_layout="BSHD_BSHD_BSHD"):
        self.head_dim = head_dim
        self.num_attention_heads = num_attention_heads
        self.num_gqa_groups = num_gqa_groups
        self.attn_mask_type = attn_mask_type
        self.scale_factor = scale_factor
        self.qkv_layout = qkv_layout

    def __call__(self, query, key, value, mask=None):
        q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # BSHD -> BHSD
        if self.attn_mask_type in ("no_mask", "causal"):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=self.attn_mask_type == "causal",
                                                 scale=self.scale_factor)
        else:
            keep = mask >= DEFAULT_MASK_VALUE * 0.5  # (b, 1, 1, t, s) in MaxText's layout
            keep = keep.reshape(keep.shape[0], 1, keep.shape[-2], keep.shape[-1])
            if "causal" in self.attn_mask_type:
                t_len, s_len = keep.shape[-2:]
                keep = keep & torch.ones(t_len, s_len, dtype=torch.bool).tril()
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, scale=self.scale_factor)
        return out.transpose(1, 2)


class AttentionOp:
    def __init__(self, config, num_query_heads, num_kv_heads):
        self.attention_kernel = config.attention
        self.num_query_heads = num_query_heads
        self.num_kv_heads = num_kv_heads

    # Following Pallas MHA Flash Attention Reference.
    # This mask models (1) separate sequences (decoder_segment_ids) and (2) causality
    def generate_attention_mask(self, query, key, decoder_segment_ids, model_mode):
        mask = None
        if model_mode == MODEL_MODE_AUTOREGRESSIVE:
            mask = decoder_segment_ids[:, None, None, None, :] == DECODING_ACTIVE_SEQUENCE_INDICATOR
        elif decoder_segment_ids is not None:
            mask = decoder_segment_ids[:, :, None] == decoder_segment_ids[:, None, :]
            mask = mask[:, None, None, :, :]

        causal_mask = None
        # We enforce causality except for AUTOREGRESSION
        if model_mode != MODEL_MODE_AUTOREGRESSIVE:
            _, q_seq_len, _, _ = query.shape
            _, kv_seq_len, _, _ = key.shape
            row_ids = torch.arange(q_seq_len)[:, None].expand(q_seq_len, kv_seq_len)
            col_ids = torch.arange(kv_seq_len)[None, :].expand(q_seq_len, kv_seq_len)
            causal_mask = (col_ids <= row_ids)[None, None, None, :, :]

        if (mask is not None) and (causal_mask is not None):
            output_mask = torch.logical_and(mask, causal_mask)
        elif mask is not None:
            output_mask = mask
        elif causal_mask is not None:
            output_mask = causal_mask
        else:
            output_mask = None

        if output_mask is None:
            return None
        return torch.where(output_mask, torch.tensor(0.0), torch.tensor(DEFAULT_MASK_VALUE))

    def apply_attention(self, query, key, value, decoder_segment_ids, model_mode):
        if self.attention_kernel == "cudnn_flash_te":
            return self.cudnn_flash_attention(query, key, value, decoder_segment_ids, model_mode)
        raise ValueError(f"Unexpected attention kernel {self.attention_kernel=}.")

    def cudnn_flash_attention(self, query, key, value, decoder_segment_ids, model_mode=MODEL_MODE_TRAIN):
        """CUDNN Flash Attention with Transformer Engine."""
        _, _, _, head_dim = query.shape

        # generate attn_mask
        attn_mask = self.generate_attention_mask(query, key, decoder_segment_ids, model_mode)

        dpa_layer = DotProductAttention(
            head_dim=head_dim,
            num_attention_heads=self.num_query_heads,
            num_gqa_groups=self.num_kv_heads,
            attn_mask_type="padding_causal" if FIXED else "causal",  # 'causal' or 'padding'
            qkv_layout="BSHD_BSHD_BSHD",
            scale_factor=1.0 / math.sqrt(head_dim),
        )
        return dpa_layer(query, key, value, mask=attn_mask)


def main():
    torch.manual_seed(0)
    config = SimpleNamespace(attention="cudnn_flash_te", packing=True, num_query_heads=2, num_kv_heads=2,
                             head_dim=8, max_target_length=8)
    op = AttentionOp(config, config.num_query_heads, config.num_kv_heads)
    b, t = 2, config.max_target_length
    query = torch.randn(b, t, config.num_query_heads, config.head_dim)
    key = torch.randn(b, t, config.num_kv_heads, config.head_dim)
    value = torch.randn(b, t, config.num_kv_heads, config.head_dim)
    # two documents packed per row, trailing padding as segment 0
    decoder_segment_ids = torch.tensor([[1, 1, 1, 2, 2, 2, 2, 0],
                                        [1, 1, 1, 1, 1, 2, 2, 2]])
    out = op.apply_attention(query, key, value, decoder_segment_ids, MODEL_MODE_TRAIN)
    print("out[0, 3, 0, :3]:", [round(x, 4) for x in out[0, 3, 0, :3].tolist()])


if __name__ == "__main__":
    main()
