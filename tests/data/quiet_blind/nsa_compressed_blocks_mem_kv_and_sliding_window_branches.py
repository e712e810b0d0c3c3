"""Native Sparse Attention: compressed-block branch plus sliding-window branch.

Follows lucidrains/native-sparse-attention-pytorch,
native_sparse_attention_pytorch/native_sparse_attention.py @0d96765c5d5400b877a3882d7e33d7b3a24b9e85,
SparseAttention.forward (branch 1, compressed: ck_seq = (arange(nblocks)+1)*block - 1
padded with -1 for compress_mem_kv, cmask = einx.less('j, i -> i j', ck_seq, cq_seq),
filled with -finfo.max; branch 3, sliding window, as its create_sliding_mask:
q >= kv and q - kv <= window_size), mixed by sigmoid strategy gates (here one gate
pair per head instead of the project's per-token Linear).

Compressed branch: the sequence is cut into blocks of `compress_block_size`; every
complete block is compressed into one key/value (here a learned linear mix over the
block, standing in for the project's compress MLP). Query i may only read compressed
block j when the WHOLE block lies strictly before i (block end < i): a block containing
a future token would leak it (the project also leaves out the block that ends AT i;
query i still sees that token through the sliding branch). Queries up to the end of
the first block would see no block at all, so `num_compressed_mem_kv` learned memory
keys are prepended and are visible to every query. A partial trailing block is
dropped (no query of this sequence comes after its end). The sliding branch is causal
attention to the token itself and the `window` tokens before it.
The result is checked against a per-query loop that gathers the allowed keys itself.
"""
import torch

torch.manual_seed(0)
DT = torch.float64
B, H, N, D = 2, 2, 19, 8
BS, MEM, WINDOW = 4, 1, 5


def attend(q, k, v, mask):
    s = (q @ k.transpose(-1, -2)) / D ** 0.5
    s = s.masked_fill(~mask, -torch.finfo(s.dtype).max)
    return torch.softmax(s, -1) @ v


def compress(x, w):  # x (B,H,N,D) -> (B,H,N//BS,D), a learned mix over each block
    nb = x.shape[2] // BS
    blocks = x[:, :, :nb * BS].reshape(x.shape[0], x.shape[1], nb, BS, D)
    return torch.einsum("bhnsd,s->bhnd", blocks, w)


def sparse_attention(q, k, v, p):
    n = q.shape[2]
    ck, cv = compress(k, p["wk"]), compress(v, p["wv"])
    nb = ck.shape[2]
    mem_k = p["mem_k"].expand(B, H, MEM, D)
    mem_v = p["mem_v"].expand(B, H, MEM, D)
    ck = torch.cat([mem_k, ck], 2)
    cv = torch.cat([mem_v, cv], 2)
    # block j covers tokens [j*BS, (j+1)*BS); its last token is (j+1)*BS - 1
    ck_seq = torch.arange(1, nb + 1) * BS - 1
    ck_seq = torch.nn.functional.pad(ck_seq, (MEM, 0), value=-1)   # memory kv: always visible
    cq_seq = torch.arange(n)
    cmask = ck_seq[None, :] < cq_seq[:, None]            # (n, MEM + nb)
    compressed_out = attend(q, ck, cv, cmask)

    dist = cq_seq[:, None] - cq_seq[None, :]
    smask = (dist >= 0) & (dist <= WINDOW)
    sliding_out = attend(q, k, v, smask)

    gates = torch.sigmoid(p["gate"])                     # (H, 2)
    return gates[None, :, None, 0:1] * compressed_out + gates[None, :, None, 1:2] * sliding_out


def reference(q, k, v, p):
    out = torch.zeros_like(q)
    gates = torch.sigmoid(p["gate"])
    for b in range(B):
        for h in range(H):
            for i in range(q.shape[2]):
                keys, vals = [p["mem_k"][0, 0, m] for m in range(MEM)], [p["mem_v"][0, 0, m] for m in range(MEM)]
                for j in range(0, i - BS + 1, BS):        # blocks ending before i
                    if j + BS - 1 < i:
                        keys.append(k[b, h, j:j + BS].T @ p["wk"])
                        vals.append(v[b, h, j:j + BS].T @ p["wv"])
                K, V = torch.stack(keys), torch.stack(vals)
                a = torch.softmax(K @ q[b, h, i] / D ** 0.5, 0) @ V
                lo = max(0, i - WINDOW)
                s = torch.softmax(k[b, h, lo:i + 1] @ q[b, h, i] / D ** 0.5, 0) @ v[b, h, lo:i + 1]
                out[b, h, i] = gates[h, 0] * a + gates[h, 1] * s
    return out


def main():
    p = {
        "wk": torch.softmax(torch.randn(BS, dtype=DT), 0),
        "wv": torch.softmax(torch.randn(BS, dtype=DT), 0),
        "mem_k": torch.randn(1, 1, MEM, D, dtype=DT),
        "mem_v": torch.randn(1, 1, MEM, D, dtype=DT),
        "gate": torch.randn(H, 2, dtype=DT),
    }
    q, k, v = (torch.randn(B, H, N, D, dtype=DT) for _ in range(3))
    out = sparse_attention(q, k, v, p)
    ref = reference(q, k, v, p)
    d = (out - ref).abs().max().item()
    print(f"seq={N} block={BS} mem_kv={MEM} window={WINDOW} max|nsa-loop|={d:.2e}")
    # causality: perturbing the future must not move earlier outputs
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 10:] += 1.0
    v2[:, :, 10:] -= 1.0
    d_causal = (sparse_attention(q, k2, v2, p)[:, :, :10] - out[:, :, :10]).abs().max().item()
    print(f"max change of outputs before t=10 when keys from t=10 change: {d_causal:.2e}")
    assert d < 1e-12 and d_causal < 1e-12
    print("ok")


if __name__ == "__main__":
    main()
