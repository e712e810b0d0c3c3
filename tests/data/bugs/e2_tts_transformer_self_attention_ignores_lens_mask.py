# e2-tts-pytorch (lucidrains/e2-tts-pytorch commit 58288b2, "rotary embedding and fix self attn mask"):
# Transformer.forward received the padding mask built by lens_to_mask(lens) but called attn(attn_norm(x)) without
# it, so padded mel frames of a batch were attended to (the DurationPredictor / flow transformer mixed in padding).
import sys
import torch
from torch import nn
import torch.nn.functional as F
from torch.nn import Module, ModuleList

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


def exists(v):
    return v is not None


def lens_to_mask(t, length=None):
    if not exists(length):
        length = t.amax()
    seq = torch.arange(length, device=t.device)
    return seq[None, :] < t[:, None]  # einx.less('n, b -> b n', seq, t)


def maybe_masked_mean(t, mask=None):
    if not exists(mask):
        return t.mean(dim=1)
    t = torch.where(mask[..., None], t, 0.0)
    num = t.sum(dim=1)
    den = mask.float().sum(dim=1)
    return num / den.clamp(min=1.0)[:, None]


# --- x_transformers pieces used by e2_tts.py (RMSNorm, FeedForward, Attention with a (b, n) key mask) ---
class RMSNorm(Module):
    def __init__(self, dim):
        super().__init__()
        self.scale = dim ** 0.5
        self.g = nn.Parameter(torch.zeros(dim))

    def forward(self, x):
        return F.normalize(x, dim=-1) * self.scale * (self.g + 1)


class FeedForward(Module):
    def __init__(self, dim, mult=4):
        super().__init__()
        self.ff = nn.Sequential(nn.Linear(dim, dim * mult), nn.GELU(), nn.Linear(dim * mult, dim))

    def forward(self, x):
        return self.ff(x)


class Attention(Module):
    def __init__(self, dim, dim_head=8, heads=4):
        super().__init__()
        self.heads, self.scale = heads, dim_head ** -0.5
        self.to_q = nn.Linear(dim, dim_head * heads, bias=False)
        self.to_k = nn.Linear(dim, dim_head * heads, bias=False)
        self.to_v = nn.Linear(dim, dim_head * heads, bias=False)
        self.to_out = nn.Linear(dim_head * heads, dim, bias=False)

    def forward(self, x, mask=None):
        b, n, _ = x.shape
        h = self.heads
        q, k, v = (t(x).view(b, n, h, -1).transpose(1, 2) for t in (self.to_q, self.to_k, self.to_v))
        sim = torch.einsum("b h i d, b h j d -> b h i j", q, k) * self.scale
        if exists(mask):
            input_mask = mask[:, None, None, :]  # 'b j -> b 1 1 j'
            sim = sim.masked_fill(~input_mask, -torch.finfo(sim.dtype).max)
        attn = sim.softmax(dim=-1)
        out = torch.einsum("b h i j, b h j d -> b h i d", attn, v)
        return self.to_out(out.transpose(1, 2).reshape(b, n, -1))


class CharacterEmbed(Module):
    def __init__(self, dim, num_embeds=256):
        super().__init__()
        self.embed = nn.Embedding(num_embeds + 1, dim)  # will just use 0 as the 'filler token'
        self.combine = nn.Linear(dim * 2, dim)

    def forward(self, x, text):
        max_seq_len = x.shape[1]
        text_mask = text == -1
        text = text + 1
        text = text.masked_fill(text_mask, 0)
        text = text[:, :max_seq_len]
        text = F.pad(text, (0, max_seq_len - text.shape[1]), value=0)
        return self.combine(torch.cat((x, self.embed(text)), dim=-1))


class Transformer(Module):
    def __init__(self, *, dim, depth, skip_connect_type="concat", max_seq_len=64):
        super().__init__()
        assert depth % 2 == 0
        self.abs_pos_emb = nn.Embedding(max_seq_len, dim)
        self.dim, self.depth, self.skip_connect_type = dim, depth, skip_connect_type
        self.layers = ModuleList([])
        for _ in range(depth):
            self.layers.append(ModuleList([
                nn.Linear(dim * 2, dim, bias=False), RMSNorm(dim), Attention(dim=dim), RMSNorm(dim), FeedForward(dim=dim),
            ]))
        self.final_norm = RMSNorm(dim)

    def forward(self, x, times=None, mask=None):
        batch, seq_len = x.shape[:2]
        x = x + self.abs_pos_emb(torch.arange(seq_len))
        skips = []
        for ind, (maybe_skip_proj, attn_norm, attn, ff_norm, ff) in enumerate(self.layers):
            layer = ind + 1
            is_first_half = layer <= (self.depth // 2)
            if is_first_half:
                skips.append(x)
            else:
                skip = skips.pop()
                x = maybe_skip_proj(torch.cat((x, skip), dim=-1))
            # attention and feedforward blocks
            if FIXED:
                x = attn(attn_norm(x), mask=mask) + x
            else:
                x = attn(attn_norm(x)) + x
            x = ff(ff_norm(x)) + x
        return self.final_norm(x)


class DurationPredictor(Module):
    def __init__(self, transformer, text_num_embeds=256):
        super().__init__()
        self.transformer = transformer
        dim = transformer.dim
        self.dim = dim
        self.embed_text = CharacterEmbed(dim, num_embeds=text_num_embeds)
        self.to_pred = nn.Sequential(nn.Linear(dim, 1, bias=False), nn.Softplus())

    def forward(self, x, *, text=None, lens=None, return_loss=True):
        batch, seq_len = x.shape[:2]
        if exists(text):
            x = self.embed_text(x, text)
        if not exists(lens):
            lens = torch.full((batch,), seq_len)
        mask = lens_to_mask(lens, length=seq_len)
        x = self.transformer(x, mask=mask)
        x = maybe_masked_mean(x, mask)
        pred = self.to_pred(x).squeeze(-1)
        if not return_loss:
            return pred
        return F.mse_loss(pred, lens.float())


dim = 32
model = DurationPredictor(Transformer(dim=dim, depth=2)).eval()

lens = torch.tensor([20, 11])
mel = torch.randn(2, 20, dim)
mel = mel * lens_to_mask(lens, 20)[..., None]  # padded mel frames (collate pads with 0)
text = torch.randint(0, 256, (2, 9))
text[1, 6:] = -1  # list_str_to_tensor pads text with -1

with torch.no_grad():
    batched = model(mel, text=text, lens=lens, return_loss=False)
    alone = model(mel[1:, :11], text=text[1:, :6], lens=lens[1:], return_loss=False)
print(f"short utterance duration: batched {batched[1].item():.6f} vs alone {alone[0].item():.6f}, "
      f"|diff| = {(batched[1] - alone[0]).abs().item():.6f}")
