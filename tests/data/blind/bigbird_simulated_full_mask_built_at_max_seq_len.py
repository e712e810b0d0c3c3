# google-research/bigbird#35: full_bigbird_mask builds the dense BigBird pattern on a
# MAX_SEQ_LEN x MAX_SEQ_LEN grid and clips it, instead of using from_seq_length/to_seq_length.
import sys

import numpy as np
import torch

FIXED = "--fixed" in sys.argv
MAX_SEQ_LEN = 64  # upstream: 4096


def bigbird_block_rand_mask(from_seq_length, to_seq_length, from_block_size, to_block_size,
                            num_rand_blocks, last_idx=-1):
    assert from_seq_length // from_block_size == to_seq_length // to_block_size, \
        "Error the number of blocks needs to be same!"
    rand_attn = np.zeros((from_seq_length // from_block_size - 2, num_rand_blocks), dtype=np.int32)
    middle_seq = np.arange(1, to_seq_length // to_block_size - 1, dtype=np.int32)
    last = to_seq_length // to_block_size - 1
    if last_idx > (2 * to_block_size):
        last = (last_idx // to_block_size) - 1
    r = num_rand_blocks
    for i in range(1, from_seq_length // from_block_size - 1):
        start = i - 2
        end = i
        if i == 1:
            rand_attn[i - 1, :] = np.random.permutation(middle_seq[2:last])[:r]
        elif i == 2:
            rand_attn[i - 1, :] = np.random.permutation(middle_seq[3:last])[:r]
        elif i == from_seq_length // from_block_size - 3:
            rand_attn[i - 1, :] = np.random.permutation(middle_seq[:last])[:r]
        elif i == from_seq_length // from_block_size - 2:
            rand_attn[i - 1, :] = np.random.permutation(middle_seq[:last])[:r]
        else:
            if start > last:
                start = last
                rand_attn[i - 1, :] = np.random.permutation(middle_seq[:start])[:r]
            elif (end + 1) == last:
                rand_attn[i - 1, :] = np.random.permutation(middle_seq[:start])[:r]
            else:
                rand_attn[i - 1, :] = np.random.permutation(
                    np.concatenate((middle_seq[:start], middle_seq[end + 1:last])))[:r]
    return rand_attn


def full_bigbird_mask(from_seq_length, to_seq_length, from_block_size, to_block_size,
                      num_rand_blocks, rand_attn=None, focus=1024):
    """Calculate BigBird attention pattern as a full dense matrix [from_seq_length, to_seq_length]."""
    if FIXED:
        n_from, n_to = from_seq_length, to_seq_length
    else:
        n_from, n_to = MAX_SEQ_LEN, MAX_SEQ_LEN
    if rand_attn is None:
        rand_attn = bigbird_block_rand_mask(n_from, n_to, from_block_size, to_block_size,
                                            num_rand_blocks, focus)

    attn_mask = np.zeros((n_from, n_to), dtype=np.int32)
    for i in range(1, (n_from // from_block_size) - 1):
        attn_mask[(i) * from_block_size:(i + 1) * from_block_size,
                  (i - 1) * to_block_size:(i + 2) * to_block_size] = 1
        for j in rand_attn[i - 1, :]:
            attn_mask[i * from_block_size:(i + 1) * from_block_size,
                      j * to_block_size:(j + 1) * to_block_size] = 1

    attn_mask[:from_block_size, :] = 1
    attn_mask[:, :to_block_size] = 1
    attn_mask[:, -to_block_size:] = 1
    attn_mask[-from_block_size:, :] = 1
    clipped_attn_mask = attn_mask[:from_seq_length, :to_seq_length]
    return np.array(clipped_attn_mask, dtype=bool)


def original_full_attention(query_layer, key_layer, value_layer, attention_mask, size_per_head):
    attention_scores = torch.einsum("bnfh,bnth->bnft", query_layer, key_layer)
    attention_scores = attention_scores * (1.0 / np.sqrt(float(size_per_head)))
    if attention_mask is not None:
        adder = (1.0 - attention_mask.float()) * -10000.0
        attention_scores = attention_scores + adder
    attention_probs = torch.softmax(attention_scores, dim=-1)
    return torch.einsum("bnft,bnth->bfnh", attention_probs, value_layer)


def bigbird_simulated_attention(query_layer, key_layer, value_layer, attention_mask,
                                num_attention_heads, num_rand_blocks, size_per_head,
                                from_seq_length, to_seq_length, from_block_size, to_block_size,
                                seed=None):
    if seed:
        np.random.seed(seed)
    temp_mask = [
        full_bigbird_mask(from_seq_length, to_seq_length, from_block_size, to_block_size,
                          num_rand_blocks, rand_attn=None, focus=1024)
        for _ in range(num_attention_heads)
    ]
    temp_mask = np.stack(temp_mask, axis=0)
    rand_block_mask = torch.from_numpy(temp_mask.astype(np.int32)).unsqueeze(0)  # [1, N, F, T]
    if attention_mask is not None:
        attention_mask = torch.minimum(attention_mask, rand_block_mask)
    else:
        attention_mask = rand_block_mask
    return original_full_attention(query_layer, key_layer, value_layer, attention_mask, size_per_head), attention_mask


def main():
    torch.manual_seed(0)
    batch, heads, seq_len, size_per_head, block = 2, 2, 32, 8, 4
    hidden = heads * size_per_head
    wq, wk, wv = (torch.nn.Linear(hidden, hidden) for _ in range(3))
    x = torch.randn(batch, seq_len, hidden)

    def split(t):
        return t.view(batch, seq_len, heads, size_per_head).transpose(1, 2)

    q, k, v = split(wq(x)), split(wk(x)), split(wv(x))
    input_mask = torch.ones(batch, seq_len, dtype=torch.int32)
    attention_mask = torch.einsum("bf,bt->bft", input_mask, input_mask).unsqueeze(1)

    with torch.no_grad():
        out, mask = bigbird_simulated_attention(
            q, k, v, attention_mask, num_attention_heads=heads, num_rand_blocks=1,
            size_per_head=size_per_head, from_seq_length=seq_len, to_seq_length=seq_len,
            from_block_size=block, to_block_size=block, seed=1234)
        dense = original_full_attention(q, k, v, attention_mask, size_per_head)
    last_block_row = mask[0, 0, -1].float().mean().item()
    print(f"last block (global) row sees {last_block_row:.2f} of keys; "
          f"last query vs dense attention: {(out[:, -1] - dense[:, -1]).abs().max().item():.4f}")


if __name__ == "__main__":
    main()
