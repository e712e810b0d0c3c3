# ggml-org/llama.cpp#28318 (fixed by #28335): mtmd decoded Gemma 4 E2B/E4B image chunks with
# llama_set_causal_attn(false), but those models (use_bidirectional_attention = null) expect causal attention.
# Torch re-implementation of the llama.cpp KV-cell mask (kq_mask) and the mtmd chunk loop.
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

PROJECTOR_TYPE_GEMMA4V = "gemma4v"


class LlamaHparams:
    n_embd = 32
    n_head = 4
    n_layer = 2
    n_vocab = 64
    n_ctx = 24
    n_embd_per_layer = 8  # %s.embedding_length_per_layer_input: present only for E2B / E4B


class LlamaKvCache:
    def __init__(self, hp):
        self.pos = torch.full((hp.n_ctx,), -1, dtype=torch.long)  # -1 = empty cell
        self.k = [torch.zeros(hp.n_ctx, hp.n_embd) for _ in range(hp.n_layer)]
        self.v = [torch.zeros(hp.n_ctx, hp.n_embd) for _ in range(hp.n_layer)]
        self.head = 0

    def set_input_kq_mask(self, ubatch_pos, causal_attn):
        # llm_graph_input_attn_kv::set_input: kq_mask[n_tokens, n_kv], 0 = visible, -INF = masked
        n_kv = self.pos.numel()
        kq_mask = torch.full((ubatch_pos.numel(), n_kv), float("-inf"))
        for i, p1 in enumerate(ubatch_pos.tolist()):
            for j in range(n_kv):
                p0 = int(self.pos[j])
                if p0 < 0:
                    continue
                if causal_attn and p0 > p1:
                    continue
                kq_mask[i, j] = 0.0
        return kq_mask


class LlamaContext(nn.Module):
    def __init__(self, hp):
        super().__init__()
        self.hp = hp
        self.tok_embd = nn.Embedding(hp.n_vocab, hp.n_embd)
        self.wq = nn.ModuleList(nn.Linear(hp.n_embd, hp.n_embd, bias=False) for _ in range(hp.n_layer))
        self.wk = nn.ModuleList(nn.Linear(hp.n_embd, hp.n_embd, bias=False) for _ in range(hp.n_layer))
        self.wv = nn.ModuleList(nn.Linear(hp.n_embd, hp.n_embd, bias=False) for _ in range(hp.n_layer))
        self.wo = nn.ModuleList(nn.Linear(hp.n_embd, hp.n_embd, bias=False) for _ in range(hp.n_layer))
        self.output = nn.Linear(hp.n_embd, hp.n_vocab, bias=False)
        self.causal_attn = True
        self.kv = LlamaKvCache(hp)

    def set_causal_attn(self, value):
        self.causal_attn = value

    def decode(self, embd, pos):
        hp, kv = self.hp, self.kv
        cells = torch.arange(kv.head, kv.head + embd.shape[0])
        kv.pos[cells] = pos
        kv.head += embd.shape[0]
        kq_mask = kv.set_input_kq_mask(pos, self.causal_attn)
        hd = hp.n_embd // hp.n_head
        x = embd
        for il in range(hp.n_layer):
            kv.k[il][cells] = self.wk[il](x)
            kv.v[il][cells] = self.wv[il](x)
            q = self.wq[il](x).view(-1, hp.n_head, hd).transpose(0, 1)
            k = kv.k[il].view(-1, hp.n_head, hd).transpose(0, 1)
            v = kv.v[il].view(-1, hp.n_head, hd).transpose(0, 1)
            kq = q @ k.transpose(-1, -2)
            kq = torch.softmax(kq * hd ** -0.5 + kq_mask, dim=-1)  # ggml_soft_max_ext(kq, kq_mask, scale)
            x = x + self.wo[il]((kq @ v).transpose(0, 1).reshape(-1, hp.n_embd))
        return self.output(x)


def mtmd_decode_use_non_causal(ctx, proj_type):
    if proj_type == PROJECTOR_TYPE_GEMMA4V:
        if FIXED:
            # E2B/E4B (per-layer embeddings) were trained causal; only the larger models use "vision" bidirectional
            return ctx.hp.n_embd_per_layer == 0
        return True
    return False


def mtmd_helper_eval_chunks(ctx, chunks, proj_type):
    n_past, logits = 0, None
    for kind, data in chunks:
        embd = ctx.tok_embd(data) if kind == "text" else data
        pos = torch.arange(n_past, n_past + embd.shape[0])
        non_causal = kind == "image" and mtmd_decode_use_non_causal(ctx, proj_type)
        if non_causal:
            ctx.set_causal_attn(False)
        logits = ctx.decode(embd, pos)
        if non_causal:
            ctx.set_causal_attn(True)
        n_past += embd.shape[0]
    return logits


hp = LlamaHparams()
ctx = LlamaContext(hp).eval()
prompt = torch.randint(0, 64, (3,))
image_embd = torch.randn(6, hp.n_embd)  # output of the vision projector
suffix = torch.randint(0, 64, (2,))
chunks = [("text", prompt), ("image", image_embd), ("text", suffix)]
with torch.no_grad():
    logits = mtmd_helper_eval_chunks(ctx, chunks, PROJECTOR_TYPE_GEMMA4V)
    ref_ctx = LlamaContext(hp).eval()
    ref_ctx.load_state_dict(ctx.state_dict())
    all_embd = torch.cat([ctx.tok_embd(prompt), image_embd, ctx.tok_embd(suffix)])
    ref = ref_ctx.decode(all_embd, torch.arange(all_embd.shape[0]))[-2:]  # one causal batch
print("E4B image chunk non-causal:", mtmd_decode_use_non_causal(ctx, PROJECTOR_TYPE_GEMMA4V),
      "| suffix logits vs one causal batch, max diff: %.4g" % (logits - ref).abs().max().item())
