"""The batch's lengths held as a numpy array, a list or a tuple (`--as`), not a tensor: the padding mask built from
them (True = padding) is handed to SDPA, which reads a bool mask as True = may attend, so each row attends its
padding only and the whole row nothing. --fixed hands SDPA the real tokens.
"""
import sys

import numpy as np
import torch
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
HELD = sys.argv[sys.argv.index("--as") + 1] if "--as" in sys.argv else "list"


def attend(x, seq_lens):
    length = x.shape[2]
    padding = torch.arange(length)[None, :] >= torch.as_tensor(np.asarray(seq_lens))[:, None]  # right-padded
    mask = (~padding if FIXED else padding)[:, None, None, :]
    return F.scaled_dot_product_attention(x, x, x, attn_mask=mask)


def main():
    torch.manual_seed(0)
    lengths = [3, 6, 5]
    seq_lens = {"numpy": np.array(lengths), "list": lengths, "tuple": tuple(lengths)}[HELD]
    out = attend(torch.randn(3, 2, 6, 8), seq_lens)
    print("nan rows", int(torch.isnan(out).any(-1).sum()))


if __name__ == "__main__":
    main()
