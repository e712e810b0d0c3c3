# Citation: showlab/Show-o training/prompting_utils.py @f2716eb0b01b757f74bee0da77ad472a7670f722
#   (UniversalPrompting.mmu_prompt: [<|mmu|>] [<|soi|>] image tokens [<|eoi|>] text, text right-padded with pad_id;
#   create_attention_mask_for_mmu: tril causal mask with every column up to the first <|eoi|> opened, so the task
#   token + image block is bidirectional and the text after it is causal).
# The batch's image blocks all have the same length, so the <|eoi|> column is the same in every row. The mask is
# used as a bool keep-mask (return_inverse_mask=False), and'ed with the right-padding key mask, in a tiny
# Phi-style decoder (SDPA). Checked against each sample alone, unpadded, with a double-loop mask
# (key j visible to query i iff j <= i or j <= eoi): logits of real tokens and the MMU answer loss.
import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)

TEXT_VOCAB = 40
PAD_ID, MMU_ID, SOI_ID, EOI_ID = 40, 41, 42, 43
IMG_OFFSET, N_IMG_CODES, NUM_IMAGE_TOKENS = 44, 16, 6
VOCAB = IMG_OFFSET + N_IMG_CODES
IGNORE = -100


def mmu_prompt(image_ids, text_ids, max_text_len):
    sequence_ids, attention_masks, label_ids = [], [], []
    for i in range(len(text_ids)):
        temp_ids = text_ids[i][:max_text_len]
        n = len(temp_ids)
        temp_ids = temp_ids + [PAD_ID] * (max_text_len - n)
        temp_masks = [1] * (n + image_ids.shape[-1] + 3) + [0] * (max_text_len - n)
        temp_label_ids = torch.cat([
            torch.tensor([IGNORE, IGNORE]),
            torch.ones_like(image_ids[i]) * IGNORE,
            torch.tensor([IGNORE]),
            torch.tensor(temp_ids),
        ])
        temp_label_ids = torch.where(temp_label_ids == PAD_ID, IGNORE, temp_label_ids)
        seq = torch.cat([torch.tensor([MMU_ID, SOI_ID]), image_ids[i], torch.tensor([EOI_ID]), torch.tensor(temp_ids)])
        sequence_ids.append(seq[None])
        attention_masks.append(torch.tensor(temp_masks)[None])
        label_ids.append(temp_label_ids[None])
    return torch.cat(sequence_ids), torch.cat(attention_masks), torch.cat(label_ids)


def create_attention_mask_for_mmu(sequence, eoi_id=EOI_ID, return_inverse_mask=True):
    N, L = sequence.shape
    causal_mask = torch.tril(torch.ones((N, 1, L, L), dtype=torch.bool)).to(sequence.device)
    eoi_image = torch.where(sequence == eoi_id)[1]
    causal_mask[:, :, :, :eoi_image[0] + 1] = 1
    if return_inverse_mask:
        inverted_mask = 1.0 - causal_mask.type(sequence.dtype)
        inverted_mask = inverted_mask.masked_fill(inverted_mask.to(torch.bool), torch.iinfo(sequence.dtype).min)
        return inverted_mask
    return causal_mask


class PhiLayer(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.h = h
        self.input_layernorm = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.dense = nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x, attn_mask):
        B, L, D = x.shape
        hs = self.input_layernorm(x)
        q, k, v = self.qkv(hs).view(B, L, 3, self.h, D // self.h).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
        a = self.dense(a.transpose(1, 2).reshape(B, L, D))
        return x + a + self.mlp(hs)  # Phi: parallel attention and MLP


class Showo(nn.Module):
    def __init__(self, d=32, h=4, n_layers=2, max_len=64):
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, d)
        self.pos = nn.Embedding(max_len, d)
        self.layers = nn.ModuleList([PhiLayer(d, h) for _ in range(n_layers)])
        self.final_layernorm = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, VOCAB)

    def forward(self, input_ids, attention_mask):
        L = input_ids.size(1)
        x = self.embed_tokens(input_ids) + self.pos(torch.arange(L))[None]
        for layer in self.layers:
            x = layer(x, attention_mask)
        return self.lm_head(self.final_layernorm(x))


def main():
    model = Showo().eval()
    B, max_text_len = 3, 7
    image_ids = torch.randint(0, N_IMG_CODES, (B, NUM_IMAGE_TOKENS)) + IMG_OFFSET
    text_ids = [torch.randint(0, TEXT_VOCAB, (n,)).tolist() for n in (7, 3, 5)]
    input_ids, attention_mask, labels = mmu_prompt(image_ids, text_ids, max_text_len)
    mask = create_attention_mask_for_mmu(input_ids, return_inverse_mask=False)  # (B, 1, L, L) keep
    mask = mask & attention_mask.bool()[:, None, None, :]
    with torch.no_grad():
        logits = model(input_ids, mask)
        eoi = NUM_IMAGE_TOKENS + 2
        for b in range(B):
            n = int(attention_mask[b].sum())
            ids = input_ids[b, :n]
            keep = torch.zeros(n, n, dtype=torch.bool)
            for i in range(n):
                for j in range(n):
                    keep[i, j] = j <= i or j <= eoi
            ref = model(ids[None], keep)
            assert torch.allclose(logits[b, :n], ref[0], atol=1e-5), b
            lp = F.cross_entropy(logits[b, :-1], labels[b, 1:], ignore_index=IGNORE)
            lr = F.cross_entropy(ref[0, :-1], labels[b, 1:n], ignore_index=IGNORE)
            assert torch.allclose(lp, lr, atol=1e-5), b
    print("ok: Show-o MMU mask (bidirectional image prefix, causal text, right pad) matches per-sample reference")


if __name__ == "__main__":
    main()
