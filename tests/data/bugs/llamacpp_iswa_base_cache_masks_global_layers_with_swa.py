# Citation: ggml-org/llama.cpp#15811 ("kv-cache : fix SWA checks + disable cacheless iSWA", merged 2025-09-05),
# fixes issue ggml-org/llama.cpp#15808, a regression introduced by ggml-org/llama.cpp#15798.
# Upstream: src/llama-kv-cache.cpp  llama_kv_cache::set_input_kq_mask  (+ src/llama-hparams.{h,cpp}
# llama_hparams::is_masked_swa, src/llama-kv-cache-iswa.cpp llama_kv_cache_iswa with kv_base / kv_swa).
# Bug: after #15798 the KV cache's kq_mask asked `hparams.is_masked_swa(p0, p1)`, which uses the model-wide
# hparams.n_swa / hparams.swa_type. For an interleaved-SWA model (Gemma 2/3 style) the non-SWA cache (kv_base,
# built with swa_type = NONE) therefore also applied the sliding window, so the global-attention layers only saw
# the last n_swa positions.
# Fix: is_masked_swa became `static is_masked_swa(n_swa, swa_type, p0, p1)` and the cache passes its own
# n_swa / swa_type (NONE for kv_base, hparams' for kv_swa).
#
# Torch re-implementation of the cells / kq_mask / iSWA graph inputs, tiny sizes, CPU.
import math
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

LLAMA_SWA_TYPE_NONE = 0
LLAMA_SWA_TYPE_STANDARD = 1
LLAMA_SWA_TYPE_CHUNKED = 2


class llama_hparams:
    def __init__(self):
        self.n_embd = 32
        self.n_head = 4
        self.n_layer = 6
        self.n_vocab = 64
        self.n_swa = 4
        self.swa_type = LLAMA_SWA_TYPE_STANDARD
        self.use_alibi = False
        self.rope_freq_base_train = 10000.0
        self.rope_freq_base_train_swa = 10000.0
        self.swa_layers = [False] * self.n_layer
        self.set_swa_pattern(3)  # gemma3-like: 2 SWA layers then 1 global layer

    def set_swa_pattern(self, n_pattern):
        for il in range(self.n_layer):
            self.swa_layers[il] = n_pattern == 0 or (il % n_pattern < (n_pattern - 1))

    def is_swa(self, il):
        return self.swa_layers[il]

    # --- before #15811: member function, reads the model-wide SWA parameters
    def is_masked_swa_member(self, p0, p1):
        return llama_hparams.is_masked_swa(self.n_swa, self.swa_type, p0, p1)

    # --- after #15811: static, the caller passes the SWA parameters of its own cache
    @staticmethod
    def is_masked_swa(n_swa, swa_type, p0, p1):
        assert p0 >= 0 and p1 >= 0
        if swa_type == LLAMA_SWA_TYPE_NONE:
            pass
        elif swa_type == LLAMA_SWA_TYPE_STANDARD:
            if p1 - p0 >= n_swa:
                return True
        elif swa_type == LLAMA_SWA_TYPE_CHUNKED:
            pos_chunk_start = (p1 // n_swa) * n_swa
            if p0 < pos_chunk_start:
                return True
        return False


class llama_ubatch:
    def __init__(self, tokens, pos, seq_id):
        self.token = tokens
        self.pos = pos
        self.seq_id = seq_id
        self.n_tokens = len(tokens)


class llama_kv_cells:
    def __init__(self, size):
        self.pos = [-1] * size
        self.seq = [set() for _ in range(size)]

    def is_empty(self, j):
        return self.pos[j] < 0

    def seq_has(self, j, seq_id):
        return seq_id in self.seq[j]

    def pos_get(self, j):
        return self.pos[j]


class llama_kv_cache:
    def __init__(self, hparams, filter_fn, kv_size, n_swa, swa_type):
        self.hparams = hparams
        self.n_swa = n_swa
        self.swa_type = swa_type
        self.size = kv_size
        self.cells = llama_kv_cells(kv_size)
        self.head = 0
        self.layers = {}
        for il in range(hparams.n_layer):
            if not filter_fn(il):
                continue
            self.layers[il] = (torch.zeros(kv_size, hparams.n_embd), torch.zeros(kv_size, hparams.n_embd))

    def apply_ubatch(self, ubatch):
        # find_slot + apply_ubatch (contiguous slots, no wrap-around needed at these sizes)
        idxs = list(range(self.head, self.head + ubatch.n_tokens))
        for i, idx in enumerate(idxs):
            self.cells.pos[idx] = ubatch.pos[i]
            self.cells.seq[idx] = {ubatch.seq_id[i]}
        self.head += ubatch.n_tokens
        return idxs

    def cpy_k_v(self, il, k_cur, v_cur, idxs):
        k, v = self.layers[il]
        k[idxs] = k_cur
        v[idxs] = v_cur

    def get_k_v(self, il, n_kv):
        k, v = self.layers[il]
        return k[:n_kv], v[:n_kv]

    def get_n_kv(self):
        return self.head

    def set_input_kq_mask(self, ubatch, causal_attn):
        n_kv = self.get_n_kv()
        n_tokens = ubatch.n_tokens
        data = torch.full((n_tokens, n_kv), float("-inf"))
        for i in range(n_tokens):
            seq_id = ubatch.seq_id[i]
            p1 = ubatch.pos[i]
            for j in range(n_kv):
                if self.cells.is_empty(j):
                    continue
                # mask the token if not the same sequence
                if not self.cells.seq_has(j, seq_id):
                    continue
                p0 = self.cells.pos_get(j)
                # mask future tokens
                if causal_attn and p0 > p1:
                    continue
                # apply SWA if any
                if FIXED:
                    masked = llama_hparams.is_masked_swa(self.n_swa, self.swa_type, p0, p1)
                else:
                    masked = self.hparams.is_masked_swa_member(p0, p1)
                if masked:
                    continue
                data[i, j] = -abs(p0 - p1) if self.hparams.use_alibi else 0.0
        return data


class llama_kv_cache_iswa:
    def __init__(self, hparams, kv_size):
        filter_base = lambda il: not hparams.is_swa(il)
        filter_swa = lambda il: hparams.is_swa(il)
        # swa_full = true: the SWA cache keeps every cell (no pruning), so only the kq_mask applies the window
        self.kv_base = llama_kv_cache(hparams, filter_base, kv_size, 0, LLAMA_SWA_TYPE_NONE)
        self.kv_swa = llama_kv_cache(hparams, filter_swa, kv_size, hparams.n_swa, hparams.swa_type)

    def apply_ubatch(self, ubatch):
        return self.kv_base.apply_ubatch(ubatch), self.kv_swa.apply_ubatch(ubatch)


def rope(x, pos, n_head, freq_base):
    # x: [n_tokens, n_head*d], NEOX-style rotation
    n_tokens, n_embd = x.shape
    d = n_embd // n_head
    x = x.view(n_tokens, n_head, d)
    half = d // 2
    inv = freq_base ** (-torch.arange(half, dtype=torch.float32) / half)
    ang = torch.tensor(pos, dtype=torch.float32)[:, None] * inv[None]
    cos, sin = ang.cos()[:, None], ang.sin()[:, None]
    x1, x2 = x[..., :half], x[..., half:]
    out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return out.view(n_tokens, n_embd)


class llm_build_gemma3_iswa(nn.Module):
    def __init__(self, hparams):
        super().__init__()
        hp = hparams
        self.hp = hp
        self.tok_embd = nn.Embedding(hp.n_vocab, hp.n_embd)
        self.attn_norm = nn.ModuleList(nn.RMSNorm(hp.n_embd) for _ in range(hp.n_layer))
        self.wq = nn.ModuleList(nn.Linear(hp.n_embd, hp.n_embd, bias=False) for _ in range(hp.n_layer))
        self.wk = nn.ModuleList(nn.Linear(hp.n_embd, hp.n_embd, bias=False) for _ in range(hp.n_layer))
        self.wv = nn.ModuleList(nn.Linear(hp.n_embd, hp.n_embd, bias=False) for _ in range(hp.n_layer))
        self.wo = nn.ModuleList(nn.Linear(hp.n_embd, hp.n_embd, bias=False) for _ in range(hp.n_layer))
        self.ffn_norm = nn.ModuleList(nn.RMSNorm(hp.n_embd) for _ in range(hp.n_layer))
        self.ffn_up = nn.ModuleList(nn.Linear(hp.n_embd, 2 * hp.n_embd, bias=False) for _ in range(hp.n_layer))
        self.ffn_down = nn.ModuleList(nn.Linear(2 * hp.n_embd, hp.n_embd, bias=False) for _ in range(hp.n_layer))
        self.output_norm = nn.RMSNorm(hp.n_embd)
        self.output = nn.Linear(hp.n_embd, hp.n_vocab, bias=False)

    def build_attn(self, il, kv, kq_mask, cur, ubatch, idxs):
        hp = self.hp
        freq_base = hp.rope_freq_base_train_swa if hp.is_swa(il) else hp.rope_freq_base_train
        q = rope(self.wq[il](cur), ubatch.pos, hp.n_head, freq_base)
        k = rope(self.wk[il](cur), ubatch.pos, hp.n_head, freq_base)
        v = self.wv[il](cur)
        kv.cpy_k_v(il, k, v, idxs)
        n_kv = kv.get_n_kv()
        K, V = kv.get_k_v(il, n_kv)
        d = hp.n_embd // hp.n_head
        qh = q.view(-1, hp.n_head, d).transpose(0, 1)
        kh = K.view(n_kv, hp.n_head, d).transpose(0, 1)
        vh = V.view(n_kv, hp.n_head, d).transpose(0, 1)
        kq = qh @ kh.transpose(-1, -2) / math.sqrt(d)
        kq = torch.softmax(kq + kq_mask, dim=-1)  # ggml_soft_max_ext(kq, kq_mask, scale, ...)
        out = (kq @ vh).transpose(0, 1).reshape(-1, hp.n_embd)
        return self.wo[il](out)

    def forward(self, ubatch, mem):
        hp = self.hp
        idx_base, idx_swa = mem.apply_ubatch(ubatch)
        # build_attn_inp_kv_iswa: one kq_mask per sub-cache
        self_kq_mask = mem.kv_base.set_input_kq_mask(ubatch, causal_attn=True)
        self_kq_mask_swa = mem.kv_swa.set_input_kq_mask(ubatch, causal_attn=True)
        x = self.tok_embd(torch.tensor(ubatch.token)) * math.sqrt(hp.n_embd)
        for il in range(hp.n_layer):
            if hp.is_swa(il):
                kv, mask, idxs = mem.kv_swa, self_kq_mask_swa, idx_swa
            else:
                kv, mask, idxs = mem.kv_base, self_kq_mask, idx_base
            h = self.build_attn(il, kv, mask, self.attn_norm[il](x), ubatch, idxs)
            x = x + h
            x = x + self.ffn_down[il](torch.nn.functional.gelu(self.ffn_up[il](self.ffn_norm[il](x))))
        return self.output(self.output_norm(x))


def main():
    hp = llama_hparams()
    model = llm_build_gemma3_iswa(hp).eval()
    mem = llama_kv_cache_iswa(hp, kv_size=32)

    prompt = torch.randint(0, hp.n_vocab, (14,)).tolist()
    n_predict = 6
    with torch.no_grad():
        ub = llama_ubatch(prompt, list(range(len(prompt))), [0] * len(prompt))
        logits = model(ub, mem)
        last = logits[-1]
        print("prompt logits[-1][:6]:", [round(v, 4) for v in last[:6].tolist()])
        generated = []
        n_past = len(prompt)
        for _ in range(n_predict):
            tok = int(last.argmax())
            generated.append(tok)
            ub = llama_ubatch([tok], [n_past], [0])
            last = model(ub, mem)[-1]
            n_past += 1
    print("generated:", generated)
    print("final logits[:6]:", [round(v, 4) for v in last[:6].tolist()])
    print("final logit sum: %.6f" % float(last.sum()))


if __name__ == "__main__":
    main()
