"""Mask mods written the way attention-gym writes them, for the tests of --mask-mod (this file is user code)."""

import torch


def causal_mask(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def generate_sliding_window(window_size):
    def sliding_window(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx <= window_size) & (q_idx >= kv_idx)

    sliding_window.__name__ = f"sliding_window_{window_size}"
    return sliding_window


def generate_prefix_lm_mask(prefix_length):
    def prefix_mask(b, h, q_idx, kv_idx):
        return (kv_idx <= prefix_length) | (q_idx >= kv_idx)

    return prefix_mask


def generate_doc_mask_mod(mask_mod, offsets):
    """Packed documents, as attention-gym's document mask: offsets are where each document starts."""
    document_id = torch.zeros(int(offsets[-1]), dtype=torch.int32)
    for i in range(len(offsets) - 1):
        document_id[offsets[i] : offsets[i + 1]] = i

    def doc_mask_mod(b, h, q_idx, kv_idx):
        same_doc = document_id[q_idx] == document_id[kv_idx]
        return same_doc & mask_mod(b, h, q_idx - offsets[document_id[q_idx]], kv_idx - offsets[document_id[kv_idx]])

    return doc_mask_mod


def packed_causal(b, h, q_idx, kv_idx):
    return generate_doc_mask_mod(causal_mask, torch.tensor([0, 3, 8]))(b, h, q_idx, kv_idx)


def scalar_branches(b, h, q_idx, kv_idx):
    return torch.where(q_idx >= kv_idx, True, False)


def raises(b, h, q_idx, kv_idx):
    raise ValueError("a bug in my mask")


def returns_floats(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx).float()


def returns_a_row(b, h, q_idx, kv_idx):
    return torch.ones(3, dtype=torch.bool)


def returns_a_number(b, h, q_idx, kv_idx):
    return 1


def needs_three(a, b, c):
    return a
