# ggml-org/llama.cpp#13694, fixed by PR #16825 ("llama: store mrope data in KV cell").
# Qwen2-VL / Qwen2.5-VL through mtmd: every token of an image gets the same temporal M-RoPE position
# (pos_0) and its row/column go into the y/x sections. The KV cell only kept pos[i] (the temporal one),
# and the kq_mask hid a cell only when p0 > p1, so the image tokens of one chunk all saw each other.
# Fix: keep (x, y) in llama_kv_cell_ext and, when p0 == p1, also hide a cell whose (y, x) comes later.
# Torch re-implementation of the KV cells, set_input_kq_mask and mtmd's set_position_mrope_{1d,2d}.
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class LlamaHparams:
    n_embd = 32
    n_head = 4
    n_layer = 2
    n_vocab = 64
    n_ctx = 32
    rope_sections = [2, 1, 1, 0]  # qwen2vl.rope.dimension_sections, in rotation pairs (head_dim / 2 = 4)
    rope_freq_base = 10000.0


class LlamaKvCellExt:
    # 2D spatial positions, typically used for M-RoPE
    def __init__(self, x=0, y=0):
        self.x, self.y = x, y

    def is_2d_gt(self, ox, oy):
        return (self.y > oy) or (self.y == oy and self.x > ox)


class LlamaKvCache:
    def __init__(self, hp):
        self.pos = [-1] * hp.n_ctx  # -1 = empty cell
        self.ext = [LlamaKvCellExt() for _ in range(hp.n_ctx)]
        self.k = [torch.zeros(hp.n_ctx, hp.n_embd) for _ in range(hp.n_layer)]
        self.v = [torch.zeros(hp.n_ctx, hp.n_embd) for _ in range(hp.n_layer)]
        self.head = 0

    def apply_ubatch(self, ubatch_pos, n_tokens):
        cells = list(range(self.head, self.head + n_tokens))
        for i, idx in enumerate(cells):
            self.pos[idx] = int(ubatch_pos[i])
            if FIXED and ubatch_pos.numel() > n_tokens:  # ubatch.is_pos_2d()
                self.ext[idx] = LlamaKvCellExt(x=int(ubatch_pos[i + n_tokens * 2]), y=int(ubatch_pos[i + n_tokens]))
        self.head += n_tokens
        return torch.tensor(cells)

    def set_input_kq_mask(self, ubatch_pos, n_tokens, causal=True):
        is_2d = ubatch_pos.numel() > n_tokens
        n_kv = len(self.pos)
        data = torch.full((n_tokens, n_kv), float("-inf"))
        for i in range(n_tokens):
            p1 = int(ubatch_pos[i])
            # for M-RoPE
            p1_x = int(ubatch_pos[i + n_tokens * 2]) if is_2d else 0
            p1_y = int(ubatch_pos[i + n_tokens]) if is_2d else 0
            for j in range(n_kv):
                p0 = self.pos[j]
                if p0 < 0:
                    continue
                # mask future tokens
                if causal and p0 > p1:
                    continue
                # M-RoPE causal mask
                if FIXED and causal and is_2d and p0 == p1:
                    if self.ext[j].is_2d_gt(p1_x, p1_y):
                        continue
                data[i, j] = 0.0
        return data


def rope_multi(x, pos4, hp):
    # ggml_rope_multi (GGML_ROPE_TYPE_MROPE): pair d uses the t, y, x or unused position by section
    n, nh, hd = x.shape
    sect = [s for k, s in enumerate(hp.rope_sections) for _ in range(s)]
    sect_id = torch.tensor([k for k, s in enumerate(hp.rope_sections) for _ in range(s)])
    assert len(sect) == hd // 2
    theta = hp.rope_freq_base ** (-torch.arange(hd // 2, dtype=torch.float32) * 2 / hd)
    p = pos4.view(4, n).t().float()[:, sect_id]  # [n, hd/2]
    ang = (p * theta)[:, None, :]
    x0, x1 = x[..., : hd // 2], x[..., hd // 2 :]  # NEOX layout
    return torch.cat([x0 * ang.cos() - x1 * ang.sin(), x0 * ang.sin() + x1 * ang.cos()], dim=-1)


class LlamaContext(nn.Module):
    def __init__(self, hp):
        super().__init__()
        self.hp = hp
        self.tok_embd = nn.Embedding(hp.n_vocab, hp.n_embd)
        self.wq = nn.ModuleList(nn.Linear(hp.n_embd, hp.n_embd) for _ in range(hp.n_layer))
        self.wk = nn.ModuleList(nn.Linear(hp.n_embd, hp.n_embd) for _ in range(hp.n_layer))
        self.wv = nn.ModuleList(nn.Linear(hp.n_embd, hp.n_embd) for _ in range(hp.n_layer))
        self.wo = nn.ModuleList(nn.Linear(hp.n_embd, hp.n_embd, bias=False) for _ in range(hp.n_layer))
        self.output = nn.Linear(hp.n_embd, hp.n_vocab, bias=False)
        self.kv = LlamaKvCache(hp)

    def decode(self, embd, pos4):
        hp, kv = self.hp, self.kv
        n_tokens = embd.shape[0]
        cells = kv.apply_ubatch(pos4, n_tokens)
        kq_mask = kv.set_input_kq_mask(pos4, n_tokens)
        hd = hp.n_embd // hp.n_head
        x = embd
        for il in range(hp.n_layer):
            kcur = rope_multi(self.wk[il](x).view(-1, hp.n_head, hd), pos4, hp)
            kv.k[il][cells] = kcur.reshape(-1, hp.n_embd)
            kv.v[il][cells] = self.wv[il](x)
            q = rope_multi(self.wq[il](x).view(-1, hp.n_head, hd), pos4, hp).transpose(0, 1)
            k = kv.k[il].view(-1, hp.n_head, hd).transpose(0, 1)
            v = kv.v[il].view(-1, hp.n_head, hd).transpose(0, 1)
            kq = torch.softmax((q @ k.transpose(-1, -2)) * hd ** -0.5 + kq_mask, dim=-1)  # ggml_soft_max_ext
            x = x + self.wo[il]((kq @ v).transpose(0, 1).reshape(-1, hp.n_embd))
        return x, self.output(x)


def set_position_mrope_1d(pos_0, n_tokens):
    pos = torch.zeros(n_tokens * 4, dtype=torch.long)
    for i in range(n_tokens):
        pos[i] = pos[i + n_tokens] = pos[i + n_tokens * 2] = pos_0 + i
        pos[i + n_tokens * 3] = 0  # last pos dim is unused
    return pos


def set_position_mrope_2d(pos_0, nx, ny):
    n_tokens = nx * ny
    pos = torch.zeros(n_tokens * 4, dtype=torch.long)
    for y in range(ny):
        for x in range(nx):
            i = y * nx + x
            pos[i] = pos_0
            pos[i + n_tokens] = pos_0 + y
            pos[i + n_tokens * 2] = pos_0 + x
            pos[i + n_tokens * 3] = 0
    return pos


def mtmd_helper_eval_chunks(ctx, chunks):
    n_past, outs = 0, []
    for kind, data in chunks:
        if kind == "text":
            embd = ctx.tok_embd(data)
            pos = set_position_mrope_1d(n_past, embd.shape[0])
            n_pos = embd.shape[0]
        else:
            embd, nx, ny = data
            pos = set_position_mrope_2d(n_past, nx, ny)
            n_pos = max(nx, ny)  # mtmd_image_tokens_get_n_pos for M-RoPE
        outs.append(ctx.decode(embd, pos))
        n_past += n_pos
    return outs


hp = LlamaHparams()
ctx = LlamaContext(hp).eval()
prompt = torch.randint(0, 64, (3,))
nx, ny = 3, 2
image_embd = torch.randn(nx * ny, hp.n_embd)  # output of the Qwen2-VL merger (one row-major grid)
suffix = torch.randint(0, 64, (4,))
chunks = [("text", prompt), ("image", (image_embd, nx, ny)), ("text", suffix)]
with torch.no_grad():
    (_, _), (img_h, _), (_, logits) = mtmd_helper_eval_chunks(ctx, chunks)
print("image hidden[0] norm: %.4f" % img_h[0].norm().item())
print("next token:", int(logits[-1].argmax()), "| last logits[:4]:", [round(v, 4) for v in logits[-1, :4].tolist()])
