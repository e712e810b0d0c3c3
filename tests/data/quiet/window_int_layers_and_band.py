"""Correct: one `attend` holds sliding_window = 3 beside seq_len for every layer; the global layer (use_window=False)
masks causality alone, the local one the window. With --symmetric, an encoder whose sliding_window = 2 is one side of
a band |q - k| <= 2 (each query sees up to 5 keys, later ones too).

Written for maskcli's tests: checks/handed.py's window-dropped on a plain int window claims neither a layer that
chooses no window at a step where another keeps to it, nor a symmetric band.
"""
import sys

import torch
import torch.nn.functional as F

SYMMETRIC = "--symmetric" in sys.argv


def attend(q, k, v, sliding_window, use_window):
    seq_len = q.shape[2]
    i = torch.arange(seq_len)[:, None]
    j = torch.arange(seq_len)[None, :]
    if SYMMETRIC:
        allowed = (i - j).abs() <= sliding_window
    else:
        allowed = j <= i
        if use_window:
            allowed = allowed & (i - j < sliding_window)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)


def main():
    torch.manual_seed(0)
    x = torch.randn(1, 2, 8, 4)
    for layer in range(2):
        x = attend(x, x, x, 2 if SYMMETRIC else 3, use_window=layer % 2 == 0)
    print("symmetric" if SYMMETRIC else "layers", x.shape)


if __name__ == "__main__":
    main()
