"""Show-o: the FlexAttention omni-attention mask for text-to-image batches, causal part joined to the diagonal by XOR.

Citation: showlab/Show-o commit c7428c2 ("fix bugs in omni attention"), training/omni_attention.py.

Show-o trains text-to-image on sequences laid out as
    [pad][pad][t2i][sot][text][text][eot][soi][image][image]...[eoi]
(text left-padded to a fixed length, image tokens at fixed positions). Its omni-attention is causal
over the text (padding excluded) and full over the image tokens. OmniAttentionMechanism.t2i_mask,
the FlexAttention mask_mod, wrote the causal part with the diagonal meant "to avoid the NaN issue"
of a padding query that sees no key:

    causal_mask = ~((kv_idx < self.pad_ends[b, kv_idx])) & ((q_idx >= kv_idx)) ^ (q_idx == kv_idx)

`&` binds tighter than `^`, and for a real key on the diagonal the left side is already True, so
XOR turns it off: every real text token loses its own key (the first real token of a row keeps no
key at all), while padding queries keep theirs.
Fix: `... & ((q_idx >= kv_idx)) | (q_idx == kv_idx)` (same change in mixed_mask).

The program ports the class as written (pad_begin_ends per row, create_block_mask per batch) on
CPU, without torch.compile, and runs one Show-o-style t2i evaluation step (FlexAttention has no
backward on CPU): a tiny Phi-like decoder whose layers call flex_attention with the block mask,
image tokens randomly replaced by the mask token, cross-entropy over the masked image positions.
"""
import sys
import warnings

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

FIXED = "--fixed" in sys.argv

warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")

DEVICE = "cpu"


# Class for Omni-Attention Mechanism based on FlexAttention (torch >= 2.5)
class OmniAttentionMechanism(torch.nn.Module):
    def __init__(self, batch_size_t2i, batch_size_lm, batch_size_mmu, S, t2i_image_begin_end=[(128, 1152)],
                 mmu_end=1027, right_padding=[(1024, 1280)], device=DEVICE):
        super().__init__()

        self.batch_size_t2i = batch_size_t2i
        self.batch_size_lm = batch_size_lm
        self.batch_size_mmu = batch_size_mmu

        self.t2i_image_begin_end = t2i_image_begin_end
        self.t2i_full_begin = torch.arange(S, device=device)
        self.t2i_full_end = torch.arange(S, device=device)
        for image_begin, image_end in t2i_image_begin_end:
            self.t2i_full_begin[image_begin:image_end] = image_begin
            self.t2i_full_end[image_begin:image_end] = image_end

        self.mmu_end = mmu_end

    def causal_mask(self, b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx)

    def t2i_mask(self, b, h, q_idx, kv_idx):
        """
        t2i sequence = [
                    [pad][pad][t2i][sot][text][text][eot][soi][image][image][eoi]
                    [pad][t2i][sot][text][text][text][eot][soi][image][image][eoi]
        ]
        left padding for the text
        """
        # causal mask that excludes padding regions
        # eye_mask = (q_idx == kv_idx) to avoid the NaN issue
        if FIXED:
            causal_mask = ~((kv_idx < self.pad_ends[b, kv_idx])) & ((q_idx >= kv_idx)) | (q_idx == kv_idx)
        else:
            causal_mask = ~((kv_idx < self.pad_ends[b, kv_idx])) & ((q_idx >= kv_idx)) ^ (q_idx == kv_idx)
        full_mask = (kv_idx < self.t2i_full_end[q_idx]) & (kv_idx >= self.t2i_full_begin[q_idx])

        return (causal_mask | full_mask)

    def mmu_mask(self, b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) | (kv_idx < self.mmu_end)

    def create_block_mask(self, sequence, pad_begin_ends=[(0, 80), (0, 100), (0, 110), (0, 0)], type="t2i"):
        B, S = sequence.shape
        self.pad_begins = torch.arange(S, device=DEVICE).repeat(B, 1)
        self.pad_ends = torch.arange(S, device=DEVICE).repeat(B, 1)

        cnt = 0
        for pb, pe in pad_begin_ends:
            self.pad_begins[cnt, pb:pe] = pb
            self.pad_ends[cnt, pb:pe] = pe
            cnt += 1

        # this torch's create_block_mask wants a plain function, not a bound method
        if type == "t2i":
            mask_mod = lambda b, h, q_idx, kv_idx: self.t2i_mask(b, h, q_idx, kv_idx)
        elif type == "mmu":
            mask_mod = lambda b, h, q_idx, kv_idx: self.mmu_mask(b, h, q_idx, kv_idx)
        elif type == "causal":
            mask_mod = lambda b, h, q_idx, kv_idx: self.causal_mask(b, h, q_idx, kv_idx)
        else:
            raise ValueError("Unknown type")
        block_mask = create_block_mask(mask_mod, B=B, H=None, Q_LEN=S, KV_LEN=S, device=DEVICE)

        return block_mask


# ---- a tiny Phi-like backbone whose attention runs through flex_attention ----
class Config:
    text_vocab = 64
    codebook_size = 32
    n_special = 6            # pad, t2i, sot, eot, soi, eoi
    hidden = 48
    heads = 4
    layers = 2
    max_text_len = 12        # t2i + sot + text + eot, left-padded
    num_image_tokens = 16


CFG = Config()
PAD, T2I, SOT, EOT, SOI, EOI = range(CFG.text_vocab, CFG.text_vocab + CFG.n_special)
IMG0 = CFG.text_vocab + CFG.n_special
MASK_ID = IMG0 + CFG.codebook_size
VOCAB = MASK_ID + 1
SEQ = CFG.max_text_len + 1 + CFG.num_image_tokens + 1


class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.ln = nn.LayerNorm(cfg.hidden)
        self.qkv = nn.Linear(cfg.hidden, 3 * cfg.hidden)
        self.dense = nn.Linear(cfg.hidden, cfg.hidden)
        self.fc1 = nn.Linear(cfg.hidden, 4 * cfg.hidden)
        self.fc2 = nn.Linear(4 * cfg.hidden, cfg.hidden)
        self.heads = cfg.heads

    def forward(self, x, block_mask):
        B, S, D = x.shape
        h = self.ln(x)
        q, k, v = self.qkv(h).view(B, S, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        attn = flex_attention(q, k, v, block_mask=block_mask)
        attn = attn.transpose(1, 2).reshape(B, S, D)
        # Phi's parallel block: attention and MLP read the same normed input
        return x + self.dense(attn) + self.fc2(F.gelu(self.fc1(h)))


class TinyShowo(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, cfg.hidden)
        self.pos = nn.Embedding(SEQ, cfg.hidden)
        self.blocks = nn.ModuleList([Block(cfg) for _ in range(cfg.layers)])
        self.ln_f = nn.LayerNorm(cfg.hidden)
        self.lm_head = nn.Linear(cfg.hidden, VOCAB)

    def forward(self, input_ids, block_mask, labels=None):
        x = self.embed(input_ids) + self.pos(torch.arange(input_ids.shape[1]))
        for blk in self.blocks:
            x = blk(x, block_mask)
        logits = self.lm_head(self.ln_f(x))
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=-100)
        return logits, loss


def t2i_prompt(text_ids, image_ids, max_text_len):
    """UniversalPrompting-style t2i sequence: left-padded text prompt, then soi + image + eoi."""
    prompt = [T2I, SOT] + text_ids + [EOT]
    prompt = [PAD] * (max_text_len - len(prompt)) + prompt
    return prompt + [SOI] + image_ids + [EOI]


def main():
    torch.manual_seed(0)
    model = TinyShowo(CFG)

    texts = [[3, 17, 5, 9, 22, 40, 11], [8, 2], [30, 12, 7, 1, 19]]
    images = [torch.randint(0, CFG.codebook_size, (CFG.num_image_tokens,)).tolist() for _ in texts]
    input_ids = torch.tensor([t2i_prompt(t, [IMG0 + c for c in img], CFG.max_text_len)
                              for t, img in zip(texts, images)])
    B, S = input_ids.shape

    # MaskGIT-style objective on the image tokens
    image_begin = CFG.max_text_len + 1
    image_end = image_begin + CFG.num_image_tokens
    labels = torch.full_like(input_ids, -100)
    mask_prob = torch.rand(B, CFG.num_image_tokens) < 0.6
    labels[:, image_begin:image_end] = torch.where(mask_prob, input_ids[:, image_begin:image_end], -100)
    input_ids[:, image_begin:image_end] = torch.where(mask_prob, MASK_ID, input_ids[:, image_begin:image_end])

    oam = OmniAttentionMechanism(B, 0, 0, S, t2i_image_begin_end=[(image_begin, image_end)],
                                 mmu_end=image_end + 1)
    n_pad = (input_ids == PAD).sum(dim=1).tolist()
    pad_begin_ends = [(0, n) for n in n_pad]
    block_mask = oam.create_block_mask(input_ids, pad_begin_ends=pad_begin_ends, type="t2i")

    # FlexAttention has no backward on CPU: the step here is the t2i validation loss
    with torch.no_grad():
        logits, loss = model(input_ids, block_mask, labels=labels)

    print("pads per row:", n_pad)
    print(f"t2i loss: {loss.item():.6f}")
    first_real = n_pad[1]
    print("row 1 first real token logits[:4]:", [round(v, 4) for v in logits[1, first_real, :4].tolist()])


if __name__ == "__main__":
    main()
