# Citation: ggml-org/llama.cpp
#   src/llama-kv-cache.cpp @3514e9f6e795d3b3cd88d6614f6c07e7ce6f916f (llama_kv_cache::seq_rm, seq_cp, prepare,
#   find_slot, apply_ubatch, get_n_kv, get_k / get_v, cpy_k / cpy_v, set_input_k_idxs, set_input_kq_mask),
#   src/llama-kv-cells.h (llama_kv_cells: pos, seq bitset, used / used_max_p1, seq_rm / seq_add / seq_pos_min/max),
#   src/llama-graph.cpp @434f71a5b4d1ff9c9c9b59e08326f0fe3d15193a (build_attn_mha: kq = mul_mat(k, q) with GQA
#   broadcast, soft_max_ext(kq, kq_mask, kq_scale, max_bias), kqv = mul_mat(v, kq)), src/models/llama.cpp
#   (llm_build_llama: rms_norm, rope_ext NORM mode, silu-gated FFN), ggml/include/ggml.h (GGML_KQ_MASK_PAD 64),
#   examples/parallel/parallel.cpp @fe0686164dc1b6cadca7d96115b9c33c59471a5f (shared system prompt in seq 0,
#   llama_memory_seq_cp to each client, continuous batching, seq_rm + seq_cp when a client finishes, the batch
#   decoded in chunks of n_batch).
# llama.cpp keeps every sequence of a context in one unified KV buffer of cells. A cell holds a position and a set of
# sequence ids; the system prompt's cells belong to seq 0 and, after llama_memory_seq_cp, to every client's seq too.
# A batch mixes tokens of several sequences (one client's prompt next to other clients' decode tokens), and a ubatch's
# K/V rows go into whatever free cells find_slot returns (not contiguous once a finished client's cells are freed).
# The KQ mask is rebuilt for every ubatch: -INF everywhere, 0 where the cell is not empty, the cell's seq set holds the
# token's seq id and the cell's pos <= the token's pos; the rows are padded to GGML_KQ_MASK_PAD and soft_max_ext reads
# the first n_tokens of them. Attention runs over the first n_kv cells of the buffer.
# Self-check: each request's whole text (system prompt + its prompt + generated tokens) run alone with no cache and no
# mask by a double loop (each query attends keys 0..i of its own sequence): the logits of every sampled token and the
# greedy tokens; also the K rows held in each request's cells against the reference keys at those positions.
import copy
import math

import torch
from transformers import LlamaConfig

torch.manual_seed(0)

GGML_KQ_MASK_PAD = 64
LLAMA_MAX_SEQ = 64


def GGML_PAD(x, n):
    return ((x + n - 1) // n) * n


# ---- src/llama-kv-cells.h ----
class llama_kv_cells:
    def __init__(self, n):
        self.pos = [-1] * n
        self.seq = [set() for _ in range(n)]
        self.used = set()

    def size(self):
        return len(self.pos)

    def is_empty(self, i):
        return self.pos[i] == -1

    def get_used(self):
        return len(self.used)

    def used_max_p1(self):
        return 0 if not self.used else max(self.used) + 1

    def rm(self, i):
        self.pos[i] = -1
        self.seq[i] = set()
        self.used.discard(i)

    def seq_rm(self, i, seq_id):
        self.seq[i].discard(seq_id)
        if not self.seq[i]:
            self.pos[i] = -1
            self.used.discard(i)
            return True
        return False

    def seq_has(self, i, seq_id):
        return seq_id in self.seq[i]

    def seq_count(self, i):
        return len(self.seq[i])

    def seq_get(self, i):
        return next(iter(self.seq[i]))

    def seq_add(self, i, seq_id):
        self.seq[i].add(seq_id)

    def seq_pos_min(self, seq_id):
        p = [self.pos[i] for i in range(self.size()) if seq_id in self.seq[i]]
        return min(p) if p else -1

    def seq_pos_max(self, seq_id):
        p = [self.pos[i] for i in range(self.size()) if seq_id in self.seq[i]]
        return max(p) if p else -1

    def pos_get(self, i):
        return self.pos[i]

    def pos_set(self, i, p):
        self.pos[i] = p
        self.used.add(i)

    def pos_in(self, i, p0, p1):
        return p0 <= self.pos[i] < p1


class llama_ubatch:
    def __init__(self, token, pos, seq_id, output):
        self.token = token
        self.pos = pos
        self.seq_id = seq_id          # list of lists, as ubatch->seq_id[i][s]
        self.output = output
        self.n_tokens = len(token)


# ---- src/llama-kv-cache.cpp (unified: one stream, no SWA) ----
class llama_kv_cache:
    def __init__(self, hparams, kv_size, n_pad):
        self.hparams = hparams
        self.n_pad = n_pad
        self.n_stream = 1
        self.cells = llama_kv_cells(kv_size)
        self.head = 0
        n_embd_k_gqa = hparams.n_embd_head_k * hparams.n_head_kv
        # ggml_backend_buffer_clear(buf, 0)
        self.k = [torch.zeros(kv_size, n_embd_k_gqa) for _ in range(hparams.n_layer)]
        self.v = [torch.zeros(kv_size, n_embd_k_gqa) for _ in range(hparams.n_layer)]

    def get_size(self):
        return self.cells.size()

    def seq_rm(self, seq_id, p0, p1):
        if p0 < 0:
            p0 = 0
        if p1 < 0:
            p1 = 2 ** 31 - 1
        cells = self.cells
        new_head = cells.size()
        for i in range(cells.size()):
            if not cells.pos_in(i, p0, p1):
                continue
            if cells.seq_has(i, seq_id) and cells.seq_rm(i, seq_id):
                if new_head == cells.size():
                    new_head = i
        if new_head != cells.size() and new_head < self.head:
            self.head = new_head
        return True

    def seq_cp(self, seq_id_src, seq_id_dst, p0, p1):
        # both sequences live in the same stream: only the cells' metadata changes
        cells = self.cells
        if seq_id_src == seq_id_dst:
            return
        if p0 < 0:
            p0 = 0
        if p1 < 0:
            p1 = 2 ** 31 - 1
        for i in range(cells.size()):
            if not cells.pos_in(i, p0, p1):
                continue
            if cells.seq_has(i, seq_id_src):
                cells.seq_add(i, seq_id_dst)

    def find_slot(self, ubatch, cont):
        cells = self.cells
        n_tokens = ubatch.n_tokens
        idxs = []
        head_cur = self.head
        if head_cur > cells.get_used() + 2 * n_tokens:
            head_cur = 0
        if n_tokens > cells.size():
            return None
        n_tested = 0
        n_test = n_tokens if cont else 1
        while True:
            if head_cur + n_test > cells.size():
                n_tested += cells.size() - head_cur
                head_cur = 0
                continue
            for _ in range(n_test):
                idx = head_cur
                head_cur += 1
                n_tested += 1
                can_use = cells.is_empty(idx)
                # (SWA reuse of occupied cells: n_swa == 0 here, never masked)
                if can_use:
                    idxs.append(idx)
                elif cont:
                    break
            if len(idxs) == n_tokens:
                break
            if cont:
                idxs = []
            if n_tested >= cells.size():
                return None
        return idxs

    def apply_ubatch(self, idxs, ubatch):
        cells = self.cells
        for i, idx in enumerate(idxs):
            if not cells.is_empty(idx):
                cells.rm(idx)
            cells.pos_set(idx, ubatch.pos[i])
            for s in ubatch.seq_id[i]:
                cells.seq_add(idx, s)
        self.head = idxs[-1] + 1

    def prepare(self, ubatches):
        # find a slot for every ubatch, placing them one after the other, then restore the cells
        saved_cells, saved_head = copy.deepcopy(self.cells), self.head
        res = []
        for ub in ubatches:
            sinfo = self.find_slot(ub, False)
            if sinfo is None:
                res = []
                break
            res.append(sinfo)
            self.apply_ubatch(sinfo, ub)
        self.cells, self.head = saved_cells, saved_head
        return res

    def get_n_kv(self):
        n_pad_cur = max(self.n_pad, 256)
        return min(self.cells.size(), max(n_pad_cur, GGML_PAD(self.cells.used_max_p1(), n_pad_cur)))

    def set_input_kq_mask(self, ubatch, n_kv, causal_attn=True):
        n_tokens = ubatch.n_tokens
        n_tps = n_tokens
        n_tps_pad = GGML_PAD(n_tps, GGML_KQ_MASK_PAD)
        data = torch.full((n_tps_pad, n_kv), -math.inf)
        cells = self.cells
        for ii in range(n_tps):
            i = ii
            seq_id = ubatch.seq_id[i][0]
            p1 = ubatch.pos[i]
            for j in range(n_kv):
                if cells.is_empty(j):
                    continue
                # mask the token if not the same sequence
                if not cells.seq_has(j, seq_id):
                    continue
                p0 = cells.pos_get(j)
                # mask future tokens
                if causal_attn and p0 > p1:
                    continue
                data[ii, j] = -abs(p0 - p1) if self.hparams.use_alibi else 0.0
        return data

    def cpy_k(self, il, k_cur, k_idxs):
        self.k[il][k_idxs] = k_cur.reshape(k_cur.shape[0], -1)     # ggml_set_rows

    def cpy_v(self, il, v_cur, v_idxs):
        self.v[il][v_idxs] = v_cur.reshape(v_cur.shape[0], -1)

    def get_k(self, il, n_kv):
        hp = self.hparams
        return self.k[il][:n_kv].view(n_kv, hp.n_head_kv, hp.n_embd_head_k)

    def get_v(self, il, n_kv):
        hp = self.hparams
        return self.v[il][:n_kv].view(n_kv, hp.n_head_kv, hp.n_embd_head_k)


# ---- hparams with llama.cpp's names, read from a transformers config ----
class llama_hparams:
    def __init__(self, cfg):
        self.n_embd = cfg.hidden_size
        self.n_head = cfg.num_attention_heads
        self.n_head_kv = cfg.num_key_value_heads
        self.n_layer = cfg.num_hidden_layers
        self.n_ff = cfg.intermediate_size
        self.n_vocab = cfg.vocab_size
        self.n_embd_head_k = cfg.hidden_size // cfg.num_attention_heads
        self.n_rot = self.n_embd_head_k
        self.f_norm_rms_eps = cfg.rms_norm_eps
        self.rope_freq_base = cfg.rope_theta if hasattr(cfg, "rope_theta") else 10000.0
        self.use_alibi = False


config = LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5)
hparams = llama_hparams(config)


def make_weights(hp):
    g = torch.Generator().manual_seed(1)
    r = lambda *s: torch.randn(*s, generator=g) * 0.3
    w = {"token_embd": r(hp.n_vocab, hp.n_embd), "output_norm": 1 + 0.1 * r(hp.n_embd),
         "output": r(hp.n_vocab, hp.n_embd) * 2}
    kv = hp.n_head_kv * hp.n_embd_head_k
    for il in range(hp.n_layer):
        w[f"blk.{il}.attn_norm"] = 1 + 0.1 * r(hp.n_embd)
        w[f"blk.{il}.attn_q"] = r(hp.n_embd, hp.n_embd)
        w[f"blk.{il}.attn_k"] = r(kv, hp.n_embd)
        w[f"blk.{il}.attn_v"] = r(kv, hp.n_embd)
        w[f"blk.{il}.attn_output"] = r(hp.n_embd, hp.n_embd)
        w[f"blk.{il}.ffn_norm"] = 1 + 0.1 * r(hp.n_embd)
        w[f"blk.{il}.ffn_gate"] = r(hp.n_ff, hp.n_embd)
        w[f"blk.{il}.ffn_up"] = r(hp.n_ff, hp.n_embd)
        w[f"blk.{il}.ffn_down"] = r(hp.n_embd, hp.n_ff)
    return w


W = make_weights(hparams)


def rms_norm(x, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def rope_ext_norm(x, pos, n_rot, freq_base):
    # ggml_rope_ext, mode 0 (LLAMA_ROPE_TYPE_NORM): rotates adjacent pairs (x[2i], x[2i+1])
    theta_scale = freq_base ** (-2.0 / n_rot)
    i = torch.arange(n_rot // 2, dtype=torch.float32)
    theta = pos.float()[:, None] * theta_scale ** i[None, :]            # [n_tokens, n_rot/2]
    cos, sin = theta.cos()[:, None, :], theta.sin()[:, None, :]
    x0, x1 = x[..., 0::2], x[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x0 * cos - x1 * sin
    out[..., 1::2] = x0 * sin + x1 * cos
    return out


def soft_max_ext(kq, mask, scale):
    # ggml_soft_max_ext: softmax(kq*scale + mask) along n_kv; the mask has GGML_KQ_MASK_PAD-padded rows,
    # row i of kq reads mask row i
    return torch.softmax(kq * scale + mask[: kq.shape[-2]], dim=-1)


def build_attn_mha(q, k, v, kq_mask, kq_scale):
    # q: [n_tokens, n_head, d]; k / v: [n_kv, n_head_kv, d]
    q = q.permute(1, 0, 2)                          # [n_head, n_tokens, d]
    k = k.permute(1, 0, 2)                          # [n_head_kv, n_kv, d]
    v = v.permute(1, 0, 2)
    rep = q.shape[0] // k.shape[0]                  # ggml_mul_mat broadcasts k over the q heads
    k = k.repeat_interleave(rep, dim=0)
    v = v.repeat_interleave(rep, dim=0)
    kq = q @ k.transpose(1, 2)                      # [n_head, n_tokens, n_kv]
    kq = soft_max_ext(kq, kq_mask, kq_scale)
    kqv = kq @ v                                    # [n_head, n_tokens, d]
    return kqv.permute(1, 0, 2).reshape(kqv.shape[1], -1)


def llm_build_llama(kv, ubatch, k_idxs, kq_mask, n_kv):
    hp = hparams
    tokens = torch.tensor(ubatch.token)
    inp_pos = torch.tensor(ubatch.pos)
    kq_scale = 1.0 / math.sqrt(hp.n_embd_head_k)
    inpL = W["token_embd"][tokens]
    for il in range(hp.n_layer):
        inpSA = inpL
        cur = rms_norm(inpL, hp.f_norm_rms_eps) * W[f"blk.{il}.attn_norm"]
        Qcur = (cur @ W[f"blk.{il}.attn_q"].T).view(-1, hp.n_head, hp.n_embd_head_k)
        Kcur = (cur @ W[f"blk.{il}.attn_k"].T).view(-1, hp.n_head_kv, hp.n_embd_head_k)
        Vcur = (cur @ W[f"blk.{il}.attn_v"].T).view(-1, hp.n_head_kv, hp.n_embd_head_k)
        Qcur = rope_ext_norm(Qcur, inp_pos, hp.n_rot, hp.rope_freq_base)
        Kcur = rope_ext_norm(Kcur, inp_pos, hp.n_rot, hp.rope_freq_base)
        # build_attn with a KV cache: store this ubatch's K/V in its cells, then attend the first n_kv cells
        kv.cpy_k(il, Kcur, k_idxs)
        kv.cpy_v(il, Vcur, k_idxs)
        k = kv.get_k(il, n_kv)
        v = kv.get_v(il, n_kv)
        cur = build_attn_mha(Qcur, k, v, kq_mask, kq_scale)
        cur = cur @ W[f"blk.{il}.attn_output"].T
        ffn_inp = cur + inpSA
        cur = rms_norm(ffn_inp, hp.f_norm_rms_eps) * W[f"blk.{il}.ffn_norm"]
        cur = torch.nn.functional.silu(cur @ W[f"blk.{il}.ffn_gate"].T) * (cur @ W[f"blk.{il}.ffn_up"].T)
        cur = cur @ W[f"blk.{il}.ffn_down"].T
        inpL = cur + ffn_inp
    cur = rms_norm(inpL, hp.f_norm_rms_eps) * W["output_norm"]
    return cur @ W["output"].T


# ---- llama_context::decode, reduced to what the unified cache needs ----
class llama_context:
    def __init__(self, n_ctx, n_ubatch):
        self.kv = llama_kv_cache(hparams, n_ctx, n_pad=32)
        self.n_ubatch = n_ubatch
        self.logits = {}

    def decode(self, batch):
        n = len(batch["token"])
        # llama_batch_allocr::split_simple: consecutive runs of n_ubatch tokens
        ubatches = []
        for s in range(0, n, self.n_ubatch):
            e = min(n, s + self.n_ubatch)
            ubatches.append(llama_ubatch(batch["token"][s:e], batch["pos"][s:e], batch["seq_id"][s:e],
                                         batch["logits"][s:e]))
        sinfos = self.kv.prepare(ubatches)
        if not sinfos:
            return 1
        self.logits = {}
        base = 0
        for ub, sinfo in zip(ubatches, sinfos):
            self.kv.apply_ubatch(sinfo, ub)
            n_kv = self.kv.get_n_kv()
            kq_mask = self.kv.set_input_kq_mask(ub, n_kv, causal_attn=True)
            k_idxs = torch.tensor(sinfo)
            out = llm_build_llama(self.kv, ub, k_idxs, kq_mask, n_kv)
            for i in range(ub.n_tokens):
                if ub.output[i]:
                    self.logits[base + i] = out[i]
            base += ub.n_tokens
        return 0

    def get_logits_ith(self, i):
        return self.logits[i]


def batch_add(batch, token, pos, seq_ids, logits):
    batch["token"].append(token)
    batch["pos"].append(pos)
    batch["seq_id"].append(list(seq_ids))
    batch["logits"].append(logits)


def batch_clear(batch):
    for key in batch:
        batch[key].clear()


# ---- examples/parallel/parallel.cpp (built-in prompts replaced by fixed token lists, greedy sampling) ----
class client:
    def __init__(self, i):
        self.id = i
        self.seq_id = -1
        self.sampled = None
        self.n_past = 0
        self.n_prompt = 0
        self.n_decoded = 0
        self.i_batch = -1
        self.prompt = []
        self.response = []
        self.logits = []


g = torch.Generator().manual_seed(7)
tokens_system = torch.randint(2, hparams.n_vocab, (6,), generator=g).tolist()
k_prompts = [torch.randint(2, hparams.n_vocab, (n,), generator=g).tolist() for n in (5, 9, 3, 7, 4)]
n_clients = 3
n_seq = 5
n_predict = 5
eog_tokens = {20}   # stands for llama_vocab_is_eog(vocab, id)
n_batch = 8
cont_batching = True

ctx = llama_context(n_ctx=64, n_ubatch=4)
mem = ctx.kv
n_tokens_system = len(tokens_system)
batch = {"token": [], "pos": [], "seq_id": [], "logits": []}

for i in range(n_tokens_system):
    batch_add(batch, tokens_system[i], i, [0], False)
assert ctx.decode(batch) == 0
# assign the system KV cache to all parallel sequences
for i in range(1, n_clients + 1):
    mem.seq_cp(0, i, -1, -1)

clients = [client(i) for i in range(n_clients)]
finished = []
g_seq_id = 0
saw_mixed_batch = False
saw_reused_cells = False

while True:
    batch_clear(batch)
    # decode any currently ongoing sequences
    for c in clients:
        if c.seq_id == -1:
            continue
        c.i_batch = len(batch["token"])
        batch_add(batch, c.sampled, c.n_past, [c.id + 1], True)
        c.n_past += 1
        c.n_decoded += 1

    if len(batch["token"]) == 0:
        # all sequences have ended - clear the entire KV cache, but keep the system prompt
        for i in range(1, n_clients + 1):
            mem.seq_rm(i, -1, -1)
            mem.seq_cp(0, i, -1, -1)

    n_ongoing = len(batch["token"])
    # insert new sequences for decoding
    if cont_batching or len(batch["token"]) == 0:
        for c in clients:
            if c.seq_id == -1 and g_seq_id < n_seq:
                c.seq_id = g_seq_id
                c.n_past = n_tokens_system
                c.prompt = k_prompts[g_seq_id]
                c.response = []
                c.logits = []
                for t in c.prompt:
                    batch_add(batch, t, c.n_past, [c.id + 1], False)
                    c.n_past += 1
                # extract the logits only for the last token
                batch["logits"][-1] = True
                c.n_prompt = len(c.prompt)
                c.n_decoded = 0
                c.i_batch = len(batch["token"]) - 1
                if n_ongoing > 0:
                    saw_mixed_batch = True
                    free_before = [j for j in range(mem.get_size()) if mem.cells.is_empty(j)]
                    if free_before and free_before[0] < mem.cells.used_max_p1():
                        saw_reused_cells = True
                g_seq_id += 1

    if len(batch["token"]) == 0:
        break

    # process in chunks of n_batch
    i = 0
    while i < len(batch["token"]):
        n_tokens = min(n_batch, len(batch["token"]) - i)
        view = {key: batch[key][i:i + n_tokens] for key in batch}
        assert ctx.decode(view) == 0
        for c in clients:
            if c.i_batch < i or c.i_batch >= i + n_tokens:
                continue
            logits = ctx.get_logits_ith(c.i_batch - i)
            tok = int(torch.argmax(logits))
            c.logits.append(logits.clone())
            c.response.append(tok)
            c.sampled = tok
            if c.n_decoded > 2 and (tok in eog_tokens or c.n_decoded >= n_predict):
                # the K rows of this client's cells, before they are released
                cells_of = [(j, mem.cells.pos_get(j)) for j in range(mem.get_size())
                            if mem.cells.seq_has(j, c.id + 1)]
                keys0 = {p: mem.k[0][j].clone() for j, p in cells_of}
                finished.append((c.seq_id, list(c.prompt), list(c.response), list(c.logits), keys0))
                # delete only the generated part of the sequence, i.e. keep the system prompt in the cache
                mem.seq_rm(c.id + 1, -1, -1)
                mem.seq_cp(0, c.id + 1, -1, -1)
                c.seq_id = -1
            c.i_batch = -1
        i += n_tokens


# ---- reference: one sequence alone, no cache, no mask (each query attends keys 0..i) ----
def ref_forward(tokens):
    hp = hparams
    T = len(tokens)
    pos = torch.arange(T)
    x = W["token_embd"][torch.tensor(tokens)]
    keys_layer0 = None
    for il in range(hp.n_layer):
        h = rms_norm(x, hp.f_norm_rms_eps) * W[f"blk.{il}.attn_norm"]
        q = rope_ext_norm((h @ W[f"blk.{il}.attn_q"].T).view(T, hp.n_head, -1), pos, hp.n_rot, hp.rope_freq_base)
        k = rope_ext_norm((h @ W[f"blk.{il}.attn_k"].T).view(T, hp.n_head_kv, -1), pos, hp.n_rot, hp.rope_freq_base)
        v = (h @ W[f"blk.{il}.attn_v"].T).view(T, hp.n_head_kv, -1)
        if il == 0:
            keys_layer0 = k.reshape(T, -1)
        rep = hp.n_head // hp.n_head_kv
        out = torch.zeros(T, hp.n_head, hp.n_embd_head_k)
        for qi in range(T):
            for hh in range(hp.n_head):
                kk = k[: qi + 1, hh // rep]
                vv = v[: qi + 1, hh // rep]
                a = torch.softmax(kk @ q[qi, hh] / math.sqrt(hp.n_embd_head_k), dim=0)
                out[qi, hh] = a @ vv
        x = out.reshape(T, -1) @ W[f"blk.{il}.attn_output"].T + x
        h = rms_norm(x, hp.f_norm_rms_eps) * W[f"blk.{il}.ffn_norm"]
        x = (torch.nn.functional.silu(h @ W[f"blk.{il}.ffn_gate"].T) * (h @ W[f"blk.{il}.ffn_up"].T)) \
            @ W[f"blk.{il}.ffn_down"].T + x
    return (rms_norm(x, hp.f_norm_rms_eps) * W["output_norm"]) @ W["output"].T, keys_layer0


assert len(finished) == n_seq, len(finished)
assert saw_mixed_batch and saw_reused_cells
for seq_id, prompt, response, logits, keys0 in finished:
    full = tokens_system + prompt + response[:-1]
    ref_logits, ref_k0 = ref_forward(full)
    start = n_tokens_system + len(prompt) - 1
    for t, (lg, tok) in enumerate(zip(logits, response)):
        assert torch.allclose(lg, ref_logits[start + t], atol=1e-4), (seq_id, t)
        assert tok == int(torch.argmax(ref_logits[start + t])), (seq_id, t)
    # every position of this request (system prompt included) is held by exactly one cell, with the right K row
    assert sorted(keys0) == list(range(len(full))), (seq_id, sorted(keys0))
    for p, krow in keys0.items():
        assert torch.allclose(krow, ref_k0[p], atol=1e-5), (seq_id, p)
    print(f"request {seq_id}: prompt {len(prompt)} tokens, generated {response}")
print("ok")
